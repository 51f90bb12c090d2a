"""Runs of consecutive blocks checkpointed as one region: the ``segment`` options of a chain.

A block checkpointed alone keeps its inputs until its backward.  For a single layer that is everything it
saves (a ``Linear`` saves its input), so a chain of layers gains nothing block by block; and between two
repeated blocks the boundary activation may be large next to what either saves.  A *segment* is a run of
blocks ``i..j`` that are consecutive children of one plain ``nn.Sequential`` (``StepProfile.links``), run
as one region, as ``checkpoint_sequential`` does with equal runs:

* it keeps block ``i``'s inputs (``kept = rows[i].held_bytes``, plus the shared storages block ``i`` takes)
  and frees every own byte of ``i..j`` in every later stretch of the step, and the shared storages made and
  held only inside it (a ReLU's output the next convolution saves too; the solver counts those);
* its backward starts with block ``j``'s and reruns ``i..j`` there: the transient is what the plain forward
  held above its live bytes when ``i`` started, up to ``j``'s last saved tensor (early stop ends the rerun
  there), plus block ``i``'s inputs the plain forward had freed by then (the region holds them); then blocks
  ``j..i`` run their backward over their recomputed tensors as without a plan, and block ``i``'s inputs that
  it does not save (a Dropout's) alive beside them;
* its time is each block's price of checkpointing, less the per-region machinery it shares
  (``region_time`` once), plus the ops after each inner block's last saved tensor, which a lone block's
  early stop skips but the next block needs (``tail_time``).

The solver (:mod:`remat.planning.solve.solver`) takes a segment as one option of its first block with
``span = j - i + 1`` and checks every stretch inside it; :func:`sequential_choice` gives the options
``checkpoint_sequential`` amounts to, so plans can be compared with it on the same cost model.

Example:
    >>> prof = remat.profile(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)), x)
    >>> [(o.name, o.span) for o in segment_options(prof)[0]]
    [('segment', 2), ('segment', 3)]
"""

from __future__ import annotations

from collections.abc import Sequence

from ...policies.hostcopy import engine_for
from ..measure.copies import link_for
from ..measure.profile import SharedTensor, StepProfile
from .keptoffload import keep_offload_options
from .options import DEFAULT_ALLOW, BlockOption, block_options

__all__ = ["MAX_SPAN", "chain_options", "passed_on", "segment_options", "segment_time", "segment_transient",
           "sequential_choice"]

MAX_SPAN = 64
"""Longest run one segment option covers: the solver's work grows with the square of it (and a longer
region rarely pays: its rerun holds all of it at once)."""


def segment_time(prof: StepProfile, first: int, last: int) -> float:
    """Extra seconds per step of checkpointing blocks ``first..last`` as one region.

    Example:
        >>> segment_time(prof, 3, 3) == prof.rows[3].checkpoint_time
        True
    """
    rows = prof.rows[first:last + 1]
    shared = sum(row.region_time for row in rows[1:])
    return sum(row.checkpoint_time for row in rows) - shared + sum(row.tail_time for row in rows[:-1])


def segment_transient(prof: StepProfile, first: int, last: int) -> int:
    """Bytes the rerun of blocks ``first..last`` holds above the live bytes at the start of its backward.

    Example:
        >>> segment_transient(prof, 3, 3) == prof.rows[3].recompute_bytes
        True
    """
    rows = prof.rows
    released = rows[first].released_inputs

    def rerun(k: int, live: int) -> int:
        # the region holds block first's inputs through its rerun, where the step without a plan freed some
        return live + sum(nbytes for block, nbytes in released if block <= k)

    top = max([rerun(k, rows[k].forward_peak) for k in range(first, last)] + [rerun(last, rows[last].save_peak)])
    return max(0, top - rows[first].forward_start)


def passed_on(prof: StepProfile, shared: SharedTensor) -> int:
    """From which block's forward on (a prefix of the chain) only the blocks that save or take ``shared`` hold
    it: ``len(prof.rows) + 1`` (never) unless the blocks that returned it are consecutive children of one plain
    ``nn.Sequential``, whose loop holds a child's output only until the next child has returned, and no block
    after that one holds it.

    Example:
        >>> passed_on(prof, prof.shared[0])  # a ReLU's output the next layer took: let go after that layer
        4
    """
    n, made = len(prof.rows), shared.output_of
    if not made or shared.outside or max(made) + 1 >= n or max(shared.holders, default=0) > max(made) + 1:
        return n + 1
    linked = all(prof.links[j] if j < len(prof.links) else False for j in range(min(made), max(made) + 1))
    return max(made) + 2 if linked else n + 1


def segment_options(prof: StepProfile, max_span: int = MAX_SPAN) -> dict[int, list[BlockOption]]:
    """Per block index, the ``segment`` options that start there: one per run of 2 to ``max_span`` linked
    blocks, as :class:`~remat.planning.choices.options.BlockOption` with ``span`` set.

    Blocks that did not run (no price) end a run, and none starts at a block that writes in place to its input
    (the region would rerun from the written input); one whose backward the profile did not see start (its output
    is its input: ``nn.Identity``) is never a run's last, where the run's recomputation is checked.

    Example:
        >>> [o.span for o in segment_options(prof)[0]]
        [2, 3]
    """
    rows, links = prof.rows, prof.links
    priced = [row.checkpoint_time != float("inf") for row in rows]
    seen_backward = {seg.block for seg in prof.segments if seg.block is not None}
    found: dict[int, list[BlockOption]] = {}
    startable = [ok and not row.writes_input for ok, row in zip(priced, rows)]
    for first in range(len(rows)):
        last = first
        while (startable[first] and last + 1 < len(rows) and last < len(links) and links[last] and priced[last + 1]
               and last + 2 - first <= max_span):
            last += 1
            if last not in seen_backward:
                continue
            found.setdefault(first, []).append(BlockOption(
                "segment", kept=rows[first].held_bytes, extra_time=segment_time(prof, first, last),
                transient=segment_transient(prof, first, last), recomputes=True, span=last - first + 1,
                # every block but the last reruns whole, for the next: its collectives after its saved tensors too
                resends=sum(row.collectives + row.tail_collectives for row in rows[first:last])
                + rows[last].collectives))
    return found


def chain_options(prof: StepProfile, allow: Sequence[str] = DEFAULT_ALLOW) -> list[list[BlockOption]]:
    """Every block's options as the planner weighs them: :func:`~remat.planning.choices.options.block_options`, on an
    accelerator whose copies run on their own stream the ``keep_offload`` levels
    (:mod:`remat.planning.choices.keptoffload`) where allowed, and where ``checkpoint`` is allowed the segments starting
    at that block (:func:`segment_options`).

    Example:
        >>> sorted({o.name for o in chain_options(prof)[0]})
        ['checkpoint', 'keep', 'segment']
    """
    options = block_options(prof, allow)
    engine = None if prof.device.startswith(("cpu", "meta")) else engine_for(prof.device.split(":")[0])
    if "keep_offload" in allow and engine is not None and engine.model.asynchronous:
        for p, kept in keep_offload_options(prof, link_for(prof.device)).items():
            options[p] = options[p] + kept
    if "checkpoint" in allow:
        for first, segments in segment_options(prof).items():
            options[first] = options[first] + segments
    return options


def sequential_choice(prof: StepProfile, options: list[list[BlockOption]], segments: int) -> list[BlockOption]:
    """The options ``checkpoint_sequential(blocks, segments, x)`` amounts to, for a profile whose blocks are one
    ``nn.Sequential``'s children: runs of ``len(blocks) // segments`` blocks checkpointed, all but the last
    run, which runs plainly.

    ``options`` are the blocks' options (:func:`chain_options`); the result has one option per run (``keep``
    for each block left plain), for :func:`remat.planning.solve.solver.predict`.

    Example:
        >>> peak, extra = predict(prof, sequential_choice(prof, chain_options(prof), 4))
    """
    n = len(prof.rows)
    if not 1 <= segments <= n:
        raise ValueError(f"remat.planning.choices.chain: segments must be between 1 and {n}, got {segments}.")
    size = n // segments
    starts = {size * k for k in range(segments - 1)}
    chosen, p = [], 0
    while p < n:
        wanted = size if p in starts else 1
        name = "keep" if p not in starts else ("checkpoint" if size == 1 else "segment")
        match = [o for o in options[p] if o.name == name and o.span == wanted]
        if not match:
            raise ValueError(f"remat.planning.choices.chain: `{prof.rows[p].name}` has no {name} option over {wanted} "
                             "blocks (are they children of one nn.Sequential?).")
        chosen.append(match[0])
        p += wanted
    return chosen
