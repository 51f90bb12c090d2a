"""Kept random ops: served with the RNG where forward left it; in-place draws (dropout's mask) kept by value.

Every gradient here is bitwise equal to plain autograd with the same seed, and the global RNG state after the
step equals the plain run's.  Which draws were served rather than rerun is counted in the backward.
"""

import dataclasses
import functools

import pytest
import torch
from helpers import assert_bitwise, held_after_forward
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat import CheckpointPolicy
from remat.models import Block, GPTConfig
from remat.planning.choices.fronts import block_front, evaluate, policy_for
from remat.planning.measure.opgraph import profile_ops
from remat.planning.measure.overheads import Overheads

BERNOULLI = torch.ops.aten.bernoulli_.float
FIXED = Overheads(region=2e-5, per_saved=1e-6, policy_forward=1e-6, policy_replay=5e-7, copy_per_byte=2 / 5e9)


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func] = self.calls.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def keep_calls(op, calls, decision=CheckpointPolicy.MUST_SAVE):
    """A policy keeping the given call indices of ``op`` (counted by remat)."""
    return remat.policies.Policy(call_rule=lambda o, i: decision if o is op and i in calls else None)


def _gpt_block(seq_len=32, d_model=32):
    torch.manual_seed(0)
    cfg = GPTConfig(seq_len=seq_len, d_model=d_model, n_heads=2, n_layers=1, vocab_size=64, dropout=0.1)
    return Block(cfg), (2, seq_len, d_model)


def _step(run, params, shape, mode="backward"):
    """Gradients of one step (RNG seeded), the RNG state after it, and the ops the backward dispatched."""
    torch.manual_seed(1)
    x = torch.randn(shape, requires_grad=True)
    torch.manual_seed(7)  # the dropout masks
    y = run(x)
    loss = (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum()
    with CountOps() as counter:
        if mode == "retain twice":
            got = [*torch.autograd.grad(loss, [x, *params], retain_graph=True),
                   *torch.autograd.grad(loss, [x, *params])]
        else:
            got = list(torch.autograd.grad(loss, [x, *params]))
    return got, torch.get_rng_state(), counter.calls


@pytest.mark.parametrize("mode", ["backward", "retain twice"])
@pytest.mark.parametrize("kept", [(0, 1, 2), (1,), (0,), (2,), ()], ids=["all", "middle", "first", "last", "none"])
def test_kept_dropout_masks_are_served_and_later_masks_draw_as_in_forward(kept, mode):
    block, shape = _gpt_block()
    params = list(block.parameters())
    expected, rng, _ = _step(block, params, shape, mode)
    got, got_rng, calls = _step(lambda x: remat.checkpoint(block, x, policy=keep_calls(BERNOULLI, set(kept))),
                                params, shape, mode)
    assert_bitwise(got, expected)
    assert torch.equal(got_rng, rng)
    # Served draws copy their value back instead of drawing; the others draw again (every recomputation).
    recomputations = 2 if mode == "retain twice" else 1
    assert calls.get(BERNOULLI, 0) == (3 - len(kept)) * recomputations


def test_a_block_policy_keeping_the_middle_draw_counts_its_calls_right():
    block, shape = _gpt_block()
    params = list(block.parameters())
    graph = profile_ops(nn.Sequential(block), torch.randn(shape, requires_grad=True), modules=["0"],
                        timing="estimate", overheads=FIXED).blocks["0"]
    draws = [n.index for n in graph.nodes if n.random]
    policy = policy_for(graph, evaluate(graph, "selective", [draws[1]]))
    assert policy.kept == [("aten.bernoulli_.float", 1)]
    expected, rng, _ = _step(block, params, shape)
    got, got_rng, calls = _step(policy.wrap(block), params, shape)
    assert_bitwise(got, expected)
    assert torch.equal(got_rng, rng)
    assert calls[BERNOULLI] == 2


def _draws(x, w):
    h = x @ w
    noise = torch.rand_like(h)  # out-of-place draws, followed by a draw that reruns
    coin = torch.bernoulli(torch.sigmoid(h.detach()))
    h = torch.nn.functional.dropout(h * noise + coin, 0.3)
    return (h @ w).tanh()


OUT_OF_PLACE = [torch.ops.aten.rand_like.default, torch.ops.aten.bernoulli.default]


@pytest.mark.parametrize("op", OUT_OF_PLACE, ids=lambda op: str(op))
def test_kept_out_of_place_draws_are_served_not_rerun(op):
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    expected, rng, _ = _step(lambda x: _draws(x, w), [w], (8, 16))
    got, got_rng, calls = _step(lambda x: remat.checkpoint(_draws, x, w, policy=keep_calls(op, {0})), [w], (8, 16))
    assert_bitwise(got, expected)
    assert torch.equal(got_rng, rng)
    assert op not in calls and calls[BERNOULLI] == 1  # the dropout after it drew its mask from forward's RNG


def _nested(x, w, inner_policy):
    a = torch.nn.functional.dropout(x @ w, 0.2)
    b = _draws(a.tanh(), w) if inner_policy is None else remat.checkpoint(_draws, a.tanh(), w, policy=inner_policy)
    return torch.nn.functional.dropout(b * a, 0.2).sin()


@pytest.mark.parametrize("outer", [(0,), (1,), (0, 1, 2)], ids=str)
@pytest.mark.parametrize("inner", [(0,), ()], ids=str)
def test_nested_regions_keeping_draws(outer, inner):
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    expected, rng, _ = _step(lambda x: _nested(x, w, None), [w], (8, 16))
    inner_policy = keep_calls(BERNOULLI, set(inner))
    got, got_rng, _ = _step(
        lambda x: remat.checkpoint(_nested, x, w, inner_policy, policy=keep_calls(BERNOULLI, set(outer))), [w],
        (8, 16))
    assert_bitwise(got, expected)
    assert torch.equal(got_rng, rng)


def test_a_draw_from_its_own_generator_is_served_and_the_generator_left_as_the_caller_left_it():
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    generator = torch.Generator().manual_seed(11)

    def fn(x):
        h = x @ w
        mask = torch.empty_like(h).bernoulli_(0.6, generator=generator)
        return (h * mask).sin() @ w

    def run(wrap):
        generator.manual_seed(11)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2), requires_grad=True)
        y = wrap(x)
        torch.rand(3, generator=generator)  # the caller draws on between forward and backward
        got = torch.autograd.grad(y.pow(2).sum(), [x, w])
        return got, generator.get_state()

    expected, state = run(fn)
    got, got_state = run(lambda x: remat.checkpoint(fn, x, policy=keep_calls(BERNOULLI, {0})))
    assert_bitwise(got, expected)
    assert torch.equal(got_state, state)  # the recomputation set it to serve the draw, then put it back


def test_without_preserved_rng_the_callers_rng_is_still_left_alone():
    block, shape = _gpt_block()
    params = list(block.parameters())

    def run(wrap):
        torch.manual_seed(1)
        x = torch.randn(shape, requires_grad=True)
        y = wrap(x)
        torch.rand(3)  # the caller draws on between forward and backward
        state = torch.get_rng_state()
        (y.sum() * 0).backward(inputs=params)
        return state, torch.get_rng_state()

    # preserve_rng_state=False: recomputation draws fresh masks and nothing restores the RNG around it, so the
    # caller's RNG is advanced by every draw rerun; a served draw must not rewind it to forward's state.
    policy = keep_calls(BERNOULLI, {0, 1, 2})
    before, after = run(lambda x: remat.checkpoint(block, x, policy=policy, preserve_rng_state=False))
    assert torch.equal(before, after)


def test_offloading_an_in_place_draw_keeps_its_copy_and_a_rerun_draw_is_not_kept():
    block, shape = _gpt_block()
    params = list(block.parameters())
    expected, rng, _ = _step(block, params, shape)
    stats = remat.OffloadStats()
    policy = keep_calls(BERNOULLI, {0}, CheckpointPolicy.MUST_CPU_OFFLOAD)
    context = functools.partial(remat.create_selective_checkpoint_contexts, policy, stats=stats)
    got, got_rng, calls = _step(lambda x: remat.checkpoint(block, x, context_fn=context), params, shape)
    assert_bitwise(got, expected)
    assert torch.equal(got_rng, rng) and calls[BERNOULLI] == 2
    scores = 2 * 2 * 32 * 32 * 4  # batch x heads x seq x seq floats: the attention dropout's mask
    assert (stats.offloaded_tensors, stats.offloaded_bytes) == (1, scores)


def test_demo_block_with_its_masks_kept_holds_exactly_the_predicted_bytes_and_the_front_keeps_draws():
    block, shape = _gpt_block(seq_len=256, d_model=128)  # the demo GPT's block (batch 2 here, not 8)
    graph = profile_ops(nn.Sequential(block), torch.randn(shape, requires_grad=True), modules=["0"],
                        timing="estimate", overheads=FIXED).blocks["0"]
    draws = [n.index for n in graph.nodes if n.random]
    point = evaluate(graph, "selective", draws)
    masks = [2 * 2 * 256 * 256 * 4, 2 * 256 * 128 * 4, 2 * 256 * 128 * 4]  # attention, projection, MLP
    assert point.kept_bytes - point.input_bytes == sum(masks)
    assert held_after_forward(policy_for(graph, point).wrap(block), block, shape) == sum(masks)
    # The front keeps a draw exactly when it costs more than its two copies: on an accelerator-like roofline
    # drawing is as cheap as copying and no point keeps one; at CPU-like drawing costs points do.
    front = block_front(graph)
    assert not any(set(p.kept) & set(draws) for p in front)
    # About 2 ns a byte, as measured for bernoulli_ on the demo's CPU (18 ms for the 8 MiB attention mask).
    graph.nodes = [dataclasses.replace(n, kernel_time=n.out_bytes * 2e-9) if n.random else n for n in graph.nodes]
    front = block_front(graph)
    with_draws = [p for p in front if set(p.kept) & set(draws)]
    assert with_draws and policy_for(graph, with_draws[0]).kept
    assert any(op == "aten.bernoulli_.float" for op, _ in policy_for(graph, with_draws[-1]).kept)
