"""What rerunning a block costs in time, from its op graph: the one price model of the profile and the fronts.

A block's op graph (:mod:`remat.planning.measure.opgraph`) holds, per op, its device time (``kernel_time``), the
host time around it (``host_time``: Python, autograd, the dispatcher) and what it adds to a run
(``wall_time``, the two combined by :func:`remat.planning.measure.timing.op_cost`: summed on the CPU, the larger
of the two on an accelerator, whose host runs ahead).

On the CPU, host and device time add up:

=============  ================================================================================
mode           extra time per step
=============  ================================================================================
``checkpoint`` region + saved tensors × per_saved + wall time of the first ``stop`` ops
``selective``  checkpoint's + the policy's host work (forward and replay) − Σ gains
=============  ================================================================================

and keeping op ``i`` spares its kernel: the replay still dispatches it but serves the output.  A selective
region runs its forward under the recording mode on every call (each call decides what it keeps, see
:mod:`remat.policies.selective`), so the policy's host work per op is paid in forward and in the replay.

On an accelerator the host runs ahead of the device: while it dispatches a view or the region's machinery,
the device works through kernels queued before.  A rerun costs the larger of its kernels and its host work
(machinery included), not the sum of each op's larger share, which charged a Llama layer's 35 views as device
time (+22% on an H100).  A selective region adds host work only: its policy per op, in forward and in the
replay, and a detach per rebuilt tensor that requires grad.  Keeping op ``i`` spares its kernel:
``max(kernels − Σ gains, host)``.

On either device, a random in-place op kept by value gains its kernel less two copies of its bytes, forward's
and the replay's.

Near-ties between outputs of equal size are made exact (:data:`TIE`), so that which of them a plan keeps
does not follow timing noise from one process to the next.

``save_matmuls`` is the selective point that keeps every matmul-like output (:data:`MATMUL_OPS`) and every
collective's.

Bytes come from the same graph: :func:`recompute_peak` is what a recomputation holds above its start, and
:func:`forward_spared` how much lower than a plain forward a recomputing one peaks (autograd keeps nothing there
but a policy's kept outputs).

Example:
    >>> prices = BlockPrices(graph)
    >>> prices.time("checkpoint"), prices.time("selective", prices.matmul_nodes())
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from ...policies.rules import MATMUL_OPS, is_collective
from .opgraph import BlockGraph
from .timing import op_cost

__all__ = ["BlockPrices", "forward_spared", "matmuls", "recompute_peak", "sent_again", "wire_nodes"]

_MATMUL_NAMES = frozenset(str(op) for op in MATMUL_OPS)


def _saved_by_save_matmuls(op: str) -> bool:
    return op in _MATMUL_NAMES or is_collective(op)


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
        if overlapped:
            # The host runs ahead of the device: while it dispatches one op (a view, a tiny one) the device
            # works through kernels queued before, so the rerun costs its kernels, or its host work where
            # that is longer (machinery included), not the sum of each op's larger share.  A policy adds host
            # work only: the recording mode's per op in forward, the replay's per op and detaches.  Serving an
            # op spares its kernel.
            kernels = sum(n.kernel_time for n in nodes[:stop])
            host = sum(n.host_time for n in nodes[:stop]) + machinery
            self.checkpoint_time = max(kernels, host)
            self.device_time = kernels
            self.host_floor = host + overheads.policy_replay * (stop + graph.saved_needing_grad)
            # Forward's recording mode costs only where it makes the host fall behind the forward's kernels.
            forward_kernels, forward_host = sum(n.kernel_time for n in nodes), sum(n.host_time for n in nodes)
            self.forward_extra = (max(forward_kernels, forward_host + overheads.policy_forward * len(nodes))
                                  - max(forward_kernels, forward_host))
            self.selective_time = max(self.device_time, self.host_floor) + self.forward_extra
            for i in graph.keepable:
                gain[i] = nodes[i].kernel_time - copy * graph.copied_bytes(i)
        else:
            self.checkpoint_time = machinery + sum(n.wall_time for n in nodes[:stop])
            # The replay also dispatches the detach of every rebuilt tensor that requires grad.
            self.selective_time = (self.checkpoint_time + policy_work(nodes, overheads.policy_forward)
                                   + policy_work(nodes[:stop], overheads.policy_replay)
                                   + overheads.policy_replay * graph.saved_needing_grad)
            self.host_floor = 0.0
            self.forward_extra = 0.0  # in selective_time already: host and device add up here
            self.device_time = self.selective_time
            for i in graph.keepable:
                host = nodes[i].host_time + overheads.policy_replay
                gain[i] = op_cost(host, nodes[i].kernel_time, overlapped) - host - copy * graph.copied_bytes(i)
        self.matmul_time = sum(n.kernel_time for n in nodes if _saved_by_save_matmuls(n.op))
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
        return max(self.device_time - gain, self.host_floor) + self.forward_extra

    def matmul_nodes(self) -> tuple[int, ...]:
        """The keepable nodes ``save_matmuls`` keeps: the outputs of matmul-like ops and collectives."""
        return tuple(i for i in self.graph.keepable if _saved_by_save_matmuls(self.graph.nodes[i].op))


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


def recompute_peak(graph: BlockGraph, served: set[int] = frozenset()) -> int:
    """Most bytes a recomputation of ``graph``'s block holds at once above what it starts with, when the
    ``served`` nodes' outputs are handed to it instead of rerun: saved tensors stay with the refill until
    backward unpacks them, the others die as in forward, the served ones too (they are there from its start,
    kept since the forward, and are gone once their last reader has run).  A random in-place op's kept copy
    (``graph.copied_bytes``) is there from the start too, but only until its op is served: its value is copied
    into the tensor the rerun made, and the kept record is let go of.

    Example:
        >>> recompute_peak(graph) >= recompute_peak(graph, {graph.keepable[0]})
        True
    """
    stop = graph.stop
    delta = [0] * (stop + 1)
    given = 0
    for s in graph.storages:
        if s.producer >= stop:
            continue
        start = 0 if s.producer in served else s.producer
        given += s.nbytes if s.producer in served else 0
        delta[start] += s.nbytes
        delta[stop if s.saved or s.dies is None else min(s.dies, stop)] -= s.nbytes
    for index in served:
        copied = graph.copied_bytes(index) if index < stop else 0
        given += copied
        delta[0] += copied
        delta[index + 1] -= copied
    return max(0, _running_peak(delta[:stop]) - given)


def forward_spared(graph: BlockGraph, kept: Collection[int] = frozenset()) -> int:
    """Bytes a recomputing forward of ``graph``'s block holds less at its peak than a plain forward: autograd
    keeps nothing there, so each storage dies when the block's code is done with it (``StorageLife.dies``), but
    a policy holds the outputs of the ``kept`` nodes until backward, whether autograd would save them or not
    (a random in-place op's as a copy): negative where that holds more (a matmul output the next op does not
    save, kept beside that op's output).

    Example:
        >>> forward_spared(graph) >= forward_spared(graph, {graph.keepable[0]})
        True
    """
    size = len(graph.nodes)
    plain, recomputing = [0] * (size + 1), [0] * (size + 1)
    for s in graph.storages:
        plain[s.producer] += s.nbytes
        recomputing[s.producer] += s.nbytes
        plain[size if s.saved or s.dies is None else s.dies] -= s.nbytes
        recomputing[size if s.dies is None or s.producer in kept else s.dies] -= s.nbytes
    for index in kept:
        recomputing[index] += graph.copied_bytes(index)
    return _running_peak(plain[:size]) - _running_peak(recomputing[:size])


def matmuls(graph: BlockGraph) -> set[int]:
    """The nodes whose outputs the ``save_matmuls`` rule keeps in forward: every matmul-like op's and collective's.

    Example:
        >>> forward_spared(graph, matmuls(graph)) <= forward_spared(graph)
        True
    """
    return {node.index for node in graph.nodes if _saved_by_save_matmuls(node.op)}


def _running_peak(delta: list[int]) -> int:
    running = peak = 0
    for change in delta:
        running += change
        peak = max(peak, running)
    return peak


def sent_again(graph: BlockGraph, whole: bool = False) -> tuple[int, ...]:
    """The nodes of ``graph`` that send a collective (their waits left out) a recomputation of the block runs
    again: those before its last saved tensor, or with ``whole`` all of them (a block inside a region reruns its
    every op for the next).  A policy that keeps their outputs (``save_matmuls``,
    ``remat.policies.save_collectives``) sends none of them again.

    Example:
        >>> [graph.nodes[i].op for i in sent_again(prof.ops.blocks["blocks.0"])]  # RowwiseParallel down projection
        ['_c10d_functional.all_reduce.default']
    """
    nodes = graph.nodes if whole else graph.nodes[:graph.stop]
    return tuple(node.index for node in nodes
                 if is_collective(node.op) and not node.op.startswith("_c10d_functional.wait_tensor"))


def wire_nodes(graph: BlockGraph) -> tuple[int, ...]:
    """The keepable nodes whose outputs crossed the wire (collectives and their waits): what
    ``remat.policies.save_collectives`` keeps.

    Example:
        >>> set(sent_again(graph)) <= set(wire_nodes(graph))
        True
    """
    return tuple(i for i in graph.keepable if is_collective(graph.nodes[i].op))
