"""The machinery's own price: host time per region, saved tensor and operator under a policy; per byte copied.

The machinery is Python on the host: its costs are measured once per process on chains of tiny CPU ops,
where the dispatch cost shows (the CPU's clock is the host's).  Copies run on the model's device and are
timed there (:class:`~remat.planning.measure.timing.Clock`).  The price model
(:mod:`remat.planning.measure.prices`) adds the host costs where the device waits for them.
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass

import torch

from ...api.checkpoint import checkpoint
from ..basics.blockpolicy import BlockPolicy, OpDecision
from .timing import Clock

__all__ = ["Overheads", "measure_overheads"]


@dataclass(frozen=True)
class Overheads:
    """Seconds the checkpoint machinery adds on this host, whatever the ops cost.

    ``region``: per checkpointed call (frame, input saver, RNG capture and
    replay); ``per_saved``: per tensor autograd saves inside a region
    (placeholder, refill, unpack); ``policy_forward`` / ``policy_replay``: per
    op dispatched under a selective policy in forward / in recomputation;
    ``copy_per_byte``: per byte of one copy on the model's device (a kept
    random in-place op is copied in forward and copied back in recomputation);
    ``link_bytes_per_s``: bytes per second between the device and pinned host
    memory, the slower way (0 where the device's memory is the host's: nothing
    to gain by offloading).
    """

    region: float
    per_saved: float
    policy_forward: float
    policy_replay: float
    copy_per_byte: float
    link_bytes_per_s: float = 0.0


def _chain(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = x.sin()  # saves its input: one saved tensor per op
    return x


@functools.cache
def measure_overheads(rounds: int = 15, ops: int = 64, copy_bytes: int = 4 << 20, device: str = "cpu") -> Overheads:
    """Measure :class:`Overheads` on chains of tiny ops (medians of interleaved rounds; cached per device).

    The per-op policy figures are a floor: between ops that stream megabytes
    through the caches the same Python work costs more (2-4x for the demo GPT
    block here), so :func:`~remat.planning.measure.opgraph.profile_ops` measures them again on
    each block it times.  ``copy_per_byte`` is the device time of cloning a
    ``copy_bytes`` tensor on ``device`` (the model's: ``"cpu"``, ``"cuda"``), per byte.

    Example:
        >>> measure_overheads().policy_forward  # seconds per op, some microseconds
    """
    x = torch.linspace(0.1, 1.0, 4, requires_grad=True)
    sin = torch.ops.aten.sin.default
    # A policy whose table holds the op (so every call is counted) but keeps no call of it.
    probe = BlockPolicy("selective", [OpDecision(str(sin), ops + 1, 0, "keep")])

    clock = Clock("cpu")  # the host's machinery on CPU tensors: host time is device time

    def under_policy() -> tuple[float, float]:
        forward, recompute = probe.context_fn()
        start = clock.mark()
        with forward:
            _chain(x, ops)
        middle = clock.mark()
        with recompute:
            _chain(x, ops)
        end = clock.mark()
        times = clock.read()
        return times[middle] - times[start], times[end] - times[middle]

    steps = {
        "forward": lambda: _chain(x, ops),
        "short": lambda: _chain(x, 1).sum().backward(),
        "short_ckpt": lambda: checkpoint(_chain, x, 1).sum().backward(),
        "long": lambda: _chain(x, ops).sum().backward(),
        "long_ckpt": lambda: checkpoint(_chain, x, ops).sum().backward(),
    }
    block = torch.ones(copy_bytes // 4, device=device)
    copy_clock = Clock(device)
    samples: dict[str, list[float]] = {label: [] for label in (*steps, "copy", "recorder", "replayer")}
    with torch.random.fork_rng(devices=[]):
        for _ in range(rounds):
            for label, step in steps.items():
                samples[label].append(clock.time(step)[1])
            samples["copy"].append(copy_clock.time(block.clone)[1])
            recorded, replayed = under_policy()
            samples["recorder"].append(recorded)
            samples["replayer"].append(replayed)
    x.grad = None
    t = {label: statistics.median(values) for label, values in samples.items()}
    # A checkpointed chain of n ops recomputes n - 1 of them: the last op's saved input is its last pack.
    extra_short = t["short_ckpt"] - t["short"]
    extra_long = t["long_ckpt"] - t["long"] - t["forward"] * (ops - 1) / ops
    per_saved = max((extra_long - extra_short) / (ops - 1), 0.0)
    return Overheads(
        region=max(extra_short - per_saved, 0.0),
        per_saved=per_saved,
        policy_forward=max((t["recorder"] - t["forward"]) / ops, 0.0),
        policy_replay=max((t["replayer"] - t["forward"]) / ops, 0.0),
        copy_per_byte=t["copy"] / copy_bytes,
        link_bytes_per_s=_link_bandwidth(block, copy_clock, rounds),
    )


def _link_bandwidth(block: torch.Tensor, clock: Clock, rounds: int) -> float:
    """Bytes per second of copies between ``block``'s device and pinned host memory, the slower way; 0 on the
    CPU (and on an accelerator whose memory cannot be pinned for it)."""
    if block.device.type in ("cpu", "meta"):
        return 0.0
    try:
        host = torch.empty_like(block, device="cpu", pin_memory=True)
    except RuntimeError:
        return 0.0
    seconds = []
    for dst, src in ((host, block), (block, host)):
        dst.copy_(src, non_blocking=True)  # warm-up
        seconds.append(statistics.median(clock.time(lambda d=dst, s=src: d.copy_(s, non_blocking=True))[1]
                                         for _ in range(rounds)))
    return block.numel() * block.element_size() / max(seconds)
