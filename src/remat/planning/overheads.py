"""The machinery's own price: host time per region, saved tensor and operator under a policy; per byte copied.

The machinery is Python on the host: its costs are measured once per process on chains of tiny CPU ops,
where the dispatch cost shows (the CPU's clock is the host's).  Copies run on the model's device and are
timed there (:class:`~remat.planning.timing.Clock`).  The price model
(:mod:`remat.planning.prices`) adds the host costs where the device waits for them.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..api.checkpoint import checkpoint
from ..policies.tape import tapes
from .blockpolicy import BlockPolicy, OpDecision
from .timing import Clock


@dataclass(frozen=True)
class Overheads:
    """Seconds the checkpoint machinery adds on this host, whatever the ops cost.

    ``region``: per checkpointed call (frame, input saver, RNG capture and
    replay); ``per_saved``: per tensor autograd saves inside a region
    (placeholder, refill, unpack); ``policy_forward`` / ``policy_replay``: per
    op dispatched under a selective policy in forward / in recomputation;
    ``program_op``: host seconds per op a region following its tape reruns from
    its program (:mod:`remat.policies.program`: no dispatch mode, below autograd),
    the op's dispatch (and launch, on an accelerator) included; 0 where no
    program runs; ``copy_per_byte``: per byte of one copy on the model's device (a kept
    random in-place op is copied in forward and copied back in recomputation);
    ``link_bytes_per_s``: bytes per second between the device and pinned host
    memory, the slower way (0 where the device's memory is the host's: nothing
    to gain by offloading).

    A region following its tape (:mod:`remat.policies.tape`) runs forward with
    no dispatch mode, but with host work a plain checkpoint's forward does not
    do: ``follow_region`` per call (its tape looked up, the policy's contexts),
    ``follow_saved`` per saved tensor (the follower asked, a held tensor
    detached) and ``follow_module`` per module call it watches (a global module
    hook, which also sends every module call down ``nn.Module``'s slow path;
    :attr:`~remat.planning.opgraph.BlockGraph.watched_calls`).
    """

    region: float
    per_saved: float
    policy_forward: float
    policy_replay: float
    copy_per_byte: float
    link_bytes_per_s: float = 0.0
    program_op: float = 0.0
    follow_region: float = 0.0
    follow_saved: float = 0.0
    follow_module: float = 0.0

    def follow(self, saved: int, watched: int) -> float:
        """Host seconds following its tape adds to the forward of a region with ``saved`` saved tensors and
        ``watched`` watched module calls, over a plain checkpoint's forward."""
        return self.follow_region + self.follow_saved * saved + self.follow_module * watched


def _follow_figures(one: float, many: float, watched: float, ops: int, modules: int) -> tuple[float, float, float]:
    """``(follow_region, follow_saved, follow_module)`` from what following a tape added to the forwards of
    chains of 1 and ``ops`` tiny ops (a saved tensor each) and of ``modules`` tiny modules (two saved tensors
    each, watched in ``modules + 1`` calls); a difference that noise made negative counts as 0."""
    saved = max((many - one) / (ops - 1), 0.0)
    region = max(one - saved, 0.0)
    module = max((watched - region - 2 * modules * saved) / (modules + 1), 0.0)
    return region, saved, module


def _chain(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = x.sin()  # saves its input: one saved tensor per op
    return x


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight  # saves both: two saved tensors, one a parameter (held when followed)


class _Scales(nn.Module):
    """A chain of modules that read their parameters: a region following its tape watches their calls (and its
    own)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Scale() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@functools.cache
def measure_overheads(rounds: int = 15, ops: int = 64, copy_bytes: int = 4 << 20, device: str = "cpu",
                      modules: int = 16) -> Overheads:
    """Measure :class:`Overheads` on chains of tiny ops (medians of interleaved rounds; cached per device).

    The per-op policy figures are a floor: between ops that stream megabytes
    through the caches the same Python work costs more (2-4x for the demo GPT
    block here), so :func:`~remat.planning.opgraph.profile_ops` measures them again on
    each block it times.  ``copy_per_byte`` is the device time of cloning a
    ``copy_bytes`` tensor on ``device`` (the model's: ``"cpu"``, ``"cuda"``), per byte.  The ``follow_*``
    figures come from forwards of chains of 1 and ``ops`` tiny ops and of ``modules`` tiny modules, each
    following its tape less checkpointed plainly: a floor too (a Llama layer of hidden size 64 pays 0.30 ms
    where they price 0.19 ms).

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

    refills: list[tuple[Any, Any, bool]] = []
    on_device = torch.linspace(0.1, 1.0, 4, device=device, requires_grad=True)

    def timed_refill() -> float:
        """One checkpointed step of the chain on the model's device under the probe: recorded once, then
        following its tape, its backward refilled from its program (the refill alone is timed, on the host's
        clock: it is host work).  NaN where no program ran."""
        forward, recompute = probe.context_fn()
        refill = recompute.refill

        def timed(*args: Any) -> Any:
            start = clock.mark()
            out = refill(*args)
            refills.append((start, clock.mark(), out is not None))
            return out

        recompute.refill = timed
        with tapes(True):  # whatever the caller chose for its own regions
            y = checkpoint(_chain, on_device, ops, context_fn=lambda: (forward, recompute))
        y.sum().backward()
        times = clock.read()
        start, end, ran = refills.pop()
        return times[end] - times[start] if ran else float("nan")

    timed_refill()  # records the tape
    scales = _Scales(modules)

    def forwards(fn: Callable, *args: Any) -> tuple[Callable[[], Any], Callable[[], Any]]:
        """A forward checkpointed plainly, and one following its tape (keeping nothing)."""
        return lambda: checkpoint(fn, *args), lambda: checkpoint(fn, *args, context_fn=probe.context_fn)

    follows = {"one": forwards(_chain, x, 1), "many": forwards(_chain, x, ops), "modules": forwards(scales, x)}
    with tapes(True):
        for _, followed in follows.values():
            followed()  # records its tape
    steps: dict[str, Callable[[], Any]] = {
        "forward": lambda: _chain(x, ops),
        "short": lambda: _chain(x, 1).sum().backward(),
        "short_ckpt": lambda: checkpoint(_chain, x, 1).sum().backward(),
        "long": lambda: _chain(x, ops).sum().backward(),
        "long_ckpt": lambda: checkpoint(_chain, x, ops).sum().backward(),
    }
    block = torch.ones(copy_bytes // 4, device=device)
    copy_clock = Clock(device)
    samples: dict[str, list[float]] = {label: [] for label in (*steps, *follows, "copy", "recorder", "replayer",
                                                                "program")}
    with torch.random.fork_rng(devices=[]):
        for _ in range(rounds):
            for label, step in steps.items():
                samples[label].append(clock.time(step)[1])
            samples["copy"].append(copy_clock.time(block.clone)[1])
            recorded, replayed = under_policy()
            samples["recorder"].append(recorded)
            samples["replayer"].append(replayed)
            samples["program"].append(timed_refill())
            with tapes(True):
                for label, (plain, followed) in follows.items():
                    plain()  # the first forward after other work runs slower: not the one timed
                    samples[label].append(clock.time(followed)[1] - clock.time(plain)[1])
    x.grad = None
    t = {label: statistics.median(values) for label, values in samples.items()}
    # A checkpointed chain of n ops recomputes n - 1 of them: the last op's saved input is its last pack.
    extra_short = t["short_ckpt"] - t["short"]
    extra_long = t["long_ckpt"] - t["long"] - t["forward"] * (ops - 1) / ops
    per_saved = max((extra_long - extra_short) / (ops - 1), 0.0)
    follow_region, follow_saved, follow_module = _follow_figures(t["one"], t["many"], t["modules"], ops, modules)
    return Overheads(
        region=max(extra_short - per_saved, 0.0),
        per_saved=per_saved,
        policy_forward=max((t["recorder"] - t["forward"]) / ops, 0.0),
        policy_replay=max((t["replayer"] - t["forward"]) / ops, 0.0),
        copy_per_byte=t["copy"] / copy_bytes,
        link_bytes_per_s=_link_bandwidth(block, copy_clock, rounds),
        # The chain's last op saves nothing the refill needs; 0 where the device gets no program (meta).
        program_op=0.0 if math.isnan(t["program"]) else t["program"] / (ops - 1),
        follow_region=follow_region, follow_saved=follow_saved, follow_module=follow_module,
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
