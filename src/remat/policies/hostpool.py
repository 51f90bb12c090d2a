"""Host buffers for offloaded activations, reused from step to step.

A block is a flat ``uint8`` host tensor (pinned when the device can copy asynchronously from it) of one
*size class*: sizes are rounded up to one of four steps per power of two, so tensors of close sizes share
blocks and a block is at most 25% larger than what it holds.  A block comes back to the pool with the last
device event of the copies that used it (device→host into it, host→device out of it); it is handed out again
only once that event has completed, which the pool asks without waiting, the next time it is asked for a block.

Example:
    >>> pool = HostPool(pinned=False, done=lambda event: True)
    >>> block = pool.take(1000)
    >>> pool.give_back(block, None)
    >>> pool.take(900) is block  # same size class, copies done
    True
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["HostPool", "size_class"]

_SMALLEST = 4096  # below a page, rounding up costs nothing worth saving


def size_class(nbytes: int) -> int:
    """The block size that serves ``nbytes``: a multiple of a quarter of the power of two below it.

    Example:
        >>> [size_class(n) for n in (1, 5000, 5200, 1 << 20)]
        [4096, 5120, 6144, 1048576]
    """
    if nbytes <= _SMALLEST:
        return _SMALLEST
    step = 1 << ((nbytes - 1).bit_length() - 3)
    return -(-nbytes // step) * step


class HostPool:
    """Host blocks by size class: free ones, and returned ones whose copies may still run.

    ``done(event)`` says, without blocking, whether a device event has completed (``None`` is always done).
    :meth:`give_back` only appends to a queue, so it is safe from a finalizer on any thread; the queue is
    sorted out by :meth:`collect`, which :meth:`take` runs first.
    """

    def __init__(self, pinned: bool, done: Callable[[Any], bool]) -> None:
        self.pinned = pinned
        self._done = done
        self.free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._returned: deque[tuple[torch.Tensor, Any]] = deque()
        self._waiting: list[tuple[torch.Tensor, Any]] = []
        self.allocations = 0  # host allocations made, ever
        self.allocated_bytes = 0  # bytes of every block this pool owns (free, waiting or in use)

    def take(self, nbytes: int) -> torch.Tensor:
        """A block of at least ``nbytes`` whose earlier copies have completed (a new one if none is free)."""
        self.collect()
        size = size_class(nbytes)
        blocks = self.free.get(size)
        if blocks:
            return blocks.pop()
        self.allocations += 1
        self.allocated_bytes += size
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)

    def give_back(self, block: torch.Tensor, event: Any) -> None:
        """Return ``block``; it is reused once ``event`` (the last copy that used it) has completed."""
        self._returned.append((block, event))

    def collect(self) -> None:
        """Move returned blocks whose copies have completed to the free lists (never waits)."""
        while self._returned:
            self._waiting.append(self._returned.popleft())
        still = []
        for block, event in self._waiting:
            if event is None or self._done(event):
                self.free[block.numel()].append(block)
            else:
                still.append((block, event))
        self._waiting = still

    @property
    def free_bytes(self) -> int:
        return sum(block.numel() for blocks in self.free.values() for block in blocks)

    @property
    def waiting_bytes(self) -> int:
        """Bytes returned whose copies were not known complete at the last :meth:`collect`."""
        return sum(block.numel() for block, _ in (*self._waiting, *self._returned))

    @property
    def in_use_bytes(self) -> int:
        """Bytes held by offloaded tensors that are still alive."""
        return self.allocated_bytes - self.free_bytes - self.waiting_bytes

    def trim(self) -> None:
        """Release every free block to the host allocator (the next step allocates again)."""
        self.collect()
        self.allocated_bytes -= self.free_bytes
        self.free.clear()

    def __repr__(self) -> str:
        kind = "pinned" if self.pinned else "pageable"
        return (f"HostPool({kind}: {self.allocated_bytes} B in {self.allocations} allocations, "
                f"{self.free_bytes} B free, {self.waiting_bytes} B waiting on copies)")
