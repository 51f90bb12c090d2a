"""The segment constraints of a step profile, arranged for the chain DP: what each stretch of the step holds, as a
function of the bytes the blocks before it free and the shared storages they still hold.

The solver (:mod:`remat.planning.solve.solver`) reads a plan's peak from it; a plan that moves kept blocks' tensors
adds the bytes its copies hold at each stretch (:mod:`remat.planning.solve.copyplan`).

Example:
    >>> accounting = Accounting(prof)
    >>> accounting.freed_by(0, checkpoint_option)
"""

from __future__ import annotations

from ..choices.chain import passed_on
from ..choices.options import BlockOption
from ..measure.profile import StepProfile

__all__ = ["Accounting"]


class Accounting:
    """The segment constraints of a profile, arranged for the chain DP.

    Shared storage ``s`` is bit ``s`` of a mask: set when a block already decided holds it (a kept block
    that saves it, a recomputing block that takes it).  Each check is ``base - freed + shared(mask)`` where
    ``shared`` is a constant plus the bytes of the varying storages whose bit is set.
    """

    def __init__(self, prof: StepProfile) -> None:
        n = len(prof.rows)
        self.n = n
        self.own = [row.own_bytes for row in prof.rows]
        # a recomputing block's inputs that it does not save: dead in its backward without a plan, held with one
        self.unsaved = [row.unsaved_held_bytes for row in prof.rows]
        self.shared = prof.shared
        self._inner: dict[tuple[int, int], tuple[int, int]] = {}
        self._peaks: dict[tuple[int, int, int], int] = {}  # option_peak by (block, id(option), mask)
        self._runs: dict[tuple[int, int, int], tuple[list[int], int, int]] = {}  # see _run_peaks
        holders = [s.holders for s in prof.shared]
        self.saves = [sum(1 << k for k, s in enumerate(prof.shared) if j in s.saved_by) for j in range(n)]
        self.takes = [sum(1 << k for k, s in enumerate(prof.shared) if j in s.input_of) for j in range(n)]
        self.matmuls = [sum(1 << k for k, s in enumerate(prof.shared) if j in s.kept_by) for j in range(n)]
        self.served = [sum(1 << k for k, s in enumerate(prof.shared) if j in s.served_to) for j in range(n)]
        self.spared = [row.forward_spared for row in prof.rows]  # a recomputing forward's, as a segment runs it
        released = [passed_on(prof, s) for s in prof.shared]
        # checks[p]: (base, const, varying) for the segments evaluated with the decisions of blocks < p; the
        # forward of block p itself is forward[p], which its option lowers (a recomputing forward saves less)
        self.checks: list[list[tuple[int, int, list[tuple[int, int]]]]] = [[] for _ in range(n + 1)]
        self.in_backward: list[list[bool]] = [[] for _ in range(n + 1)]  # per check: a stretch of backward
        self.labels: list[list[str]] = [[] for _ in range(n + 1)]  # per check: its stretch, as the profile names it
        self.moments: list[list[int]] = [[] for _ in range(n + 1)]  # per check: its segment in the profile
        self.forward_at, self.backward_at = [0] * n, [0] * n  # the segments of forward[p] and backward[q]
        self.forward: list[tuple[int, int, list[tuple[int, int]]]] = [(0, 0, [])] * n
        self.backward: list[tuple[int, int, list[tuple[int, int]]]] = [(0, 0, [])] * n  # B_q's peak
        self.restart: list[tuple[int, int, list[tuple[int, int]]]] = [(0, 0, [])] * n  # B_q's start
        last_use = [-1] * len(prof.shared)
        previous = None
        for t, seg in enumerate(prof.segments):
            q = seg.block
            bound = seg.prefix + (1 if q is not None else 0)  # holders that count: blocks < bound
            const, varying = 0, []
            for k, s in enumerate(prof.shared):
                if not any(j < bound for j in holders[k]):
                    continue
                # alive at the stretch's peak without a plan, though gone by its end (None: not recorded)
                at_peak = s.at_peak[t] if s.at_peak else s.alive[t]
                if not seg.backward:  # forward: a plan can only lengthen a life (callers hold the rest) ...
                    if s.alive[t] or at_peak:  # ... but an nn.Sequential let go of what it passed on
                        if released[k] > seg.prefix:
                            continue
                        const -= s.nbytes
                    varying.append((1 << k, s.nbytes))
                    continue
                in_base = any(j < bound for j in s.saved_by)
                if (s.alive[t] or s.outside and at_peak) and (s.outside or not in_base):
                    continue  # alive whatever the plan (code outside the blocks holds it at the stretch's peak)
                const -= s.nbytes if in_base else 0
                varying.append((1 << k, s.nbytes))
            for bit, _ in varying:
                last_use[bit.bit_length() - 1] = max(last_use[bit.bit_length() - 1], seg.prefix)
            if q is None and seg.label == f"forward {seg.prefix}":
                self.forward[seg.prefix] = (seg.peak, const, varying)
                self.forward_at[seg.prefix] = t
            elif q is None:
                self.checks[seg.prefix].append((seg.peak, const, varying))
                self.in_backward[seg.prefix].append(seg.backward)
                self.labels[seg.prefix].append(seg.label)
                self.moments[seg.prefix].append(t)
            else:
                self.backward[q] = (seg.peak, const, varying)
                self.backward_at[q] = t
                self.restart[q] = (seg.start, *self._start_terms(prof, previous, q, holders))
                for bit, _ in self.restart[q][2]:
                    last_use[bit.bit_length() - 1] = max(last_use[bit.bit_length() - 1], q)
            previous = t
        # after deciding block p, bits no later check reads are dropped so equal futures merge
        self.keep_bits = [sum(1 << k for k, last in enumerate(last_use) if last > p) for p in range(n)]

    def _start_terms(self, prof: StepProfile, previous: int | None, q: int, holders: list[set[int]]
                     ) -> tuple[int, list[tuple[int, int]]]:
        """Shared terms at the start of block q's backward: alive as at the end of the segment before it."""
        const, varying = 0, []
        for k, s in enumerate(prof.shared):
            if not any(j <= q for j in holders[k]):
                continue
            in_base = any(j <= q for j in s.saved_by)
            alive = s.alive[previous] if previous is not None else False
            if alive and (s.outside or not in_base):
                continue
            const -= s.nbytes if in_base else 0
            varying.append((1 << k, s.nbytes))
        return const, varying

    @staticmethod
    def value(check: tuple[int, int, list[tuple[int, int]]], freed: int, mask: int) -> int:
        base, const, varying = check
        return base - freed + const + sum(nbytes for bit, nbytes in varying if mask & bit)

    def freed_by(self, p: int, option: BlockOption) -> int:
        """Bytes the blocks ``option`` decides (from block p) free for every later stretch: their own, and a
        segment's inner shared storages (:meth:`inner`)."""
        inner = self.inner(p, p + option.span - 1)[1] if option.span > 1 else 0
        return sum(self.own[p:p + option.span]) - option.kept + inner

    def holds(self, q: int, option: BlockOption) -> int:
        """The shared storages block q holds after its forward under ``option``; for a segment, with the bits of
        its inner storages set, whose bytes :meth:`freed_by` counts freed instead."""
        if option.span > 1:
            return self.takes[q] | self.inner(q, q + option.span - 1)[0]
        if option.name == "save_matmuls":  # its inputs, and the matmul outputs it keeps that others hold too
            return self.takes[q] | self.matmuls[q]
        return self.takes[q] if option.recomputes else self.saves[q]

    def inner(self, first: int, last: int) -> tuple[int, int]:
        """The shared storages that live and die inside a segment ``first..last`` (bits, bytes).

        Made inside the region and held only by its blocks (saved by one at least, not its input, not its
        output, nothing outside the blocks saving it), such a storage is gone once the region's forward ends.
        In a forward stretch a shared storage is otherwise counted wherever the step without a plan had it
        alive (its caller may hold it); here nothing but the ``nn.Sequential``'s own loop ran.  Its bit is set
        and its bytes counted freed: the backward stretches, which count a storage whose bit is set, then net
        it out, and the forward stretches, which count it where it was alive, lose it.
        """
        key = (first, last)
        if key not in self._inner:
            bits = nbytes = 0
            for k, s in enumerate(self.shared):
                holders = s.holders
                if (s.saved_by and not s.outside and min(holders) >= first and max(holders) <= last
                        and first not in s.input_of and last not in s.output_of):
                    bits |= 1 << k
                    nbytes += s.nbytes
            self._inner[key] = (bits, nbytes)
        return self._inner[key]

    def option_peak(self, p: int, option: BlockOption, mask: int) -> int:
        """The highest live bytes of the stretches ``option`` of block p decides, with nothing freed before
        block p (each is lower by what is): block p's backward, and for a segment every stretch inside it."""
        key = (p, id(option), mask)
        if key not in self._peaks:  # asked again for every state's mask and every budget of a bisection
            self._peaks[key] = (max(self.own_peak(p, option, self.own[p], 0, mask),
                                    self.value(self.forward[p], option.spared, mask))
                                if option.span == 1 else self._segment_peak(p, option, mask))
        return self._peaks[key]

    def _segment_peak(self, p: int, option: BlockOption, mask: int) -> int:
        last = p + option.span - 1
        held = mask | self.takes[p]
        inner = sum(self.own[p:last + 1]) - option.kept  # own bytes the run frees, its inputs aside
        start = self.value(self.restart[last], inner, held)
        return max(self._run_peaks(p, option.kept, mask, option.span)[option.span - 1], start + option.transient)

    def _run_peaks(self, p: int, kept: int, mask: int, length: int) -> list[int]:
        """Per run length from block p (1, 2, ... at least ``length``): the highest of the run's inner forward
        stretches and of its blocks' backwards, for a region keeping ``kept`` bytes.  Every segment from p
        extends one pass, so a longer one costs only the blocks it adds."""
        key = (p, kept, mask)
        peaks, inner, saved = self._runs.get(key, ([], 0, 0))
        if len(peaks) >= length:
            return peaks
        held = mask | self.takes[p]
        unsaved_inputs = self.unsaved[p]  # the region keeps them through the run's backward
        peak = peaks[-1] if peaks else -(2**62)
        for q in range(p + len(peaks), p + length):
            if q > p:
                for check in self.checks[q]:  # inside the run's forward: the blocks before q hold only its inputs
                    peak = max(peak, self.value(check, inner, held))
            peak = max(peak, self.value(self.forward[q], inner + self.spared[q], held if q > p else mask))
            saved |= self.saves[q]
            peak = max(peak, self.value(self.backward[q], -unsaved_inputs, held | saved))
            inner += self.own[q] - (kept if q == p else 0)
            peaks.append(peak)
        self._runs[key] = (peaks, inner, saved)
        return peaks

    def own_peak(self, q: int, option: BlockOption, own_bytes: int, freed: int, mask: int) -> int:
        """The peak of block q's backward under ``option`` (its recomputation included)."""
        held_inputs = (self.unsaved[q] if option.recomputes else 0) + option.backward_held
        held, started = self.holds(q, option), self.takes[q]
        if option.name == "save_matmuls":  # its kept matmul outputs the recomputation does not rerun to are
            held, started = self.takes[q] | self.served[q], started | self.matmuls[q]  # gone when it starts
        peak = self.value(self.backward[q], freed - held_inputs, mask | self.saves[q] | held)
        if option.recomputes:
            start = self.value(self.restart[q], freed, mask | started)
            peak = max(peak, start - (own_bytes - option.kept) + option.transient)
        return peak

    def stretches(self, p: int, option: BlockOption, mask: int) -> list[tuple[int, int, bool]]:
        """The stretches :meth:`option_peak` takes the highest of, each as (live bytes, its segment in the profile,
        whether at that segment's start: a recomputation's transient, which rises from there).  Asked once, of
        the plan a refusal names, to say what its peak is made of; :meth:`option_peak` is the cached maximum."""
        if option.span > 1:
            return self._segment_stretches(p, option, mask)
        held_inputs = (self.unsaved[p] if option.recomputes else 0) + option.backward_held
        held, started = self.holds(p, option), self.takes[p]
        if option.name == "save_matmuls":
            held, started = self.takes[p] | self.served[p], started | self.matmuls[p]
        found = [(self.value(self.forward[p], option.spared, mask), self.forward_at[p], False),
                 (self.value(self.backward[p], -held_inputs, mask | self.saves[p] | held), self.backward_at[p], False)]
        if option.recomputes:
            start = self.value(self.restart[p], 0, mask | started)
            found.append((start - (self.own[p] - option.kept) + option.transient, self.backward_at[p], True))
        return found

    def _segment_stretches(self, p: int, option: BlockOption, mask: int) -> list[tuple[int, int, bool]]:
        """:meth:`stretches` of a segment: :meth:`_segment_peak`'s and :meth:`_run_peaks`' stretches, uncached."""
        last, held = p + option.span - 1, mask | self.takes[p]
        found, inner, saved = [], 0, 0
        for q in range(p, last + 1):
            if q > p:
                found.extend((self.value(check, inner, held), t, False)
                             for check, t in zip(self.checks[q], self.moments[q]))
            found.append((self.value(self.forward[q], inner + self.spared[q], held if q > p else mask),
                          self.forward_at[q], False))
            saved |= self.saves[q]
            found.append((self.value(self.backward[q], -self.unsaved[p], held | saved), self.backward_at[q], False))
            inner += self.own[q] - (option.kept if q == p else 0)
        start = self.value(self.restart[last], sum(self.own[p:last + 1]) - option.kept, held)
        found.append((start + option.transient, self.backward_at[last], True))
        return found
