"""Measuring a step's memory: MemTracker for eager code, the profiler's events for compiled code."""

import torch

import remat


def test_profiled_peak_gives_memtrackers_bytes_on_eager_code():
    from remat.models import GPT, GPTConfig, synthetic_batch
    from remat.planning.memory import profiled_peak

    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=2, d_model=32, n_heads=2, seq_len=32, vocab_size=64, dropout=0.0)
    model = GPT(cfg)
    tokens, targets = synthetic_batch(cfg, 4)

    def step():
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()

    expected = remat.measure_step(step, model).peak_above_params
    model.zero_grad(set_to_none=True)
    assert profiled_peak(step) == expected
