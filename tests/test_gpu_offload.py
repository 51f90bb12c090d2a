"""The offload engine on a real CUDA device: bitwise gradients, layouts kept, a pinned pool, no host waits.

The same checks as ``test_offload_engine.py`` runs on a fake device; here every copy goes through pinned host
memory on a side stream.  Skipped where CUDA is not available.
"""

import copy

import pytest
import torch
from helpers import MLPStack, assert_bitwise, grads
from offload_cases import Layouts, check_layouts, entry_points, offload_matmuls, record_layouts

import remat
from remat.models import GPT, Block, GPTConfig, synthetic_batch
from remat.policies.hostcopy import TorchDevice, use_device_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ENTRY_POINTS = entry_points("cuda")


@pytest.fixture
def engine():
    # A fresh engine over the real device: its own side stream and pools, and instrumenting it touches
    # nothing shared.
    with use_device_model("cuda", TorchDevice(torch.cuda)) as fresh:
        yield fresh
    torch.cuda.synchronize()


def _deterministic(loss_fn, params, seed=0):
    """Gradients of ``loss_fn``, and whether two plain runs agree bitwise (only then is bitwise asked)."""
    first, second = grads(loss_fn, params, seed), grads(loss_fn, params, seed)
    return first, all(torch.equal(a, b) for a, b in zip(first[1], second[1]))


def _compare(expected, deterministic, got):
    if deterministic:
        assert torch.equal(expected[0], got[0])
        assert_bitwise(expected[1], got[1])
    else:
        for a, b in zip(expected[1], got[1]):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_is_bitwise_and_keeps_layouts_on_cuda(engine, entry):
    torch.manual_seed(0)
    model = Layouts().cuda()
    x = torch.randn(8, 16, device="cuda", requires_grad=True)
    params = [x, *model.parameters()]
    expected, deterministic = _deterministic(lambda: model(x), params)
    pairs = record_layouts(engine)
    got = grads(lambda: ENTRY_POINTS[entry](model, x), params)
    _compare(expected, deterministic, got)
    check_layouts(pairs, every_kind=entry != "policy")
    assert engine.pool().pinned


def test_cpu_offload_policy_runs_the_demo_gpt_on_cuda(engine):
    # The failure this guards against: attention's output came back contiguous, so the recomputation's
    # reshape copied it ("recomputation ran aten.clone.default ... which the original forward did not run").
    cfg = GPTConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32, vocab_size=128, dropout=0.0)
    torch.manual_seed(0)
    plain = GPT(cfg).cuda()
    wrapped = copy.deepcopy(plain)
    remat.apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, Block), policy=offload_matmuls)
    tokens, targets = (t.cuda() for t in synthetic_batch(cfg, 2))
    expected, deterministic = _deterministic(lambda: plain.loss(tokens, targets), list(plain.parameters()), seed=3)
    got = grads(lambda: wrapped.loss(tokens, targets), list(wrapped.parameters()), seed=3)
    _compare(expected, deterministic, got)


def test_pinned_pool_is_reused_and_empty_after_backward_on_cuda(engine):
    model = MLPStack(depth=2, width=64, hidden=256, p=0.0).cuda()
    off = remat.offload(min_bytes=1 << 14)
    allocations = []
    for _ in range(3):
        with off:
            loss = model(torch.randn(256, 64, device="cuda")).sum()
        loss.backward()
        del loss
        torch.cuda.synchronize()  # the test waits for the device; the engine never does
        allocations.append(off.pool.allocations)
    assert allocations[0] > 0 and allocations == [allocations[0]] * 3
    engine.collect()
    pool = off.pool
    assert pool.pinned and all(block.is_pinned() for blocks in pool.free.values() for block in blocks)
    assert pool.in_use_bytes == 0 and pool.waiting_bytes == 0 and engine.live == 0


@pytest.mark.parametrize("entry", ["offload", "save_on_cpu"])
def test_no_host_synchronization_once_the_pool_is_warm(engine, entry):
    model = MLPStack(depth=2, width=64, hidden=256, p=0.0).cuda()
    x = torch.randn(256, 64, device="cuda", requires_grad=True)
    params = [x, *model.parameters()]
    for warm in (True, False):
        torch.cuda.synchronize()
        if not warm:
            torch.cuda.set_sync_debug_mode("error")  # any host synchronization raises
        try:
            torch.autograd.grad(ENTRY_POINTS[entry](model, x).sum(), params)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("limit_mib", [32, 128])
def test_copies_in_flight_bound_the_memory_on_cuda(engine, limit_mib):
    # 32 saved tensors of 16 MiB: the kernels make them (and in backward use them) far faster than the link
    # moves them, and the host runs ahead of both.  In forward, a freed tensor whose copy out is pending is
    # no longer counted as allocated but its memory cannot be reused before the allocator sees the copy end:
    # without the window the allocator reserves memory for nearly all of them (512 MiB).  In backward,
    # tensors brought back ahead of their use are allocated.
    engine.in_flight_limit = limit_mib << 20
    x = torch.randn(4096, 1024, device="cuda", requires_grad=True)
    for _ in range(2):  # the first step fills the pinned pool
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        with remat.offload(min_bytes=0, device_type="cuda") as off:
            y = x * 1  # x itself is the caller's: it is never copied
            for _ in range(32):
                y = y.sin()  # saves its input
        torch.cuda.synchronize()
        forward_reserved = torch.cuda.max_memory_reserved() - reserved
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y.sum().backward()
        torch.cuda.synchronize()
        backward_peak = torch.cuda.max_memory_allocated() - base
        x.grad = None
        del y
    assert off.stats.offloaded_tensors == 32
    # the window, plus the tensors being made and just saved (and x * 1), and one whose copy completed but is
    # still held in flight until the next save looks at the window
    assert forward_reserved <= (limit_mib + 7 * 16) << 20, forward_reserved / 2**20
    # the window, plus a fetch's prefetch beyond it, the gradient flowing back, its next one and x's
    assert backward_peak <= (limit_mib + 6 * 16) << 20, backward_peak / 2**20


def test_checkpoint_with_offloaded_inputs_is_bitwise_and_never_waits_on_the_host_on_cuda(engine):
    torch.manual_seed(0)
    plain = MLPStack(depth=4, width=512, hidden=1024, p=0.0).cuda()
    model = copy.deepcopy(plain)
    blocks = list(model.blocks)
    assert len(remat.apply_activation_checkpointing(model, check_fn=lambda m: m in blocks, offload_inputs=True)) == 4
    x = torch.randn(1024, 512, device="cuda")  # 2 MiB per block input: above the floor
    params = list(plain.parameters())
    expected, deterministic = _deterministic(lambda: plain(x * 2).square().mean(), params)
    for warm in (True, False):  # the first step fills the pinned pool
        torch.cuda.synchronize()
        if not warm:
            torch.cuda.set_sync_debug_mode("error")  # any host synchronization raises
        try:
            got = grads(lambda: model(x * 2).square().mean(), list(model.parameters()))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    _compare(expected, deterministic, got)
    assert engine.pool().allocations >= 3  # the last block's inputs stay on the device
