"""The machinery's own price: host time per region, saved tensor and operator under a policy; per byte copied.

The machinery is Python on the host: its costs are measured once per process on chains of tiny CPU ops,
where the dispatch cost shows (the CPU's clock is the host's).  Copies run on the model's device and are
timed there (:class:`~remat.planning.measure.timing.Clock`).  The price model
(:mod:`remat.planning.measure.prices`) adds the host costs where the device waits for them.

The timings file keeps them per machine (:mod:`remat.planning.measure.timecache`), and like the cached op
timings they are checked before they are used: :func:`cached_overheads` measures a few quick rounds and
measures them again, with one :class:`~remat.planning.measure.timecache.StaleTimings` line, where the cached
figures are not this machine's now.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...api.checkpoint import checkpoint
from ..basics.blockpolicy import BlockPolicy, OpDecision
from ..basics.units import format_bytes
from ..basics.userline import user_stacklevel
from .timecache import StaleTimings, TimingCache, agrees, stale_slack
from .timing import Clock, spread

__all__ = ["Overheads", "cached_overheads", "measure_overheads"]

_CHECK_ROUNDS = 5  # the quick rounds that check cached figures: milliseconds


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
    return _measured_now(rounds, ops, copy_bytes, device)


def cached_overheads(cache: TimingCache, device: str, ops: int = 64, copy_bytes: int = 4 << 20) -> Overheads:
    """The overheads ``cache`` keeps for ``device``, checked against the fastest of a few quick rounds; measured
    (:func:`measure_overheads`) and kept where none are kept or where the kept ones are not this machine's now
    (one :class:`~remat.planning.measure.timecache.StaleTimings` line).

    Each figure the rounds measure (a region saving ``ops`` tensors, ``ops`` ops under a policy, a copy of
    ``copy_bytes`` on the device and to host memory) may be apart from the kept one by
    :func:`~remat.planning.measure.timecache.stale_slack`.

    Example:
        >>> with timings_cache() as cache:
        ...     overheads = cached_overheads(cache, "cpu")
    """
    kept = cache.get("overheads", "", device)
    if kept:
        try:
            cached = Overheads(**kept)
        except TypeError:  # written by another version: measured over
            cached = None
        if cached is not None:
            reason = _moved(cached, device, ops, copy_bytes)
            if not reason:
                return cached
            warnings.warn(StaleTimings(f"remat.profile: the cached overheads of the checkpoint machinery are not "
                                       f"this machine's now ({reason}); measuring them again."),
                          stacklevel=user_stacklevel())
    # measured again where stale: this process's own measurement may be the busy one
    measured = measure_overheads(device=device) if not kept else _measured_now(15, ops, copy_bytes, device)
    cache.put("overheads", "", device, dataclasses.asdict(measured))
    return measured


def _measured_now(rounds: int, ops: int, copy_bytes: int, device: str) -> Overheads:
    measured, _ = _measure(rounds, ops, copy_bytes, device)
    block = torch.ones(copy_bytes // 4, device=device)
    return dataclasses.replace(measured, link_bytes_per_s=_link_bandwidth(block, Clock(device), rounds))


def _moved(cached: Overheads, device: str, ops: int, copy_bytes: int) -> str:
    """How the cached figures differ from the same figures measured now, in a phrase ('' where they agree)."""
    slack = stale_slack(0.0)
    if slack == float("inf"):  # never stale: nothing to measure
        return ""
    # The fastest of each step's rounds: load only slows a round, so a busy moment now leaves quiet figures be,
    # while figures from a busy round (or another machine) stand apart.
    now, rounds_spread = _measure(_CHECK_ROUNDS, ops, copy_bytes, device, min)
    if cached.link_bytes_per_s > 0:  # an accelerator's link to host memory
        block = torch.ones(copy_bytes // 4, device=device)
        now = dataclasses.replace(now, link_bytes_per_s=_link_bandwidth(block, Clock(device), _CHECK_ROUNDS))
    slack = stale_slack(rounds_spread)
    floor = 1e-6  # figures below a microsecond are noise either way
    for (what, kept), (_, fresh) in zip(_figures(cached, ops, copy_bytes), _figures(now, ops, copy_bytes)):
        if not agrees(max(kept, floor), max(fresh, floor), slack):
            return f"{what} costs {kept * 1e3:.3f} ms by them, {fresh * 1e3:.3f} ms now"
    return ""


def _figures(o: Overheads, ops: int, copy_bytes: int) -> list[tuple[str, float]]:
    """The seconds the overheads give for whole pieces of work, each as measurable as the rounds' steps."""
    return [(f"a region saving {ops} tensors", o.region + ops * o.per_saved),
            (f"{ops} ops under a policy (forward and replay)", ops * (o.policy_forward + o.policy_replay)),
            (f"a copy of {format_bytes(copy_bytes)}", o.copy_per_byte * copy_bytes),
            (f"a copy of {format_bytes(copy_bytes)} to host memory",
             copy_bytes / o.link_bytes_per_s if o.link_bytes_per_s > 0 else 0.0)]


def _measure(rounds: int, ops: int, copy_bytes: int, device: str,
             statistic: Callable[[list[float]], float] = statistics.median) -> tuple[Overheads, float]:
    """:class:`Overheads` (no link) from ``statistic`` (the median) of each step's ``rounds`` interleaved
    rounds, and the largest spread of their steps."""
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
    t = {label: statistic(values) for label, values in samples.items()}
    largest_spread = max(spread(values) for values in samples.values())
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
    ), largest_spread


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
