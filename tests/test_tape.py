"""Tapes: after its first call a selective region runs without a dispatch mode in forward (remat.policies.tape).

Every test compares gradients bitwise with plain autograd, over several calls so that the calls after the first
follow the tape the first one wrote.
"""

import functools

import pytest
import torch
from helpers import MM, CountOps, MLPStack, assert_bitwise, grads
from torch import nn

import remat
from remat import CheckpointPolicy
from remat.policies import Policy, save_matmuls, tapes
from remat.policies.tape import _books


def _counting(policy_rule):
    """A rules policy whose op rule counts how often remat asks it (it is asked only while recording)."""
    asked = [0]

    def op_rule(op):
        asked[0] += 1
        return policy_rule(op)

    return Policy(op_rule=op_rule, name="counting"), asked


def _keep_matmuls(op):
    return CheckpointPolicy.MUST_SAVE if op in MM else None


def _keep_everything(op):
    return CheckpointPolicy.MUST_SAVE


class Residual(nn.Module):
    """A projection whose output only feeds a residual sum (as a transformer's attention output does):
    autograd never saves it, so the tape reaches it as the Linear's output."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.proj = nn.Linear(32, 16)

    def forward(self, x):
        h = x + self.proj(torch.nn.functional.gelu(self.up(self.norm(x))))
        return h * torch.sigmoid(h)


@pytest.mark.parametrize(("rule", "p", "follows"), [
    (_keep_matmuls, 0.25, True),
    (_keep_everything, 0.0, True),
    (_keep_everything, 0.25, False),  # keeps dropout's in-place draw by value: recorded on every call
])
def test_calls_after_the_first_follow_the_tape_bitwise_and_never_ask_the_policy(rule, p, follows):
    torch.manual_seed(0)
    model = MLPStack(depth=3, p=p)
    x = torch.randn(4, 16, requires_grad=True)
    params = [x, *model.parameters()]
    policy, asked = _counting(rule)
    for step in range(3):
        expected = grads(lambda: model(x).sum(), params, seed=step)
        asked[0] = 0
        got = grads(lambda: model(x, wrap=lambda b, t: remat.checkpoint(b, t, policy=policy)).sum(), params, seed=step)
        assert_bitwise(expected[1], got[1])
        assert (asked[0] > 0) == (step == 0 or not follows)  # a tape answers from the second call on


def test_a_policy_keeping_everything_never_reruns_the_region():
    torch.manual_seed(0)
    block = Residual()
    x = torch.randn(4, 16, requires_grad=True)
    policy, _ = _counting(_keep_everything)
    runs = [0]

    def fn(t):
        runs[0] += 1
        return block(t)

    params = [x, *block.parameters()]
    for step in range(3):
        expected = grads(lambda: block(x).sum(), params)
        runs[0] = 0
        got = grads(lambda: remat.checkpoint(fn, x, policy=policy).sum(), params)
        assert_bitwise(expected[1], got[1])
        assert runs[0] == 1, f"step {step}: the region ran {runs[0]} times"


def test_a_kept_output_no_tensor_saves_is_captured_from_its_module_and_served():
    torch.manual_seed(0)
    block = Residual()
    x = torch.randn(4, 16, requires_grad=True)
    policy, _ = _counting(_keep_matmuls)
    counts = []
    for _ in range(3):
        y = remat.checkpoint(block, x, policy=policy)
        with CountOps(MM) as counter:
            y.sum().backward()
        counts.append(counter.count)
    ((_, tape),) = _books[policy].tapes.values()
    assert tape is not None and tape.modules  # proj's output reached through the module
    assert counts == [4, 4, 4]  # gradient matmuls only: both forward matmuls served every time


def test_tape_recording_and_plain_autograd_hold_the_same_bytes():
    torch.manual_seed(0)
    block = Residual()
    x = torch.randn(64, 16, requires_grad=True)

    def step():
        remat.checkpoint(block, x, policy=save_matmuls).sum().backward()

    def plain():
        block(x).sum().backward()

    plain()  # gradients exist from here on, in every measured step alike
    with tapes(False):
        recorded = remat.measure_step(step, block).peak_above_params
    first = remat.measure_step(step, block).peak_above_params  # learns the tape
    followed = remat.measure_step(step, block).peak_above_params
    assert recorded == first == followed == remat.measure_step(plain, block).peak_above_params


def test_tapes_off_records_every_call():
    torch.manual_seed(0)
    block = Residual()
    x = torch.randn(4, 16, requires_grad=True)
    policy, asked = _counting(_keep_matmuls)
    with tapes(False):
        for _ in range(2):
            asked[0] = 0
            remat.checkpoint(block, x, policy=policy).sum().backward()
            assert asked[0] > 0
    assert policy not in _books


def test_a_region_whose_ops_change_between_calls_gets_plain_gradients():
    torch.manual_seed(0)
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    x = torch.randn(8, 8, requires_grad=True)
    branch = {"which": 0}

    def fn(t):
        h = t @ w1
        if branch["which"] == 0:
            return (h + 1).sin()
        if branch["which"] == 1:
            return (h @ w2).cos()  # one more matmul, the same shapes saved
        return (h.t() + 1).sin().exp()  # another op sequence and more saved tensors

    def gradients(loss):
        return torch.autograd.grad(loss, [x, w1, w2], allow_unused=True)

    policy, _ = _counting(_keep_matmuls)
    for which in (0, 0, 1, 2, 0, 1):
        branch["which"] = which
        expected = gradients(fn(x).sum())
        assert_bitwise(expected, gradients(remat.checkpoint(fn, x, policy=policy).sum()))


def test_a_forward_that_parts_from_its_tape_runs_every_op_again_in_backward():
    # The second branch saves what the first saved, and then more: the follower sees it only after holding the
    # first, and backward then recomputes the region whole, with the ops it ran, not the tape's.
    torch.manual_seed(0)
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    x = torch.randn(8, 8, requires_grad=True)
    branch = {"which": 0}

    def fn(t):
        h = t @ w1  # sin saves it: the tape captures it there
        return h.sin() if branch["which"] == 0 else (h @ w2).cos()

    policy, asked = _counting(_keep_matmuls)
    for which in (0, 0, 1, 0):
        branch["which"] = which
        expected = torch.autograd.grad(fn(x).sum(), [x, w1, w2], allow_unused=True)
        asked[0] = 0
        got = torch.autograd.grad(remat.checkpoint(fn, x, policy=policy).sum(), [x, w1, w2], allow_unused=True)
        assert_bitwise(expected, got)
    ((_, tape),) = _books[policy].tapes.values()
    assert tape is not None and asked[0] == 0  # the last call followed the tape again


@pytest.mark.parametrize("saved", [False, True], ids=["served-by-replay", "held-by-a-followed-tape"])
def test_a_kept_output_modified_after_forward_is_an_error_in_tape_mode_too(saved):
    w = torch.randn(4, 4, requires_grad=True)
    leak = {}

    def fn(t):
        h = t @ w
        leak["h"] = h
        return h.sin() if saved else (h + 1).sin()  # sin saves h itself: the follower holds and captures it

    x = torch.randn(4, 4, requires_grad=True)
    _books.pop(save_matmuls, None)
    remat.checkpoint(fn, x, policy=save_matmuls).sum().backward()  # learns the tape
    # Only where autograd saves the kept matmul can a tape capture it (else every call is recorded).
    assert (next(iter(_books[save_matmuls].tapes.values()))[1] is not None) is saved
    y = remat.checkpoint(fn, x, policy=save_matmuls)
    with torch.no_grad():
        leak["h"].add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        y.sum().backward()

    allowing = functools.partial(remat.create_selective_checkpoint_contexts, save_matmuls, True)
    expected = grads(lambda: fn(x).sum(), [x, w])
    for _ in range(2):
        y = remat.checkpoint(fn, x, context_fn=allowing)
        with torch.no_grad():
            leak["h"].add_(1.0)
        assert_bitwise(expected[1], torch.autograd.grad(y.sum(), [x, w]))  # recomputed, not served


def test_a_held_tensor_changed_after_forward_is_recomputed():
    x = torch.randn(4, 4, requires_grad=True)
    leak = {}

    def fn(t):
        h = t.exp()  # exp saves its output, kept by the policy below: held in its placeholder
        leak["h"] = h
        return h.sum(0)

    keep_exp = Policy(op_rule=lambda op: CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.exp.default else None)
    allowing = functools.partial(remat.create_selective_checkpoint_contexts, keep_exp, True)
    expected = torch.autograd.grad(fn(x).sum(), x)
    for _ in range(3):
        y = remat.checkpoint(fn, x, context_fn=allowing)
        with torch.no_grad():
            leak["h"].mul_(3.0)
        assert_bitwise(expected, torch.autograd.grad(y.sum(), x))


def test_retained_and_partial_backward_follow_the_tape():
    x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)

    def two_heads(t, w):
        return (t @ w + 1).sin(), (t.t() @ w + 1).cos()

    a, b = two_heads(x, w)
    expected = [*torch.autograd.grad(a.sum(), [x, w]), *torch.autograd.grad(b.sum(), [x, w])]
    for _ in range(3):
        a, b = remat.checkpoint(two_heads, x, w, policy=save_matmuls)
        got = list(torch.autograd.grad(a.sum(), [x, w]))
        got += torch.autograd.grad(b.sum(), [x, w])
        assert_bitwise(expected, got)
        a, b = remat.checkpoint(two_heads, x, w, policy=save_matmuls)
        loss = a.sum() + b.sum()
        first = torch.autograd.grad(loss, [x, w], retain_graph=True)
        assert_bitwise(first, torch.autograd.grad(loss, [x, w]))


def test_nested_selective_regions_follow_their_tapes():
    torch.manual_seed(0)
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    x = torch.randn(8, 8, requires_grad=True)

    def inner(t):
        return (t @ w2 + 1).relu()

    def outer(t):
        h = (t @ w1).sin()
        return remat.checkpoint(inner, h, policy=save_matmuls).cos()

    expected = grads(lambda: outer(x).sum(), [x, w1, w2])
    for _ in range(3):
        got = grads(lambda: remat.checkpoint(outer, x, policy=save_matmuls).sum(), [x, w1, w2])
        assert_bitwise(expected[1], got[1])


def test_the_demo_gpt_with_dropout_trains_bitwise_over_steps():
    from remat.models import GPT, Block, GPTConfig, synthetic_batch

    cfg = GPTConfig(n_layers=2, d_model=32, n_heads=2, seq_len=32, vocab_size=64, dropout=0.1)
    torch.manual_seed(0)
    reference = GPT(cfg)
    model = GPT(cfg)
    model.load_state_dict(reference.state_dict())
    remat.apply_activation_checkpointing(
        model, check_fn=lambda m: isinstance(m, Block),
        checkpoint_wrapper_fn=lambda m: remat.checkpoint_wrapper(
            m, checkpoint_fn=lambda fn, *a: remat.checkpoint(fn, *a, policy=save_matmuls)))
    tokens, targets = synthetic_batch(cfg, 4)
    for step in range(3):
        expected = grads(lambda: reference.loss(tokens, targets), list(reference.parameters()), seed=step)
        got = grads(lambda: model.loss(tokens, targets), list(model.parameters()), seed=step)
        assert torch.equal(expected[0], got[0])
        assert_bitwise(expected[1], got[1])


def test_memory_a_dropped_mask_left_is_not_taken_for_a_draw_when_reused():
    # Dropout's mask is dropped (recomputed), so its memory is free once dropout returns, and the kept product
    # is often made there: it is still held and captured, so the region follows its tape.
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(64, 64, requires_grad=True)

    def fn(t):
        h = torch.nn.functional.dropout(t.sin(), 0.5)
        return (h @ w).cos()

    for _ in range(40):  # the allocator reuses the address in about one call in six
        policy, _ = _counting(_keep_matmuls)
        for _ in range(2):
            remat.checkpoint(fn, x, policy=policy).sum().backward()
        (entry,) = _books[policy].tapes.values()
        assert entry[1] is not None


def test_a_kept_op_with_an_empty_output_follows_its_tape():
    # Batch norm in eval mode returns two empty statistics besides its output: nothing can capture them, nor
    # needs to (the follower makes them afresh).
    torch.manual_seed(0)
    norm = torch.nn.BatchNorm1d(16).eval()
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16, requires_grad=True)
    keeps_the_norm = Policy(op_rule=lambda op: CheckpointPolicy.MUST_SAVE
                            if op is torch.ops.aten.native_batch_norm.default else None, name="keep norm")

    def fn(t):
        return norm(t @ w).sin().cos()  # sin saves the norm's output, cos's input is rebuilt by the replay

    for _ in range(3):
        expected = torch.autograd.grad(fn(x).sum(), [x, w])
        assert_bitwise(expected, torch.autograd.grad(remat.checkpoint(fn, x, policy=keeps_the_norm).sum(), [x, w]))
    ((_, tape),) = _books[keeps_the_norm].tapes.values()
    assert tape is not None


def test_a_policy_shared_by_more_blocks_than_a_small_book_holds_follows_every_tape():
    # A plan shares one policy among all its blocks of a kind: an 80-layer model must not evict each tape
    # before its next use.
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8) for _ in range(80)]
    policy, asked = _counting(_keep_matmuls)
    x = torch.randn(4, 8, requires_grad=True)
    for step in range(3):
        asked[0] = 0
        h = x
        for layer in layers:
            h = remat.checkpoint(layer, h.sin(), policy=policy)
        h.sum().backward()
        assert (asked[0] > 0) == (step == 0)


def test_a_plan_applied_again_follows_the_tapes_it_learned():
    # Tapes are filed under a region's policy: a plan removed and applied again (as a benchmark toggling
    # modes does each step) must hand its blocks the same policy objects, or every step records afresh.
    torch.manual_seed(0)
    model = MLPStack(depth=2, p=0.0)
    kept = {"op": "aten.mm.default", "call": 0, "bytes": 0, "decision": "keep"}
    plan = remat.Plan(decisions={"blocks.0": "selective", "blocks.1": "selective"}, predicted_peak=0,
                      predicted_extra_time=0.0, budget=0, baseline_peak=0, param_bytes=0,
                      policies={f"blocks.{i}": {"mode": "selective", "ops": [kept]} for i in range(2)})
    x = torch.randn(4, 16, requires_grad=True)
    params = [x, *model.parameters()]
    expected = grads(lambda: model(x).sum(), params)

    def step():
        plan.apply(model)
        try:
            return [model.blocks[i]._remat_block_policy.rules for i in range(2)], grads(lambda: model(x).sum(), params)
        finally:
            plan.remove(model)

    first, got = step()
    assert_bitwise(expected[1], got[1])
    learned = [{key: entry[1] for key, entry in _books[rules].tapes.items()} for rules in first]
    assert all(tape is not None for book in learned for tape in book.values())
    again, got = step()
    assert_bitwise(expected[1], got[1])
    assert again == first and all(rules is other for rules, other in zip(again, first))
    assert [{key: entry[1] for key, entry in _books[rules].tapes.items()} for rules in again] == learned


def test_a_followed_forward_waits_for_its_copies_out_and_lets_their_device_memory_go(monkeypatch):
    """An output offloaded by policy and reached only as a module's output is copied out by the follower too:
    when forward ends the device waits for the copy and the tensor's device memory is let go, as after a
    recorded forward."""
    from remat.policies import tape
    from remat.policies.hostcopy import HostDevice, use_device_model
    from remat.policies.kept import _Kept

    followers = []
    exit_ = tape._Follower.exit
    monkeypatch.setattr(tape._Follower, "exit", lambda self: (followers.append(self), exit_(self))[1])
    offload_max = Policy(op_rule=lambda op: CheckpointPolicy.MUST_CPU_OFFLOAD if op is torch.ops.aten.max.dim
                         else None, name="offload max")

    class RowMax(nn.Module):
        def forward(self, w):
            return torch.max(w, dim=1)[0]  # its indices reach nothing: the call is not one the replay is served

    row_max = RowMax()

    def region(x, c):
        return x.sin() + row_max(c * 2)

    x, c = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4)
    expected = grads(lambda: region(x, c).sum(), [x])[1]
    with use_device_model("cpu", HostDevice(separate_memory=True)):
        for _ in range(3):
            y = remat.checkpoint(region, x, c, policy=offload_max)
            assert_bitwise(expected, torch.autograd.grad(y.sum(), [x]))
    assert len(followers) == 2
    for follower in followers:
        kept = [value for leaves in follower.captured.values() for value, _ in leaves.values()]
        assert kept and all(isinstance(k, _Kept) and k.value is None and k.stashed is not None for k in kept)
