"""A step's copies to host memory on a timeline: the compute stream and the link's two directions.

A copy costs the step only the time the compute stream waits for it.  The copy engine
(:mod:`remat.policies.hostcopy`) copies a tensor out on its own stream as soon as forward saves it, and in
backward starts the copy back of the next tensors backward needs when it fetches one: a block's offloaded
tensors start back when the backward reaches the block that offloaded just after it, and its own backward waits
for them only if they are still on their way.  The last tensors forward offloads are still held on the device
when backward starts (the engine lets go of a tensor at a later save that finds its copy complete), so they
make no round trip.  :func:`copy_waits` walks the step in that order: forward's blocks (each starts its copies
out when it starts), the stretch after the last block (head and loss), then the backward's blocks in reverse,
each a recomputation (its price) and its backward (twice its forward: the two matmuls per forward one).

The link's bandwidth, each way, is measured once per process on an accelerator and kept in the timings file
(:mod:`remat.planning.measure.timecache`), like the ops' times; where there is nothing to measure (the CPU, the meta
device) :data:`MODELLED_LINK` stands in: the pinned copies measured on an NVIDIA H200 (PCIe 5).

Example:
    >>> copy_waits([2e-3] * 4, [2e-3] * 4, [32 << 20] * 3 + [0], MODELLED_LINK)
    [0.0, 0.0, 0.0, 0.0]
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from .timecache import timings_cache
from .timing import Clock

__all__ = ["MODELLED_LINK", "Link", "copy_waits", "link_for", "measure_link", "prefetch_wait"]


@dataclass(frozen=True)
class Link:
    """Bytes per second between the device and pinned host memory, each way.

    Example:
        >>> Link(50e9, 50e9).seconds(1 << 30, to_host=True)
        0.021474836...
    """

    d2h: float
    h2d: float

    def seconds(self, nbytes: int, to_host: bool) -> float:
        """Seconds one copy of ``nbytes`` takes on the link."""
        return nbytes / (self.d2h if to_host else self.h2d)


MODELLED_LINK = Link(54.86e9, 55.18e9)
"""The link where none can be measured: pinned 64 MiB copies on an NVIDIA H200, PCIe 5 x16 (torch 2.11,
``benchmarks/gpu.py``, shared/gpu/h200-39275ba.json)."""

_PROBE_BYTES = 64 << 20  # long enough that a copy's launch is noise next to its transfer


def prefetch_wait(nbytes: int, window: float, link: Link) -> float:
    """Seconds the compute stream waits for a copy back of ``nbytes`` started ``window`` seconds of compute
    before the tensor is needed.

    Example:
        >>> prefetch_wait(32 << 20, 5e-3, MODELLED_LINK)  # 0.6 ms of copy behind 5 ms of backward
        0.0
    """
    return max(0.0, link.seconds(nbytes, to_host=False) - window)


def copy_waits(forward: Sequence[float], recompute: Sequence[float], moved: Sequence[int], link: Link,
               head: float = 0.0) -> list[float]:
    """Seconds the compute stream waits in each block's backward for its offloaded bytes to come back.

    ``forward``: each block's forward seconds on the device; ``recompute``: what its recomputation adds in
    backward (0 for a block that keeps its activations); ``moved``: bytes it offloads (0: none); ``head``:
    seconds between the last block's forward and its backward.  Copies out run behind forward, one after
    another; a block's copies back start when backward reaches the offloading block after it (and its copies
    out are done), one after another; the last offloading block's tensors stay on the device.

    Example:
        >>> copy_waits([2e-3] * 3, [2e-3] * 3, [1 << 30, 1 << 30, 0], MODELLED_LINK)  # 20 ms each way
        [0.0210..., 0.0, 0.0]
    """
    n = len(forward)
    now = out_free = 0.0
    out_done = [0.0] * n
    for i in range(n):
        if moved[i]:
            out_free = out_done[i] = max(out_free, now) + link.seconds(moved[i], to_host=True)
        now += forward[i]
    now += head
    offloading = [i for i in range(n) if moved[i]]
    ready, waits, back_free = [0.0] * n, [0.0] * n, 0.0
    for i in reversed(range(n)):
        if moved[i]:
            k = offloading.index(i)
            if k + 1 < len(offloading):  # not the last to offload, whose tensors stay on the device
                waits[i] = max(0.0, ready[i] - now)
                now += waits[i]
            if k:  # its fetch starts the copies back of the block that offloaded before it
                j = offloading[k - 1]
                back_free = ready[j] = max(back_free, now, out_done[j]) + link.seconds(moved[j], to_host=False)
        now += recompute[i] + 2 * forward[i]
    return waits


def link_for(device: str) -> Link:
    """The link of ``device`` (``"cuda:0"``): measured once per process and kept in the timings file; the
    modelled one where nothing needs moving or nothing can be measured.

    Example:
        >>> link_for("cpu") == MODELLED_LINK
        True
    """
    kind = torch.device(device).type
    available = getattr(getattr(torch, kind, None), "is_available", None)
    if kind in ("cpu", "meta") or available is None or not available():
        return MODELLED_LINK
    return _cached_link(device)


@functools.cache
def _cached_link(device: str) -> Link:
    with timings_cache() as cache:
        found = cache.get("link", "", device)
        if found:
            return Link(**found)
        link = measure_link(torch.device(device))
        cache.put("link", "", device, asdict(link))
        return link


def measure_link(device: torch.device, rounds: int = 5) -> Link:
    """Median bytes per second of pinned copies of 64 MiB each way between ``device`` and host memory.

    Example:
        >>> measure_link(torch.device("cuda"))
        Link(d2h=5.4e10, h2d=5.5e10)
    """
    block = torch.ones(_PROBE_BYTES, dtype=torch.uint8, device=device)
    host = torch.empty(_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    clock = Clock(str(device))
    seconds = []
    for dst, src in ((host, block), (block, host)):
        dst.copy_(src, non_blocking=True)  # warm-up
        seconds.append(statistics.median(clock.time(lambda d=dst, s=src: d.copy_(s, non_blocking=True))[1]
                                         for _ in range(rounds)))
    return Link(_PROBE_BYTES / seconds[0], _PROBE_BYTES / seconds[1])
