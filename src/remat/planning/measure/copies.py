"""The host link: its bandwidth each way, measured once per process, and a single copy back's wait.

A copy costs the step only the time the compute stream waits for it.  The step's copies are priced together, tensor by
tensor, on the copy engine's timeline (:mod:`remat.planning.measure.copyline`); one option alone is priced here by
:func:`prefetch_wait`, the part of a copy back that outlasts the compute it starts before.

The link's bandwidth, each way, is measured once per process on an accelerator and kept in the timings file
(:mod:`remat.planning.measure.timecache`), like the ops' times; where there is nothing to measure (the CPU, the meta
device) :data:`MODELLED_LINK` stands in: the pinned copies measured on an NVIDIA H200 (PCIe 5).

Example:
    >>> prefetch_wait(32 << 20, 5e-3, link_for("cpu"))
    0.0
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import asdict, dataclass

import torch

from .timecache import timings_cache
from .timing import Clock

__all__ = ["MODELLED_LINK", "Link", "link_for", "measure_link", "prefetch_wait"]


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
