"""Measuring a step's memory: MemTracker for eager code, the profiler's events for compiled code."""

import torch

import remat


def test_profiled_peak_gives_memtrackers_bytes_on_eager_code():
    from remat.models import GPT, GPTConfig, synthetic_batch
    from remat.planning.basics.memory import profiled_peak

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


class _SharedContext(torch.nn.Module):
    """Every block takes the embedding as a second argument, as encoder-decoder and context blocks do; each block
    checkpointed, so backward's peak is in the first block's rerun, after the later blocks' gradients."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(64, 64)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(4))

    def forward(self, x):
        ctx = self.embed(x)
        h = ctx
        for block in self.blocks:
            h = remat.checkpoint(block, h, ctx, preserve_rng_state=False)  # RNG states: profiler only
        return h


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    def forward(self, h, ctx):
        return h + self.down(torch.tanh(self.up(h * ctx)))


def test_a_shared_block_argument_does_not_hold_gradients_in_the_measurement():
    """MemTracker's module hooks keep each block's input gradient until the shared argument's is complete (the
    end of backward); the step without them frees it as soon as the block before has used it. measure_step
    counts the step's own peak: the allocator's events agree to the byte."""
    from remat.planning.basics.memory import profiled_peak

    torch.manual_seed(0)
    model, x = _SharedContext(), torch.randn(128, 64)

    def step():
        model.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()

    measured = remat.measure_step(step, model).peak_above_params
    model.zero_grad(set_to_none=True)
    assert measured == profiled_peak(step)


def test_a_tensor_made_before_the_step_and_written_in_it_counts_from_the_start():
    """DDP's gradient buckets are made when DDP wraps the model; a step writes them only late in backward."""
    from remat.planning.basics.memory import measure_step

    before = torch.zeros(1000)  # 4000 bytes, made before the step and not tracked

    def step():
        transient = torch.ones(2000)  # 8000 bytes while the other 4000 are already held
        del transient
        before.add_(1)

    mem = measure_step(step)
    assert mem.peak_total == 12000
    assert mem.by_kind["EARLIER"] == 4000
