"""A step's copies to host memory tensor by tensor, as the copy engine schedules them: what the compute waits for.

:func:`~remat.planning.measure.copies.copy_waits` prices a block's offloaded inputs a block at a time.  A kept block
that offloads its largest saved tensors (``keep_offload``, :mod:`remat.planning.choices.keptoffload`) moves several
tensors a block, more bytes than a forward may hide, and the engine (:mod:`remat.policies.hostcopy`) then decides how
much the compute waits.  :func:`simulate` follows its rules on one outbound and one inbound link:

* **Forward.**  A tensor's copy out starts when the compute has made it (at its share of its block's forward)
  and the outbound link is free.  Each copy joins the engine's window; a later save lets go of the copies it
  finds complete, oldest first, and once the window holds more than ``limit`` bytes the host waits for the
  oldest copies until it does not: the compute stalls until that copy completes (the host is taken to issue
  work as the device runs it, the case where it hides nothing).
* **The turn.**  Copies still in the window when forward ends are held on the device and served to backward
  without a round trip.
* **Backward.**  Blocks in reverse, each its recomputation then its backward (twice its forward); a tensor is
  needed at its share of that span.  Fetching a tensor starts its own copy back if none is on its way, and
  those of the ``depth`` tensors saved just before it (those already back count among them); the compute waits
  for a tensor that is not back yet.  Copies back run one after another, each after its own copy out.

Example:
    >>> from remat.planning.measure.copies import MODELLED_LINK
    >>> line = simulate([2e-3] * 4, [0.0] * 4, [[Copy(0.5, 0.5, 32 << 20)]] * 4, MODELLED_LINK, 256 << 20)
    >>> line.wait
    0.0
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from ...policies.offload import PREFETCH_DEPTH
from .copies import Link

__all__ = ["Copy", "Timeline", "simulate"]


@dataclass(frozen=True)
class Copy:
    """One tensor a block moves: made at ``out_at`` of its forward (0: a block's input, there when it starts; 1:
    at its end), first needed at ``back_at`` of its backward span (recomputation, then backward), ``nbytes``.

    Example:
        >>> Copy(out_at=0.8, back_at=0.2, nbytes=88 << 20)  # made late in forward, needed early in backward
        Copy(out_at=0.8, back_at=0.2, nbytes=92274688)
    """

    out_at: float
    back_at: float
    nbytes: int


@dataclass(frozen=True)
class Timeline:
    """What :func:`simulate` found: ``wait`` seconds the compute stalls in all (``forward_wait`` of them in forward,
    for the window), ``held`` bytes served to backward without a round trip, and ``window`` the most bytes the
    engine's window held at once in forward."""

    wait: float
    forward_wait: float
    held: int
    window: int


class _Moved:
    __slots__ = ("nbytes", "out_end", "held", "ready")

    def __init__(self, nbytes: int, out_end: float) -> None:
        self.nbytes, self.out_end, self.held = nbytes, out_end, True
        self.ready: float | None = None  # when its copy back completes, once started


def simulate(forward: Sequence[float], recompute: Sequence[float], copies: Sequence[Sequence[Copy]], link: Link,
             limit: int, head: float = 0.0, depth: int = PREFETCH_DEPTH) -> Timeline:
    """The compute stream's waits for ``copies`` (per block, see :class:`Copy`); ``forward``: each block's forward
    seconds, ``recompute``: what its recomputation adds in backward, ``head``: seconds between the last block's
    forward and its backward; ``limit`` and ``depth``: the engine's window and prefetch depth.

    Example:
        >>> simulate([1e-3], [0.0], [[Copy(1.0, 0.0, 1 << 30)]], MODELLED_LINK, 256 << 20).held  # nothing lets go
        1073741824
    """
    now = stalled = 0.0
    out_free = 0.0
    window: deque[_Moved] = deque()
    in_window = most = 0
    saved: list[list[tuple[Copy, _Moved]]] = []
    for f, block in zip(forward, copies):
        done_at, moved = 0.0, []
        for c in sorted(block, key=lambda c: c.out_at):
            now += (c.out_at - done_at) * f
            done_at = c.out_at
            out_free = max(out_free, now) + link.seconds(c.nbytes, to_host=True)
            entry = _Moved(c.nbytes, out_free)
            moved.append((c, entry))
            window.append(entry)
            in_window += c.nbytes
            most = max(most, in_window)
            late = None
            while len(window) > 1:  # as the engine's window: never the entry just added
                over = in_window > limit
                if not over and window[0].out_end > now:
                    break
                oldest = window.popleft()
                oldest.held = False
                in_window -= oldest.nbytes
                late = oldest if over else late
            if late is not None and late.out_end > now:
                stalled += late.out_end - now
                now = late.out_end
        now += (1 - done_at) * f
        saved.append(moved)
    forward_wait = stalled
    held = sum(m.nbytes for m in window)
    now += head
    order = [m for moved in saved for _, m in moved]  # save order
    position = {id(m): k for k, m in enumerate(order)}
    fetched: set[int] = set()
    back_free = 0.0

    def bring(m: _Moved) -> None:
        nonlocal back_free
        back_free = max(back_free, now, m.out_end) + link.seconds(m.nbytes, to_host=False)
        m.ready = back_free

    for i in reversed(range(len(forward))):
        span = recompute[i] + 2 * forward[i]
        done_at = 0.0
        for c, m in sorted(saved[i], key=lambda pair: pair[0].back_at):
            now += (c.back_at - done_at) * span
            done_at = c.back_at
            fetched.add(id(m))
            if not m.held and m.ready is None:
                bring(m)
            k, seen = position[id(m)] - 1, 0
            while k >= 0 and seen < depth:  # the next tensors backward needs, those already back among them
                before = order[k]
                if id(before) not in fetched:
                    seen += 1
                    if not before.held and before.ready is None:
                        bring(before)
                k -= 1
            if not m.held and m.ready > now:
                stalled += m.ready - now
                now = m.ready
        now += (1 - done_at) * span
    return Timeline(stalled, forward_wait, held, most)
