"""The exact front of op-level policies of one block: the least extra time for each amount of kept memory.

A point of the front is one way to run the block (a :class:`FrontPoint`):

=============  =====================================  ===========================================================
mode           kept through the step                  extra time per step
=============  =====================================  ===========================================================
``keep``       what autograd saves (inputs included)  0
``checkpoint`` the block's inputs                     wall time of the first ``stop`` ops + region + saved tensors
``selective``  inputs + the kept op outputs ``K``     checkpoint's − Σ gain of ``K`` + policy dispatch
=============  =====================================  ===========================================================

Times come from :class:`remat.planning.measure.prices.BlockPrices` (per op device and host time, combined as the
device waits for them, and the machinery's measured costs).  The gain of a kept op is the kernel time it
spares; for a random in-place op (kept by value, see :mod:`remat.policies.selective`) minus its two
copies, forward's and the recomputation's.  Random ops are keepable like any other: a served one sets its
generator's state instead of drawing, which costs microseconds and is left out.

``stop`` is where remat's early stop ends a recomputation: at the block's
last saved tensor, whatever is kept.

Why there are no "recompute j ⇒ j's inputs are kept or recomputed"
constraints: remat's replay reruns *every* op that is not kept up to the stop
point (kept outputs are served instead), whether or not a dropped saved
tensor needs it.  The constraints hold by construction and the cost is a sum
over the kept ops, so the front is that of a 0/1 knapsack, enumerated exactly
by a dynamic program over the ops that keeps every (bytes, time) state no
other state beats — all breakpoints in one pass, both ends included.  (A
replay that skipped ops no dropped tensor needs would make the set
formulation matter; see :func:`needed_ops`.)

During the block's backward the recomputation rebuilds every saved tensor
that is not kept and holds it until backward uses it; ``recompute_peak`` is
the most it holds at once (rebuilt saved tensors plus temporaries alive at
that op, from the storage lives of a plain forward), and ``backward_extra``
is how far that takes the block above plain autograd at the same moment.
Offloading: on an accelerator with a measured host link (``link_bytes_per_s``), a selective point may also
move op outputs to host memory (``offloaded``).  An offloaded output is served to the recomputation like a
kept one (it spares its kernel) but holds no device memory between forward and backward; it comes back for
the recomputation, so it counts in ``recompute_peak``.  Its copies cost only what the block's compute cannot
hide (:meth:`_CostModel.copy_time`): a copy out starts when its op's kernel ends and the region's end waits
for the last one; the copies back start with the recomputation and each must arrive before the rerun reaches
the op it serves.  Each point of the keep /
recompute front may get a twin with the offload set a greedy pass picks (outputs by kernel time spared per
byte, while the step gets faster): :func:`offload_twins`.  Not an option on a CPU host (there is nowhere
cheaper to put the bytes).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from ..basics.blockpolicy import BlockPolicy, OpDecision
from ..basics.units import format_bytes
from ..measure.opgraph import BlockGraph, OpProfile
from ..measure.prices import BlockPrices, recompute_peak

__all__ = ["FrontPoint", "block_front", "evaluate", "fronts", "needed_ops", "offload_twins", "policy_for",
           "thin_front"]


@dataclass(frozen=True)
class FrontPoint:
    """One way to run a block: its mode, kept op outputs (node indices) and predicted cost.

    ``kept_bytes`` is held from the block's forward to its backward and
    includes ``input_bytes`` (the block's inputs it holds); ``extra_time`` is
    seconds added per step; ``recompute_peak`` / ``backward_extra`` are bytes
    (see the module docstring); ``recomputed_ops`` counts the ops whose
    kernels run again.
    """

    mode: str
    kept: tuple[int, ...]
    kept_bytes: int
    input_bytes: int
    extra_time: float
    recompute_peak: int
    backward_extra: int
    recomputed_ops: int
    offloaded: tuple[int, ...] = ()
    offloaded_bytes: int = 0
    copy_time: float = 0.0  # of extra_time: the offload copies' time the block's compute does not hide

    def describe(self, graph: BlockGraph) -> str:
        """One line: mode, kept bytes, what is kept (and offloaded), extra time."""
        def names(nodes: tuple[int, ...]) -> str:
            return ", ".join(f"{graph.nodes[i].op.split('.')[1]}#{graph.nodes[i].call}" for i in nodes)

        what = f" keeps {names(self.kept)}" if self.kept else ""
        moved = f", offloads {format_bytes(self.offloaded_bytes)} ({names(self.offloaded)})" if self.offloaded else ""
        return (f"{self.mode}: {format_bytes(self.kept_bytes)} kept{what}{moved}; {self.recomputed_ops} ops rerun, "
                f"+{self.extra_time * 1e3:.2f} ms, backward +{format_bytes(self.backward_extra)}")


class _CostModel:
    """The cost model of one graph: its time side (:class:`~remat.planning.measure.prices.BlockPrices`) and its
    peaks."""

    def __init__(self, graph: BlockGraph) -> None:
        self.graph = graph
        self.keepable = set(graph.keepable)
        self.prices = BlockPrices(graph)
        self.checkpoint_time = self.prices.checkpoint_time
        self.selective_time = self.prices.selective_time
        self.gain = self.prices.gain
        self.rerun = sum(1 for n in graph.nodes[:graph.stop] if n.kind != "ignored")
        link = graph.overheads.link_bytes_per_s
        self.link = link if graph.asynchronous and link > 0 else 0.0
        # when each op's kernel ends in the block's forward (kernel times add up to the measured forward)
        total = sum(n.kernel_time for n in graph.nodes) or 1.0
        scale, elapsed = graph.forward_time / total, 0.0
        self.made_at: list[float] = []
        for n in graph.nodes:
            elapsed += n.kernel_time * scale
            self.made_at.append(elapsed)

    def copy_time(self, offloaded: tuple[int, ...], served: tuple[int, ...]) -> float:
        """Seconds the device waits for the copies of the ``offloaded`` nodes (``served``: every node the
        recomputation does not rerun).

        Out: one copy after another, each from when its op's kernel ends, and the region's end waits for the
        last (the engine fences there).  Back: all start together when the recomputation starts, one after
        another in forward order, and the rerun reaches each where the kernels before it, not served, end.
        """
        if not offloaded:
            return 0.0
        nodes, forward = self.graph.nodes, self.graph.forward_time
        done = 0.0
        for i in offloaded:
            done = max(done, self.made_at[i]) + nodes[i].out_bytes / self.link
        out_wait = max(0.0, done - forward)
        skipped = set(served)
        back_wait = arrived = reached = 0.0
        position = 0
        for i in offloaded:
            arrived += nodes[i].out_bytes / self.link
            for n in nodes[position:i]:
                if n.index not in skipped:
                    reached += n.kernel_time
            position = i
            back_wait = max(back_wait, arrived - reached)
        return out_wait + back_wait

    def point(self, mode: str, kept: tuple[int, ...], offloaded: tuple[int, ...] = ()) -> FrontPoint:
        graph = self.graph
        if mode == "keep":
            return FrontPoint("keep", (), graph.keep_all_bytes, graph.input_saved_bytes, 0.0, 0, 0, 0)
        if mode not in ("checkpoint", "selective") or (mode == "checkpoint" and (kept or offloaded)):
            raise ValueError(
                f"remat: mode must be 'keep', 'checkpoint' or 'selective' (with kept nodes), got {mode!r}.")
        if not self.keepable.issuperset(kept + offloaded) or set(kept) & set(offloaded):
            raise ValueError(f"remat: nodes {sorted(set(kept + offloaded) - self.keepable)} cannot be kept or "
                             "offloaded (choose from graph.keepable), and none may be both.")
        if offloaded and not self.link:
            raise ValueError("remat: offloading needs an accelerator with a measured host link "
                             "(graph.overheads.link_bytes_per_s); on the CPU there is nowhere cheaper to put bytes.")
        nodes = graph.nodes
        served = tuple(sorted(kept + offloaded))
        moved = sum(nodes[i].out_bytes for i in offloaded)
        copies = self.copy_time(offloaded, served)
        time = self.prices.time(mode, served) + copies
        kept_bytes = graph.input_bytes + sum(nodes[i].out_bytes for i in kept)
        peak = recompute_peak(graph, set(served)) + moved
        return FrontPoint(mode, kept, kept_bytes, graph.input_bytes, time, peak,
                          max(0, kept_bytes + peak - graph.keep_all_bytes), self.rerun - len(served),
                          offloaded, moved, copies)

    def with_offload(self, point: FrontPoint) -> FrontPoint | None:
        """``point`` with the op outputs it recomputes moved to host memory where that makes the step faster
        (greedy, by kernel time spared per byte); None where nothing is worth moving."""
        if not self.link or point.mode == "keep":
            return None
        kept, nodes = point.kept, self.graph.nodes
        candidates = sorted((i for i in self.keepable - set(kept) if self.gain[i] > 0 and nodes[i].out_bytes),
                            key=lambda i: (-self.gain[i] / nodes[i].out_bytes, i))
        chosen: list[int] = []
        moved, best = 0, point.extra_time
        for i in candidates:
            served = tuple(sorted((*kept, *chosen, i)))
            nbytes = moved + nodes[i].out_bytes
            time = self.prices.time("selective", served) + self.copy_time(tuple(sorted((*chosen, i))),
                                                                                      served)
            if time >= best:
                break
            chosen.append(i)
            moved, best = nbytes, time
        return self.point("selective", kept, tuple(sorted(chosen))) if chosen else None


def evaluate(graph: BlockGraph, mode: str, kept: Iterable[int] = (), offloaded: Iterable[int] = ()) -> FrontPoint:
    """The cost model's prediction for running ``graph``'s block in ``mode`` keeping the ``kept`` nodes (and
    moving the ``offloaded`` ones to host memory, on an accelerator).

    Example:
        >>> evaluate(graph, "selective", [graph.keepable[0]]).kept_bytes
    """
    return _CostModel(graph).point(mode, tuple(sorted(set(kept))), tuple(sorted(set(offloaded))))


def _knapsack(items: list[tuple[int, float, int]]) -> list[tuple[int, float, tuple[int, ...]]]:
    """Every (bytes, time saved) a subset of ``items`` reaches that no other subset beats, with the subset."""
    states: list[tuple[int, float, tuple | None]] = [(0, 0.0, None)]
    for nbytes, gain, index in items:
        grown = [(b + nbytes, g + gain, (index, trail)) for b, g, trail in states]
        merged = sorted(states + grown, key=lambda s: (s[0], -s[1]))
        states = []
        best = -1.0
        for state in merged:
            if state[1] > best:
                states.append(state)
                best = state[1]
    result = []
    for nbytes, gain, trail in states:
        chosen = []
        while trail is not None:
            chosen.append(trail[0])
            trail = trail[1]
        result.append((nbytes, gain, tuple(sorted(chosen))))
    return result


def block_front(graph: BlockGraph) -> list[FrontPoint]:
    """The exact front of ``graph``'s block: kept bytes strictly up, extra time strictly down.

    The first point is ``checkpoint`` (only the inputs kept), the last ``keep``.

    Example:
        >>> front = block_front(profile_ops(model, tokens).blocks["blocks.0"])
        >>> [p.mode for p in (front[0], front[-1])]
        ['checkpoint', 'keep']
    """
    model = _CostModel(graph)
    candidates = [model.point("keep", ()), model.point("checkpoint", ())]
    prices = model.prices
    items = [(graph.nodes[i].out_bytes, prices.gain[i], i) for i in graph.keepable]
    for _, gain, chosen in _knapsack(items):
        # Only selective states that can beat plain checkpointing on time are worth scoring.
        if chosen and prices.selective(gain) < model.checkpoint_time:
            candidates.append(model.point("selective", chosen))
    candidates.sort(key=lambda p: (p.kept_bytes, p.extra_time))
    front: list[FrontPoint] = []
    for point in candidates:
        if not front or point.extra_time < front[-1].extra_time:
            front.append(point)
    return front


def offload_twins(graph: BlockGraph, points: Iterable[FrontPoint]) -> list[FrontPoint]:
    """Each of ``points`` with the op outputs it recomputes moved to host memory where the step gets faster
    (see the module docstring); points where nothing is worth moving, and every point on a CPU, have none.

    A twin keeps the same bytes in less time but brings its offloaded outputs back for its recomputation, so
    it does not replace its point on the front: the plan weighs both against the step's peak.

    Example:
        >>> twins = offload_twins(graph, block_front(graph))
    """
    model = _CostModel(graph)
    return [twin for twin in map(model.with_offload, points) if twin is not None]


def fronts(profile: OpProfile) -> dict[str, list[FrontPoint]]:
    """The front of every block of ``profile``, solved once per distinct graph (blocks share the list).

    Example:
        >>> per_block = fronts(profile_ops(model, tokens))
    """
    solved: dict[int, list[FrontPoint]] = {}
    result = {}
    for name, graph in profile.blocks.items():
        if id(graph) not in solved:
            solved[id(graph)] = block_front(graph)
        result[name] = solved[id(graph)]
    return result


def thin_front(front: list[FrontPoint], points: int) -> list[FrontPoint]:
    """At most ``points`` points of ``front``: both ends and the cheapest point under evenly spaced byte levels.

    Example:
        >>> len(thin_front(front, 8)) <= 8
        True
    """
    if points < 2:
        raise ValueError(f"remat: a thinned front keeps both ends; points must be >= 2, got {points}.")
    if len(front) <= points:
        return list(front)
    levels = [p.kept_bytes for p in front]
    low, high = levels[0], levels[-1]
    chosen = {0, len(front) - 1}
    for k in range(1, points - 1):
        chosen.add(bisect.bisect_right(levels, low + (high - low) * k / (points - 1)) - 1)
    return [front[i] for i in sorted(chosen)]


def policy_for(graph: BlockGraph, point: FrontPoint) -> BlockPolicy:
    """The installable, serializable :class:`~remat.planning.basics.blockpolicy.BlockPolicy` of one front point.

    Example:
        >>> policy_for(graph, front[len(front) // 2]).wrap(model.blocks[0])
    """
    if point.mode == "keep":
        return BlockPolicy("keep")
    kept, offloaded = set(point.kept), set(point.offloaded)
    return BlockPolicy(point.mode, [
        OpDecision(graph.nodes[i].op, graph.nodes[i].call, graph.nodes[i].out_bytes,
                   "keep" if i in kept else "offload" if i in offloaded else "recompute")
        for i in graph.keepable
    ])


def needed_ops(graph: BlockGraph, kept: Iterable[int]) -> set[int]:
    """The ops a recomputation would need to run if it ran only what rebuilds the dropped saved tensors.

    remat's replay runs more (every op up to ``graph.stop`` that is not
    kept); the difference is what a skipping replay would save.  Random ops
    that are not kept are needed (the random ops after them draw from where
    they leave the RNG), and so is every op that writes a needed storage in
    place (a kept random one is served, by a copy).

    Example:
        >>> sorted(needed_ops(graph, []))  # with nothing kept
    """
    kept = set(kept)
    nodes = graph.nodes[:graph.stop]
    writers: dict[int, list[int]] = {}
    for n in nodes:
        for target in n.writes:
            writers.setdefault(target, []).append(n.index)
    saved_producers = {s.producer for s in graph.storages if s.saved}
    frontier = [n.index for n in nodes if n.index not in kept and (n.index in saved_producers or n.random)]
    needed: set[int] = set()
    while frontier:
        index = frontier.pop()
        if index in needed or index in kept:
            continue
        needed.add(index)
        frontier.extend(graph.nodes[index].needs)
        frontier.extend(writers.get(index, ()))
    return needed
