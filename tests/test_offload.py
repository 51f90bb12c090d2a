"""Offload hooks and wrappers: correct gradients, the right tensors moved, host buffers reused."""

import torch
from helpers import MLPStack, assert_bitwise, grads

import remat
from remat.models import GPT, Block, GPTConfig, synthetic_batch
from remat.policies.hostcopy import HostDevice, use_device_model


def test_offloader_skips_parameters_and_small_tensors_and_counts_bytes():
    torch.manual_seed(0)
    model = MLPStack(depth=2, width=16, hidden=64, p=0.0)
    x = torch.randn(32, 16, requires_grad=True)
    params = [x, *model.parameters()]
    expected = grads(lambda: model(x).sum(), params)[1]
    big = 32 * 64 * 4  # the hidden activations: 8 KiB each
    # device_type="cpu" exercises the offload bookkeeping on a CPU-only machine.
    with remat.offload(min_bytes=big, device_type="cpu", modules=[model]) as off:
        loss = model(x).sum()
    got = torch.autograd.grad(loss, params)
    assert_bitwise(expected, got)
    stats = off.stats
    # per block: up's output (saved by gelu) and gelu's output (saved by down)
    assert stats.offloaded_tensors == 4 and stats.offloaded_bytes == 4 * big
    assert stats.kept_tensors > 0  # parameters and the 2 KiB residual-stream tensors stayed


def test_offloader_reuses_its_host_buffers_across_steps():
    model = MLPStack(depth=2, width=16, hidden=64, p=0.0)
    with use_device_model("cpu", HostDevice()) as engine:  # a fresh CPU engine: its own pool
        off = remat.offload(min_bytes=1024, device_type="cpu")
        allocations = []
        for _ in range(3):
            with off:
                loss = model(torch.randn(32, 16)).sum()
            loss.backward()
            allocations.append(off.pool.allocations)
    engine.collect()
    assert allocations[0] == off.stats.offloaded_tensors // 3 and allocations[0] == allocations[-1]  # reused
    assert off.pool.in_use_bytes == 0 and off.pool.free_bytes == off.pool.allocated_bytes


def test_save_on_cpu_drop_in_gives_equal_gradients():
    model = MLPStack(depth=2, p=0.0)
    x = torch.randn(4, 16, requires_grad=True)
    expected = grads(lambda: model(x).sum(), [x, *model.parameters()])[1]
    with remat.save_on_cpu(pin_memory=True):
        loss = model(x).sum()
    assert_bitwise(expected, torch.autograd.grad(loss, [x, *model.parameters()]))


def test_offload_wrapper_keeps_state_dict_and_gradients():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=2, d_model=32, n_heads=2, seq_len=16, vocab_size=64)
    plain, wrapped = GPT(cfg), GPT(cfg)
    wrapped.load_state_dict(plain.state_dict())
    for i, block in enumerate(wrapped.blocks):
        wrapped.blocks[i] = remat.offload_wrapper(block, min_bytes=0, device_type="cpu")
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    tokens, targets = synthetic_batch(cfg, 2)
    expected = grads(lambda: plain.loss(tokens, targets), list(plain.parameters()), seed=1)
    got = grads(lambda: wrapped.loss(tokens, targets), list(wrapped.parameters()), seed=1)
    assert_bitwise(expected[1], got[1])
    assert wrapped.blocks[0].offloader.stats.offloaded_tensors > 0


def test_wrapped_gpt_whole_step_peak_is_at_most_half():
    cfg = GPTConfig(n_layers=4, d_model=64, n_heads=4, seq_len=128, vocab_size=128)
    torch.manual_seed(0)
    plain = GPT(cfg)
    wrapped = GPT(cfg)
    wrapped.load_state_dict(plain.state_dict())
    remat.apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, Block))
    tokens, targets = synthetic_batch(cfg, 8)
    peaks = {}
    for name, model in (("plain", plain), ("wrapped", wrapped)):
        peaks[name] = remat.measure_step(lambda m=model: m.loss(tokens, targets).backward(), model).peak_above_params
    assert peaks["wrapped"] <= 0.5 * peaks["plain"], peaks


def test_policy_through_apply_activation_checkpointing():
    cfg = GPTConfig(n_layers=2, d_model=32, n_heads=2, seq_len=16, vocab_size=64)
    torch.manual_seed(0)
    plain, wrapped = GPT(cfg), GPT(cfg)
    wrapped.load_state_dict(plain.state_dict())
    remat.apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, Block),
                                         policy=remat.policies.save_matmuls)
    tokens, targets = synthetic_batch(cfg, 2)
    expected = grads(lambda: plain.loss(tokens, targets), list(plain.parameters()), seed=2)
    got = grads(lambda: wrapped.loss(tokens, targets), list(wrapped.parameters()), seed=2)
    assert_bitwise(expected[1], got[1])
