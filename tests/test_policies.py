"""Selective checkpointing, named tensors, ready-made policies and offload."""

import functools

import pytest
import torch
from helpers import MM, CountOps, MLPStack, assert_bitwise, grads

import remat
from remat import CheckpointPolicy
from remat.policies.rules import offload_names, save_all_but_names, save_matmuls, save_names, save_nothing


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


# ---- in-place changes to kept outputs ---------------------------------------------------------------------------
class SqueezeExcite(torch.nn.Module):
    """As in timm's EfficientNet: an in-place SiLU on the output of the reducing convolution."""

    def __init__(self, channels: int, reduced: int) -> None:
        super().__init__()
        self.reduce = torch.nn.Conv2d(channels, reduced, 1)
        self.act = torch.nn.SiLU(inplace=True)
        self.expand = torch.nn.Conv2d(reduced, channels, 1)

    def forward(self, x):
        scale = self.act(self.reduce(x.mean((2, 3), keepdim=True)))
        return x * self.expand(scale).sigmoid()


class ConvSE(torch.nn.Module):
    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.se = SqueezeExcite(channels, 2)

    def forward(self, x):
        return self.se(self.conv(x).relu())


CONV = {torch.ops.aten.convolution.default}


def _conv_se_case():
    torch.manual_seed(0)
    block = ConvSE()
    x = torch.randn(2, 8, 6, 6, requires_grad=True)
    return block, x, [x, *block.parameters()]


def test_kept_output_modified_in_place_by_the_region_is_recomputed_not_served():
    block, x, params = _conv_se_case()
    expected = grads(lambda: block(x).pow(2).sum(), params)[1]
    keep_conv = functools.partial(remat.create_selective_checkpoint_contexts, list(CONV))
    for run in (lambda: remat.checkpoint(block, x, policy=save_matmuls),
                lambda: remat.checkpoint(block, x, context_fn=keep_conv)):
        assert_bitwise(expected, grads(lambda r=run: r().pow(2).sum(), params)[1])
    # Only the convolution whose output the SiLU overwrote runs again (plain backward runs none forward).
    out = remat.checkpoint(block, x, policy=save_matmuls)
    with CountOps(CONV) as counter:
        out.pow(2).sum().backward()
    plain_out = block(x)
    with CountOps(CONV) as plain_counter:
        plain_out.pow(2).sum().backward()
    assert counter.count == plain_counter.count + 1


def test_efficientnet_b0_squeeze_excite_under_save_matmuls_is_bitwise_equal():
    import copy

    pytest.importorskip("transformers")
    from zoo import efficientnet

    plain = efficientnet().model  # its SiLUs in place, the squeeze-excite's among them
    wrapped = copy.deepcopy(plain)
    assert remat.apply_activation_checkpointing(wrapped, check_fn=lambda m: type(m).__name__ == "EfficientNetBlock",
                                                policy=save_matmuls)
    x = torch.randn(2, 3, 32, 32)

    def loss(model):
        torch.manual_seed(1)  # the same dropout masks in both
        return model(x).logits.pow(2).sum()

    expected = grads(lambda: loss(plain), list(plain.parameters()))
    got = grads(lambda: loss(wrapped), list(wrapped.parameters()))
    assert torch.equal(expected[0], got[0])
    assert_bitwise(expected[1], got[1])


def _kept_then_modified(t, w):
    h = t @ w  # kept by save_matmuls; the caller modifies it after forward
    return h, (h + 1).exp()  # exp saves its result, not h: plain autograd allows h to change


def test_user_modifying_a_kept_output_after_forward():
    torch.manual_seed(0)
    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)

    def loss(run):
        h, e = run(x, w)
        with torch.no_grad():
            h.mul_(3.0)
        return e.sum() + h.sum()

    expected = grads(lambda: loss(_kept_then_modified), [x, w])[1]
    with pytest.raises(RuntimeError, match="allow_cache_entry_mutation=True"):
        grads(lambda: loss(lambda *a: remat.checkpoint(_kept_then_modified, *a, policy=save_matmuls)), [x, w])
    allow = functools.partial(remat.create_selective_checkpoint_contexts, save_matmuls,
                              allow_cache_entry_mutation=True)
    got = grads(lambda: loss(lambda *a: remat.checkpoint(_kept_then_modified, *a, context_fn=allow)), [x, w])[1]
    assert_bitwise(expected, got)  # recomputed, not served modified: PyTorch's flag gives wrong gradients here


# ---- policies x nesting x backward modes ------------------------------------------------------------------------
def _keep_mm_fn(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in MM else CheckpointPolicy.PREFER_RECOMPUTE


POLICIES = {
    "save_matmuls": save_matmuls,
    "function": _keep_mm_fn,
    "op list": [torch.ops.aten.mm.default],
    "save all": save_all_but_names(),
    "second mm call": remat.policies.Policy(
        call_rule=lambda op, i: CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default and i == 1 else None),
    "nothing": save_nothing,
}


def _inner(t, w):
    h = (t @ w).relu_()  # a kept output changed in place by its region
    return torch.nn.functional.dropout(h @ w, 0.3).sin()


def _outer(t, w, inner_policy):
    a = t @ w
    b = _inner(a.tanh(), w) if inner_policy is None else remat.checkpoint(_inner, a.tanh(), w, policy=inner_policy)
    apart = (t.t() @ w).exp()  # shares no node with b's graph
    return apart, (b * a).cos()


def _gradients(run, mode, leaves):
    torch.manual_seed(7)
    a, b = run()
    if mode == "backward":
        return list(torch.autograd.grad(b.sum() + a.sum(), leaves))
    if mode == "retain twice":
        loss = b.sum() + a.sum()
        return [*torch.autograd.grad(loss, leaves, retain_graph=True), *torch.autograd.grad(loss, leaves)]
    # two backward calls over disjoint parts of the graph, neither retaining it: the region is recomputed twice
    first = torch.autograd.grad(b.sum(), leaves)
    return [*first, *torch.autograd.grad(a.sum(), leaves)]


@pytest.mark.parametrize("mode", ["backward", "retain twice", "parts"])
@pytest.mark.parametrize("inner", ["not nested", "same policy", "save_matmuls", "nothing"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_policies_nesting_and_backward_modes_are_bitwise_equal(policy, inner, mode):
    torch.manual_seed(0)
    x, w = torch.randn(6, 6, requires_grad=True), torch.randn(6, 6, requires_grad=True)
    outer_policy = POLICIES[policy]
    inner_policy = {"not nested": None, "same policy": outer_policy}.get(inner, POLICIES.get(inner))
    expected = _gradients(lambda: _outer(x, w, None), mode, [x, w])

    def run():
        return remat.checkpoint(_outer, x, w, inner_policy, policy=outer_policy)

    assert_bitwise(expected, _gradients(run, mode, [x, w]))


def test_a_retained_graph_is_served_kept_outputs_again():
    x, w1, w2 = (torch.randn(8, 8, requires_grad=True) for _ in range(3))
    y = remat.checkpoint(two_matmuls, x, w1, w2, policy=save_matmuls)
    counts = []
    for retain in (True, True, False):
        with CountOps(MM) as counter:
            torch.autograd.grad(y.sum(), [x, w1, w2], retain_graph=retain)
        counts.append(counter.count)
    assert counts == [4, 4, 4]  # gradient matmuls only, every time: kept outputs served three times


def _two_heads(t, w):
    # The kept matmul outputs are not what sin and cos save (those are recomputed from them).
    return (t @ w + 1).sin(), (t.t() @ w + 1).cos()


def test_a_backward_that_frees_the_graph_releases_kept_outputs_and_a_later_one_recomputes_them():
    x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    a, b = _two_heads(x, w)
    expected = [*torch.autograd.grad(a.sum(), [x, w]), *torch.autograd.grad(b.sum(), [x, w])]
    a, b = remat.checkpoint(_two_heads, x, w, policy=save_matmuls)
    with CountOps(MM) as first:
        got = list(torch.autograd.grad(a.sum(), [x, w]))
    with CountOps(MM) as second:
        got += torch.autograd.grad(b.sum(), [x, w])
    assert_bitwise(expected, got)
    assert (first.count, second.count) == (2, 4)  # served, then released: the second recomputation reruns both


def test_a_call_rule_decides_by_call_index():
    keep_second = remat.policies.Policy(
        call_rule=lambda op, i: CheckpointPolicy.MUST_SAVE if (op, i) == (torch.ops.aten.mm.default, 1) else None)
    plain = _backward_mm_count(two_matmuls)
    assert _backward_mm_count(lambda *a: remat.checkpoint(two_matmuls, *a, policy=keep_second)) == plain + 1
    with pytest.raises(TypeError, match="call index"):
        keep_second(None, torch.ops.aten.mm.default)


# ---- memory -----------------------------------------------------------------------------------------------------
def test_kept_outputs_are_released_once_served_peak_at_most_torchs():
    import torch.utils.checkpoint as torch_ckpt

    from remat.models import GPT, Block, GPTConfig, synthetic_batch
    from remat.policies.rules import MATMUL_OPS

    def keep_matmuls(ctx, op, *args, **kwargs):
        return torch_ckpt.CheckpointPolicy.MUST_SAVE if op in MATMUL_OPS else \
            torch_ckpt.CheckpointPolicy.PREFER_RECOMPUTE

    cfg = GPTConfig(n_layers=2, d_model=32, n_heads=2, seq_len=64, vocab_size=64)
    torch.manual_seed(0)
    reference = GPT(cfg)
    tokens, targets = synthetic_batch(cfg, 4)
    wraps = {
        "torch": lambda fn, *a: torch_ckpt.checkpoint(
            fn, *a, use_reentrant=False,
            context_fn=functools.partial(torch_ckpt.create_selective_checkpoint_contexts, keep_matmuls)),
        "remat": lambda fn, *a: remat.checkpoint(fn, *a, policy=save_matmuls),
    }
    peaks = {}
    for name, wrap in wraps.items():
        model = GPT(cfg)
        model.load_state_dict(reference.state_dict())
        remat.apply_activation_checkpointing(
            model, check_fn=lambda m: isinstance(m, Block),
            checkpoint_wrapper_fn=lambda m, wrap=wrap: remat.checkpoint_wrapper(m, checkpoint_fn=wrap))
        torch.manual_seed(1)
        peaks[name] = remat.measure_step(lambda m=model: m.loss(tokens, targets).backward(), model).peak_above_params
    assert peaks["remat"] <= peaks["torch"], peaks


def test_a_policy_subclass_with_its_own_call_is_asked_per_call():
    asked = []

    class Logging(remat.policies.Policy):
        def __call__(self, ctx, op, *args, **kwargs):
            asked.append(op)
            return super().__call__(ctx, op, *args, **kwargs)

    x, w1, w2 = (torch.randn(4, 4, requires_grad=True) for _ in range(3))
    expected = grads(lambda: two_matmuls(x, w1, w2).sum(), [w1, w2])[1]
    policy = Logging(op_rule=save_matmuls.op_rule)
    assert_bitwise(expected, grads(lambda: remat.checkpoint(two_matmuls, x, w1, w2, policy=policy).sum(),
                                   [w1, w2])[1])
    assert asked.count(torch.ops.aten.mm.default) == 2
