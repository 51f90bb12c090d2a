"""Selective checkpointing, named tensors, ready-made policies and offload."""

import functools

import pytest
import torch
from helpers import MLPStack, assert_bitwise, grads
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat import CheckpointPolicy
from remat.policies import offload_names, save_all_but_names, save_matmuls, save_names, save_nothing

MM = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


class CountOps(TorchDispatchMode):
    def __init__(self, ops):
        super().__init__()
        self.ops, self.count = ops, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.ops
        return func(*args, **(kwargs or {}))


def two_matmuls(x, w1, w2):
    return ((x @ w1).relu() @ w2).sin()


def _backward_mm_count(run):
    torch.manual_seed(0)
    x, w1, w2 = (torch.randn(8, 8, requires_grad=True) for _ in range(3))
    out = run(x, w1, w2)
    with CountOps(MM) as counter:
        out.sum().backward()
    return counter.count


def test_save_matmuls_reruns_no_forward_matmul_and_recompute_all_reruns_both():
    plain = _backward_mm_count(two_matmuls)
    full = _backward_mm_count(lambda *a: remat.checkpoint(two_matmuls, *a))
    keep = _backward_mm_count(lambda *a: remat.checkpoint(two_matmuls, *a, policy=save_matmuls))

    def must_recompute(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_RECOMPUTE

    nothing = _backward_mm_count(lambda *a: remat.checkpoint(two_matmuls, *a, policy=must_recompute))
    assert keep == plain  # only the gradient matmuls
    assert full == nothing == plain + 2


def test_op_list_policy_and_packet_rejection():
    x, w1, w2 = (torch.randn(4, 4, requires_grad=True) for _ in range(3))
    ctx = functools.partial(remat.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    expected = grads(lambda: two_matmuls(x, w1, w2).sum(), [x, w1, w2])[1]
    got = grads(lambda: remat.checkpoint(two_matmuls, x, w1, w2, context_fn=ctx).sum(), [x, w1, w2])[1]
    assert_bitwise(expected, got)
    with pytest.raises(ValueError, match=r"torch\.ops\.aten\.mm\.default"):
        remat.create_selective_checkpoint_contexts([torch.ops.aten.mm])


def _kept_and_grads(policy, fn, inputs):
    stats = remat.OffloadStats()
    ctx = functools.partial(remat.create_selective_checkpoint_contexts, policy, stats=stats)
    got = grads(lambda: remat.checkpoint(fn, *inputs, context_fn=ctx).sum(), list(inputs))[1]
    return stats, got


def named_block(x, w):
    a = remat.tag(x @ w, "a")  # 16x32 floats = 2048 bytes
    b = remat.tag(a.relu() @ w.t(), "b")  # 16x16
    return (b.tanh() * a.mean()).sin()


def test_save_names_keeps_exactly_the_tagged_tensor():
    x, w = torch.randn(16, 16, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    stats, got = _kept_and_grads(save_names("a"), named_block, (x, w))
    assert (stats.kept_tensors, stats.kept_bytes) == (1, 16 * 32 * 4)
    assert stats.offloaded_tensors == 0
    assert_bitwise(grads(lambda: named_block(x, w).sum(), [x, w])[1], got)


def test_save_all_but_names_and_combination():
    x, w = torch.randn(16, 16, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    expected = grads(lambda: named_block(x, w).sum(), [x, w])[1]
    stats, got = _kept_and_grads(save_all_but_names("a"), named_block, (x, w))
    assert_bitwise(expected, got)
    assert stats.kept_tensors > 0 and stats.kept_bytes % 4 == 0
    all_but_a = stats.kept_bytes
    stats, got = _kept_and_grads(save_all_but_names("a") | save_names("a"), named_block, (x, w))
    # MUST_SAVE (save_names) beats MUST_RECOMPUTE at equal strength: "a" is kept again.
    assert stats.kept_bytes == all_but_a + 16 * 32 * 4
    assert_bitwise(expected, got)
    stats, _ = _kept_and_grads(save_nothing, named_block, (x, w))
    assert stats.kept_tensors == 0


def test_offload_names_moves_exactly_the_selected_bytes():
    x, w = torch.randn(16, 16, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    stats, got = _kept_and_grads(save_matmuls | offload_names("b"), named_block, (x, w))
    assert (stats.offloaded_tensors, stats.offloaded_bytes) == (1, 16 * 16 * 4)
    assert (stats.kept_tensors, stats.kept_bytes) == (1, 16 * 32 * 4)  # "a", kept by save_matmuls
    assert_bitwise(grads(lambda: named_block(x, w).sum(), [x, w])[1], got)


def test_tag_is_free_and_transparent_outside_a_policy():
    x = torch.randn(4, requires_grad=True)
    y = remat.tag(x * 2, "y")
    assert y.grad_fn is not None and torch.equal(y, x * 2)
    (g,) = torch.autograd.grad(remat.tag(x.sin(), "s").sum(), x)
    assert torch.equal(g, x.cos())


def test_tagging_a_view_is_a_clear_error():
    def fn(t):
        return remat.tag(t.exp().view(-1), "v").sum()

    with pytest.raises(ValueError, match="view or in-place"):
        remat.checkpoint(fn, torch.randn(2, 2, requires_grad=True), policy=save_names("v"))


def test_dropout_inside_a_selective_region_is_bitwise_equal():
    torch.manual_seed(0)
    model = MLPStack(depth=3, p=0.3)
    x = torch.randn(8, 16, requires_grad=True)
    params = [x, *model.parameters()]
    expected = grads(lambda: model(x).pow(2).sum(), params, seed=9)

    def keep_dropout_and_mm(ctx, op, *args, **kwargs):
        keep = op in (torch.ops.aten.native_dropout.default, torch.ops.aten.addmm.default)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    for policy in (save_matmuls, keep_dropout_and_mm, save_nothing):
        got = grads(lambda p=policy: model(x, wrap=functools.partial(remat.checkpoint, policy=p)).pow(2).sum(),
                    params, seed=9)
        assert torch.equal(expected[0], got[0])
        assert_bitwise(expected[1], got[1])


def test_mutating_a_kept_output_is_an_error_unless_allowed():
    w = torch.randn(4, 4, requires_grad=True)
    leak = {}

    def fn(t):
        h = t @ w
        leak["h"] = h
        return h.sin()

    y = remat.checkpoint(fn, torch.randn(4, 4, requires_grad=True), policy=save_matmuls)
    with torch.no_grad():
        leak["h"].add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        y.sum().backward()
    ctx = functools.partial(remat.create_selective_checkpoint_contexts, save_matmuls, allow_cache_entry_mutation=True)
    y = remat.checkpoint(fn, torch.randn(4, 4, requires_grad=True), context_fn=ctx)
    with torch.no_grad():
        leak["h"].add_(1.0)
    y.sum().backward()


def test_selective_region_survives_retain_graph():
    x, w1, w2 = (torch.randn(4, 4, requires_grad=True) for _ in range(3))
    y = remat.checkpoint(two_matmuls, x, w1, w2, policy=save_matmuls)
    first = torch.autograd.grad(y.sum(), [w1, w2], retain_graph=True)
    second = torch.autograd.grad(y.sum(), [w1, w2])
    assert_bitwise(first, second)


def test_policy_and_context_fn_together_is_an_error():
    with pytest.raises(ValueError, match="either policy= or context_fn="):
        remat.checkpoint(torch.sin, torch.randn(2, requires_grad=True), policy=save_matmuls,
                         context_fn=lambda: remat.noop_context_fn())


def test_policy_functions_may_return_torchs_enum_or_bools():
    import torch.utils.checkpoint as torch_ckpt

    x, w1, w2 = (torch.randn(4, 4, requires_grad=True) for _ in range(3))
    expected = grads(lambda: two_matmuls(x, w1, w2).sum(), [w1, w2])[1]
    torch_style = [
        lambda ctx, op, *a, **k: torch_ckpt.CheckpointPolicy.MUST_SAVE if op in MM
        else torch_ckpt.CheckpointPolicy.PREFER_RECOMPUTE,
        lambda ctx, op, *a, **k: op in MM,
    ]
    for policy in torch_style:
        assert_bitwise(expected, grads(lambda p=policy: remat.checkpoint(two_matmuls, x, w1, w2, policy=p).sum(),
                                       [w1, w2])[1])
    with pytest.raises(ValueError, match="must return a CheckpointPolicy"):
        remat.checkpoint(two_matmuls, x, w1, w2, policy=lambda ctx, op, *a, **k: "save")
