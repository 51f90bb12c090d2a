"""A step's copies to host memory tensor by tensor, as the copy engine schedules them: what the compute waits for.

A plan's blocks move bytes to host memory: a checkpointed block its inputs (``checkpoint_offload``), a kept block its
largest saved tensors (``keep_offload``, :mod:`remat.planning.choices.keptoffload`), several a block, more bytes than
its own forward may hide.  The copy engine (:mod:`remat.policies.hostcopy`) decides how much the compute waits for
them; :func:`simulate` follows its rules on one outbound and one inbound link:

* **Forward.**  A tensor's copy out starts when the compute has made it (at its share of its block's forward)
  and the outbound link is free.  Each copy joins the engine's window; a later save lets go of the copies it
  finds complete, oldest first, and once the window holds more than ``limit`` bytes the host waits for the
  oldest copies until it does not: the compute stalls until that copy completes (the host is taken to issue
  work as the device runs it, the case where it hides nothing).
* **The turn.**  Copies still in the window when forward ends are held on the device and served to backward
  without a round trip (unless a plan's schedule drains them first, below).
* **Backward.**  Blocks in reverse, each its recomputation then its backward (twice its forward); a tensor is
  needed at its share of that span.  Fetching a tensor starts its own copy back if none is on its way, and
  those of the ``depth`` tensors saved just before it (those already back count among them); the compute waits
  for a tensor that is not back yet.  Copies back run one after another, each after its own copy out.
* **A plan's schedule** (:mod:`remat.planning.solve.copyplan`).  A plan that moves a kept block's tensors bounds
  its copies at block starts instead of by the window: ``drains[p]`` is what the window may hold when block
  ``p`` starts and ``turn`` what it may hold when forward ends (the engine's
  :meth:`~remat.policies.hostcopy.HostCopies.drain`: the host waits for the oldest copies beyond it).  Its
  ``scheduled`` copies go out with no window limit (nor count against other copies'), and a fetch of one brings
  back the tensors before it as far as ``ahead`` bytes reach rather than ``depth`` tensors.

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
    at its end), first needed at ``back_at`` of its backward span (recomputation, then backward), ``nbytes``;
    ``scheduled``: moved under a plan's schedule (no window limit, prefetch by bytes).

    Example:
        >>> Copy(out_at=0.8, back_at=0.2, nbytes=88 << 20)  # made late in forward, needed early in backward
        Copy(out_at=0.8, back_at=0.2, nbytes=92274688, scheduled=False)
    """

    out_at: float
    back_at: float
    nbytes: int
    scheduled: bool = False


@dataclass(frozen=True)
class Timeline:
    """What :func:`simulate` found: ``wait`` seconds the compute stalls in all (``forward_wait`` of them in forward,
    for the window and the drains), ``held`` bytes served to backward without a round trip, ``window`` the most
    bytes the engine's window held at once in forward.  Per block: ``before`` and ``after``, the bytes the window
    holds on the device when the block starts, before and after its drain; ``back``, the bytes of earlier blocks'
    tensors on the device (brought back ahead, or held) when the block's backward ends."""

    wait: float
    forward_wait: float
    held: int
    window: int
    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()
    back: tuple[int, ...] = ()


class _Moved:
    __slots__ = ("nbytes", "out_end", "held", "ready", "block", "scheduled")

    def __init__(self, nbytes: int, out_end: float, block: int, scheduled: bool) -> None:
        self.nbytes, self.out_end, self.held = nbytes, out_end, True
        self.block, self.scheduled = block, scheduled
        self.ready: float | None = None  # when its copy back completes, once started


def simulate(forward: Sequence[float], recompute: Sequence[float], copies: Sequence[Sequence[Copy]], link: Link,
             limit: int, head: float = 0.0, depth: int = PREFETCH_DEPTH, ahead: int | None = None,
             drains: Sequence[int | None] | None = None, turn: int | None = None) -> Timeline:
    """The compute stream's waits for ``copies`` (per block, see :class:`Copy`); ``forward``: each block's forward
    seconds, ``recompute``: what its recomputation adds in backward, ``head``: seconds between the last block's
    forward and its backward; ``limit`` and ``depth``: the engine's window and prefetch depth; ``ahead`` and
    ``drains``: a plan's schedule (see the module's docstring).

    Example:
        >>> simulate([1e-3], [0.0], [[Copy(1.0, 0.0, 1 << 30)]], MODELLED_LINK, 256 << 20).held  # nothing lets go
        1073741824
    """
    now = stalled = 0.0
    out_free = 0.0
    window: deque[_Moved] = deque()
    in_window = bounded = most = 0  # bounded: the bytes of unscheduled copies, those the limit counts
    saved: list[list[tuple[Copy, _Moved]]] = []
    before, after = [], []

    def pop() -> _Moved:
        nonlocal in_window, bounded
        oldest = window.popleft()
        oldest.held = False
        in_window -= oldest.nbytes
        bounded -= 0 if oldest.scheduled else oldest.nbytes
        return oldest

    def drain(nbytes: int) -> None:
        nonlocal now, stalled
        while window and window[0].out_end <= now:
            pop()
        late = None
        while window and in_window > nbytes:
            late = pop()
        if late is not None and late.out_end > now:
            stalled += late.out_end - now
            now = late.out_end

    for p, (f, block) in enumerate(zip(forward, copies)):
        before.append(in_window)
        if drains is not None and drains[p] is not None:
            drain(drains[p])
        after.append(in_window)
        done_at, moved = 0.0, []
        for c in sorted(block, key=lambda c: c.out_at):
            now += (c.out_at - done_at) * f
            done_at = c.out_at
            out_free = max(out_free, now) + link.seconds(c.nbytes, to_host=True)
            entry = _Moved(c.nbytes, out_free, p, c.scheduled)
            moved.append((c, entry))
            window.append(entry)
            in_window += c.nbytes
            bounded += 0 if c.scheduled else c.nbytes
            most = max(most, in_window)
            late = None
            while len(window) > 1:  # as the engine's window: never the entry just added
                over = bounded > limit and not c.scheduled
                if not over and window[0].out_end > now:
                    break
                oldest = pop()
                late = oldest if over else late
            if late is not None and late.out_end > now:
                stalled += late.out_end - now
                now = late.out_end
        now += (1 - done_at) * f
        saved.append(moved)
    if turn is not None:
        drain(turn)
    forward_wait = stalled
    held = sum(m.nbytes for m in window)
    now += head
    order = [m for moved in saved for _, m in moved]  # save order
    scheduled = any(m.scheduled for m in order)
    position = {id(m): k for k, m in enumerate(order)}
    fetched: set[int] = set()
    back_free = 0.0
    back = [0] * len(forward)

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
            # the next tensors backward needs, those already back among them: ``depth`` of them, or as far as
            # ``ahead`` bytes reach from a scheduled fetch; and a scheduled tensor that ``ahead`` reaches
            own = ahead if m.scheduled else None
            farthest = max(own or 0, ahead or 0) if scheduled else own or 0
            k, seen, reach = position[id(m)] - 1, 0, 0
            while k >= 0:
                before_it = order[k]
                k -= 1
                if id(before_it) in fetched:
                    continue
                reach += before_it.nbytes
                limit = ahead if before_it.scheduled else own
                wanted = reach <= limit if limit is not None else seen < depth
                if wanted and not before_it.held and before_it.ready is None:
                    bring(before_it)
                seen += not before_it.scheduled
                if (own is not None or seen >= depth) and reach > farthest:
                    break
            if not m.held and m.ready > now:
                stalled += m.ready - now
                now = m.ready
        now += (1 - done_at) * span
        back[i] = sum(m.nbytes for m in order if m.block < i and id(m) not in fetched
                      and (m.held or m.ready is not None))
    return Timeline(stalled, forward_wait, held, most, tuple(before), tuple(after), tuple(back))
