"""What rerunning a block costs in time, from its op graph: the one price model of the profile and the fronts.

A block's op graph (:mod:`remat.planning.opgraph`) holds, per op, its device time (``kernel_time``), the
host time around it (``host_time``: Python, autograd, the dispatcher) and what it adds to a run
(``wall_time``, the two combined by :func:`remat.planning.timing.op_cost`: summed on the CPU, the larger
of the two on an accelerator, whose host runs ahead).

On the CPU, host and device time add up:

=============  ================================================================================
mode           extra time per step
=============  ================================================================================
``checkpoint`` region + saved tensors × per_saved + wall time of the first ``stop`` ops
``selective``  checkpoint's + the policy's host work (forward and replay) − Σ gains
=============  ================================================================================

and keeping op ``i`` spares its kernel: the replay still dispatches it but serves the output.  A region
refilled from its program (:mod:`remat.policies.program`) costs, instead, the machinery, what following its
tape adds to its forward (:meth:`~remat.planning.overheads.Overheads.follow`: per region, saved tensor and
watched module call; 0.2-0.3 ms on a small Llama layer, against its 0.8 ms forward) and, per op its program reruns,
the op's kernel and ``program_op``; keeping such an op spares both.

On an accelerator the host runs ahead of the device: while it dispatches a view or the region's machinery,
the device works through kernels queued before.  A rerun costs the larger of its kernels and its host work
(machinery included), not the sum of each op's larger share, which charged a Llama layer's 35 views as device
time (+22% on an H100).  A selective replay adds host work only: its policy per op and a detach per rebuilt
tensor that requires grad; where the region refills from its program (:mod:`remat.policies.program`), it
runs only the ops the saved tensors need (as the program written while profiling plans them), at
``program_op`` of host time each, and keeping an op the program would not run, or a draw a later one
reruns, spares nothing.  Its forward is priced as a region following its tape runs it, with no dispatch
mode at all: the policies of plans always can (regions that cannot, such as those keeping an in-place random
draw by value, are priced low; :mod:`.fronts` prices those as reruns of their Python code, not programs).
Keeping op ``i`` spares its kernel: ``max(kernels − Σ gains, host)``.  On an H100 Llama layer this gives
checkpoint 2.31 ms (measured 2.30) and ``save_matmuls`` 1.7 ms (measured 1.42).

On either device, a random in-place op kept by value gains its kernel less two copies of its bytes, forward's
and the replay's.

A graph with a timed fused refill (a profile inside :func:`remat.policies.fused_reruns`) is priced as that
refill runs (:mod:`.fusedtime`): each op's kernel counts for its share of the compiled refill, the host
makes one call, and a checkpoint (which keeps nothing as a policy there) costs the keep-nothing refill.

Near-ties between outputs of equal size are made exact (:data:`TIE`), so that which of them a plan keeps
does not follow timing noise from one process to the next.

``save_matmuls`` is the selective point that keeps every matmul-like output (:data:`MATMUL_OPS`).

Example:
    >>> prices = BlockPrices(graph)
    >>> prices.time("checkpoint"), prices.time("selective", prices.matmul_nodes())
"""

from __future__ import annotations

from collections.abc import Iterable

from ..policies.rules import MATMUL_OPS
from .opgraph import BlockGraph
from .timing import op_cost

__all__ = ["BlockPrices", "fused_shares"]

_MATMUL_NAMES = frozenset(str(op) for op in MATMUL_OPS)


class BlockPrices:
    """The time side of one graph's cost model, with what every price shares computed once.

    ``checkpoint_time`` / ``selective_time`` (nothing kept) are extra seconds per step; ``gain[i]`` what
    keeping keepable node ``i`` spares; ``matmul_time`` the device seconds of the matmul-like ops.
    """

    def __init__(self, graph: BlockGraph) -> None:
        self.graph = graph
        nodes, stop, overheads = graph.nodes, graph.stop, graph.overheads
        overlapped = graph.asynchronous

        def policy_work(node_list: Iterable, per_op: float) -> float:
            return sum(op_cost(n.host_time + per_op, n.kernel_time, overlapped)
                       - op_cost(n.host_time, n.kernel_time, overlapped) for n in node_list)

        machinery = overheads.region + overheads.per_saved * graph.saved_tensors
        copy = 2 * overheads.copy_per_byte
        gain = {}
        # Refilled from its program, a followed region reruns only the ops its saved tensors need, without its
        # Python code and with no dispatch mode, at ``program_op`` of host work each; its forward has no
        # dispatch mode either.  Otherwise its Python code reruns under the replay mode.
        program = graph.runs_program and overheads.program_op > 0
        rerun = graph.program_rerun() if program else list(range(stop))
        # Fused (a profile inside fused_reruns), the program's ops cost their share of one compiled refill, and
        # the host makes one call; a checkpoint there keeps nothing as a policy, so it is priced the same.
        fused = graph.fused if program else None
        factors, fixed = fused_shares(graph) if fused else ([1.0] * len(nodes), 0.0)
        kernel = [n.kernel_time * f for n, f in zip(nodes, factors)]
        running = set(rerun)
        # A kept draw still reruns where a later random op does (so that op draws as in forward).
        last_draw = max((i for i in running if nodes[i].random), default=-1) if program else -1

        def spared(i: int) -> bool:  # whether keeping node i spares running it
            return i in running and not (nodes[i].random and i < last_draw)

        if overlapped:
            # The host runs ahead of the device: while it dispatches one op (a view, a tiny one) the device
            # works through kernels queued before, so the rerun costs its kernels, or its host work where
            # that is longer (machinery included), not the sum of each op's larger share.  A policy adds host
            # work only: the replay's per op and detaches (a region following its tape runs forward with no
            # dispatch mode at all).  Serving an op spares its kernel.
            kernels = sum(n.kernel_time for n in nodes[:stop])
            host = sum(n.host_time for n in nodes[:stop]) + machinery
            self.checkpoint_time = max(kernels, host)
            if program:
                self.host_floor = machinery + (fused.host_time if fused else overheads.program_op * len(rerun))
                self.device_time = fixed + sum(kernel[i] for i in rerun)
            else:
                self.host_floor = host + overheads.policy_replay * (stop + graph.saved_needing_grad)
                self.device_time = kernels
            self.selective_time = max(self.device_time, self.host_floor)
            for i in graph.keepable:
                gain[i] = (kernel[i] if spared(i) else 0.0) - copy * graph.copied_bytes(i)
        else:
            self.checkpoint_time = machinery + sum(n.wall_time for n in nodes[:stop])
            per_op = 0.0 if fused else overheads.program_op  # the fused refill's time holds its host work
            if program:
                # Its forward follows its tape: holds and a watch on module calls a checkpoint's does not have.
                follow = overheads.follow(graph.saved_tensors, graph.watched_calls)
                self.selective_time = machinery + follow + fixed + sum(kernel[i] + per_op for i in rerun)
            else:
                # The replay also dispatches the detach of every rebuilt tensor that requires grad.
                self.selective_time = (self.checkpoint_time + policy_work(nodes, overheads.policy_forward)
                                       + policy_work(nodes[:stop], overheads.policy_replay)
                                       + overheads.policy_replay * graph.saved_needing_grad)
            self.host_floor = 0.0
            self.device_time = self.selective_time
            for i in graph.keepable:
                if program:
                    gain[i] = (kernel[i] + per_op if spared(i) else 0.0) - copy * graph.copied_bytes(i)
                else:
                    host = nodes[i].host_time + overheads.policy_replay
                    gain[i] = op_cost(host, nodes[i].kernel_time, overlapped) - host - copy * graph.copied_bytes(i)
        if fused:
            self.checkpoint_time = self.selective_time
        self.matmul_time = sum(n.kernel_time for n in nodes if n.op in _MATMUL_NAMES)
        self.gain = _tied(gain, {i: nodes[i].out_bytes for i in gain})

    def time(self, mode: str, kept: Iterable[int] = ()) -> float:
        """Extra seconds per step of running the block in ``mode`` (``keep``, ``checkpoint``, ``selective``)."""
        if mode == "keep":
            return 0.0
        if mode == "checkpoint":
            return self.checkpoint_time
        return self.selective(sum(self.gain[i] for i in kept))

    def selective(self, gain: float) -> float:
        """Extra seconds of a selective run whose kept outputs spare ``gain`` (a sum of :attr:`gain`): the
        device's work less what is spared, or the host's where that is longer."""
        return max(self.device_time - gain, self.host_floor)

    def matmul_nodes(self) -> tuple[int, ...]:
        """The keepable nodes ``save_matmuls`` keeps: the outputs of matmul-like ops."""
        return tuple(i for i in self.graph.keepable if self.graph.nodes[i].op in _MATMUL_NAMES)


def fused_shares(graph: BlockGraph) -> tuple[list[float], float]:
    """Per node of ``graph``, what its kernel time counts for in a fused rerun, and the refill's fixed cost
    (:mod:`.fusedtime`); all 1.0 and no fixed cost where the graph has no timed fused refill.

    Example:
        >>> factors, fixed = fused_shares(graph)   # factors: 1.0 for matmuls, attention and random ops
    """
    nodes, fused = graph.nodes, graph.fused
    if fused is None:
        return [1.0] * len(nodes), 0.0
    extern = [n.op in _MATMUL_NAMES or n.random for n in nodes]
    rerun = graph.program_rerun()
    outer = sum(nodes[i].kernel_time for i in rerun if extern[i])
    inner = sum(nodes[i].kernel_time for i in rerun if not extern[i])
    rest = max(fused.device_time - outer, 0.0)
    scale = min(rest / inner, 1.0) if inner > 0 else 1.0
    return [1.0 if extern[i] else scale for i in range(len(nodes))], rest - scale * inner


TIE = 0.25


def _tied(gain: dict[int, float], nbytes: dict[int, int]) -> dict[int, float]:
    """``gain`` with near-ties made exact: nodes of equal bytes whose gains lie within ``TIE`` of the next
    (a chain, in order of gain) share the chain's mean gain.

    Which of two same-sized outputs to keep is then decided by their order in the block, not by timing
    noise of a few percent between fresh processes; the plan gives up at most ``TIE`` of one op's gain.
    """
    by_bytes: dict[int, list[int]] = {}
    for i in sorted(gain, key=lambda i: (gain[i], i)):
        by_bytes.setdefault(nbytes[i], []).append(i)
    tied = dict(gain)
    for members in by_bytes.values():
        chain = [members[0]]
        for i in [*members[1:], None]:
            if i is not None and gain[i] - gain[chain[-1]] <= TIE * max(abs(gain[i]), abs(gain[chain[-1]])):
                chain.append(i)
                continue
            mean = sum(gain[j] for j in chain) / len(chain)
            tied.update((j, mean) for j in chain)
            if i is not None:
                chain = [i]
    return tied
