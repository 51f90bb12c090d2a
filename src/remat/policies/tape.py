"""Tapes: selective checkpointing without a dispatch mode in forward, for regions run before.

A selective policy decides per op output, so remat's first forward of a region runs under a dispatch mode
that sees every op (:mod:`.selective`).  That costs a trip through Python per op, which a GPU waits for.
While that first forward runs, a :class:`_Learner` also writes down, per tensor autograd saves (in the order
of the engine's pack hook), where its storage came from: an op output the policy keeps, one it recomputes,
or a tensor made outside the region (parameters, inputs).  It writes down too which module outputs carry
kept outputs that autograd never saves (a projection's output that only feeds a residual sum).  That list is
the region's *tape*.

The next call of the same region with inputs alike (same function, tensor shapes, dtypes, devices, strides
and ``requires_grad``, equal plain arguments, same autocast) runs with no dispatch mode at all: a
:class:`_Follower` answers the engine's pack hook from the tape.  A saved tensor whose storage the policy
keeps, or that comes from outside, is *held* in its placeholder (autograd gets it back without
recomputation); the rest is dropped, and recomputed in backward by the usual replay, which is served the
kept outputs the follower captured, by op and call index.  A policy that keeps every op output therefore
never reruns the region, and one that keeps a region's matmuls reruns it with its matmuls served.  An output
the policy offloads is never held: the follower starts its copy to host memory when it captures it, and the
replay is served the copy, as after a recorded forward.

Holding a saved tensor is what plain autograd does, so a tape can cost memory or recomputation but never
correctness, with one condition: a served output must be the output of the op call the tape names.  The
follower checks each saved tensor's shape, dtype and version against the tape, and their count at the end;
on any difference it holds nothing more and serves nothing, and backward recomputes the region whole.  A
region whose op sequence changes between calls with inputs alike in every checked way (a branch on a value
or a global, choosing between ops of the same shapes) is the one case this cannot see: run such a region
with ``tapes(False)``.

Tapes are used for :class:`~remat.policies.Policy` objects (op and call rules: pure functions of the op and
its call index) without name rules.  A region keeps the dispatch mode on every call where its policy keeps an
in-place random draw (dropout's mask on CPU, kept by value), or where a kept output that no saved
tensor and no module output reaches is one the replay needs (following the tape, the replay would rerun an op
the recording serves): one that a dropped saved tensor depends on, per the region's program
(:mod:`.program`), or, for a region without one, any before the replay's end.  Any other is never read in
backward: following the tape, it is not held (a policy keeping every output keeps what autograd saves).
The planner never keeps such outputs (:attr:`~remat.planning.opgraph.BlockGraph.keepable`), so the policies of
a plan always follow their tapes.

Example:
    >>> y = remat.checkpoint(block, x, policy=remat.policies.save_matmuls)  # records, learns the tape
    >>> y = remat.checkpoint(block, x, policy=remat.policies.save_matmuls)  # follows it: no dispatch mode
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..engine.nonreentrant import detached
from .decisions import _RANDOM_WRITE, _VIEW_OR_INPLACE, _traits
from .kept import _Draw, _keep, _Kept, _KeptOutputs, _settle
from .program import _calls_needed, _Program, _ProgramWriter, _tracked, state_matches

__all__ = ["tapes"]

_EXTERNAL = "external"  # a saved tensor made outside the region: held, never served
_TENSOR = "tensor"  # in a kept call's outputs: a tensor leaf (the others are kept as they are)
# Tapes kept per policy (regions × input signatures): a plan shares one policy among all its blocks of a
# kind, and a book smaller than the model's layers would evict each tape before its next use.
_BOOK_SIZE = 4096
_PLAIN_ARGUMENTS = (bool, int, float, str, torch.dtype, torch.device)
_enabled = [True, True]  # tapes, programs


@contextlib.contextmanager
def tapes(enabled: bool, *, programs: bool = True) -> Iterator[None]:
    """Turn tapes on or off for the selective regions run inside (on by default).

    Off, every forward of a selective region runs under the recording dispatch mode, as the first does.
    ``programs=False`` keeps tapes for forward but reruns the region's Python code in backward instead of
    its program (:mod:`remat.policies.program`): for a region whose ops take a Python number that changes
    between calls.  Both are decided when a region's forward runs.

    Example:
        >>> with remat.policies.tapes(False):
        ...     y = remat.checkpoint(block, x, policy=remat.policies.save_matmuls)
        >>> with remat.policies.tapes(True, programs=False):
        ...     y = remat.checkpoint(block, x, policy=remat.policies.save_matmuls)
    """
    before = list(_enabled)
    _enabled[:] = [enabled, programs]
    try:
        yield
    finally:
        _enabled[:] = before


@dataclass(frozen=True)
class _Source:
    """A kept op output a saved tensor or module output shares storage with, and how to rebuild it."""

    op: Any
    call: int
    leaf: int  # position among the op's flattened outputs
    exact: bool  # the tensor is the output itself, not another view of its storage
    geometry: tuple[tuple[int, ...], tuple[int, ...], int]  # the output's size, stride, storage offset
    offloaded: bool = False  # kept in host memory: captured by copying it out, and never held on the device


@dataclass(frozen=True)
class _Empty:
    """A kept output with no bytes (an op's unused output): nothing can capture it, nor needs to."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def make(self) -> torch.Tensor:
        return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device)


@dataclass
class _Tape:
    """What the recorded forward of one region showed (see the module docstring)."""

    packs: list[tuple[torch.Size, torch.dtype, int, Any]]  # shape, dtype, version, source (None: drop)
    modules: dict[int, list[tuple[int, _Source]]]  # module call -> (output leaf, kept output it carries)
    slots: list[tuple[Any, int, int]]  # every op the region ran: op, action, calls
    outputs: dict[tuple[int, int], tuple[Any, list[Any], bool]]  # kept call -> outputs' spec, leaves, offloaded
    program: _Program | None = None  # the recomputation, run straight from the ops (see .program)
    no_program: str | None = None  # why there is none
    offloads: bool = field(init=False)  # whether the replay is served outputs kept in host memory

    def __post_init__(self) -> None:
        self.offloads = any(offloaded for _, _, offloaded in self.outputs.values())


@dataclass
class _Book:
    """The tapes of one policy, by region key, each with a weak reference to the function the key names by
    address (so a later function at the same address is not taken for it); None marks a region that cannot
    have a tape."""

    tapes: dict[Any, tuple[weakref.ref, _Tape | None]] = field(default_factory=dict)

    def lookup(self, key: Any, anchor: Any) -> _Tape | None | type:
        """The tape filed under ``key`` for ``anchor``; ``_Learner`` where none is filed yet."""
        entry = self.tapes.get(key)
        if entry is None or entry[0]() is not anchor:
            return _Learner
        return entry[1]


_books: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _book_for(policy: Any) -> _Book | None:
    if not _enabled[0]:
        return None
    book = _books.get(policy)
    if book is None:
        book = _books[policy] = _Book()
    return book


def _region_key(fn: Callable, leaves: list[Any], tensors: list[torch.Tensor], state: Any) -> tuple[Any, Any]:
    """What must be equal for two calls of a region to share a tape, and the object it names by address
    (the module or function that runs); ``(None, None)`` where it cannot be told."""
    while hasattr(fn, "__wrapped__"):  # a module wrapper made afresh per call names the module it runs
        fn = fn.__wrapped__
    anchor = getattr(fn, "__self__", fn)
    if not all(map(tapeable_argument, leaves)):
        return None, None  # an object the region may read state from: no tape
    plain = list(leaves)
    try:
        weakref.ref(anchor)
    except TypeError:
        return None, None
    shapes = tuple((t.shape, t.dtype, t.device, t.stride(), t.requires_grad) for t in tensors)
    function = getattr(fn, "__func__", None)
    return (id(anchor), id(function), tuple(plain), shapes, state.cpu_autocast, state.device_autocast), anchor


def tapeable_argument(leaf: Any) -> bool:
    """Whether a region taking ``leaf`` (a non-tensor argument) can have a tape: a plain value is part of the
    region's key; an object could hold state the region reads."""
    return leaf is None or isinstance(leaf, _PLAIN_ARGUMENTS)


def _geometry(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    return tuple(t.shape), t.stride(), t.storage_offset()


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return t.device.type, t.untyped_storage().data_ptr()


class _Learner:
    """Holds, while the recording forward runs, the saved tensors the policy keeps (or that come from
    outside), and writes the region's tape into ``book`` (None there: a region that cannot have one)."""

    def __init__(self, store: Any, book: _Book, key: Any, anchor: Any, inputs: list[torch.Tensor]) -> None:
        self.store, self.book, self.key, self.anchor = store, book, key, anchor
        self.program: _ProgramWriter | None = _ProgramWriter(inputs)
        self.modules: list[Any] = []  # modules the forward called, as their forwards return
        # storage -> (its bytes, slot and call of the op that allocated it, output leaf, output geometry)
        self.made: dict[tuple[str, int], tuple[int, Any, int, int, Any]] = {}
        self.drawn: set[tuple[str, int]] = set()
        # op call -> its position in the forward; the replay reruns every op before the last dropped pack
        self.position: dict[tuple[int, int], int] = {}
        self.ops_run = 0
        self.replay_end = 0
        self.packs: list[tuple[torch.Size, torch.dtype, int, Any]] = []
        self.module_outputs: list[list[tuple[int, _Source]]] = []
        self.hook: Any = None
        self.reads: Any = None

    def enter(self) -> None:
        self.hook = register_module_forward_hook(self._module_output)
        self.reads = self.program.watching()
        self.reads.__enter__()

    def exit(self, failed: bool) -> None:
        self.hook.remove()
        self.reads.__exit__(None, None, None)
        if not failed:
            self._write()
        # Autograd keeps the forward's pack hook, and with it this learner, as long as the graph lives.
        self.made, self.packs, self.module_outputs, self.position = {}, [], [], {}
        self.modules, self.program = [], None

    def before_draw(self, op: Any, args: tuple, kwargs: dict) -> None:
        """A random op is about to run under the recording mode."""
        self.program.before_draw(op, args, kwargs)

    def ignored(self, op: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """An op no policy decides ran (a ``detach``): the program runs it all the same."""
        self.program.step(op, args, kwargs, out, None)

    def output(self, out: Any, slot: Any, call: int, args: tuple, kwargs: dict) -> None:
        """An op ran under the recording mode: write it into the program, remember which storages it allocated.

        An allocating op's storage is new, so an address seen before was freed and is taken over.  Python
        wrappers of intermediate tensors die while autograd still holds them, so liveness is not asked.
        """
        self.program.step(slot.op, args, kwargs, out, call)
        self.ops_run += 1
        traits = _traits(slot.op)
        if traits & _RANDOM_WRITE and isinstance(out, torch.Tensor) and _tracked(out):
            # What an in-place draw wrote is kept as a private copy, if at all: holding the saved tensor too
            # would keep it twice.
            self.drawn.add(_storage_key(out))
        if traits & _VIEW_OR_INPLACE:
            return  # its outputs alias its inputs (a parameter's transpose is the parameter's storage)
        inputs = {_storage_key(a) for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor) and _tracked(a)}
        self.position[(id(slot.op), call)] = self.ops_run
        leaves = (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]
        for leaf, t in enumerate(leaves):
            if isinstance(t, torch.Tensor) and _tracked(t):
                storage = t.untyped_storage()
                key = (t.device.type, storage.data_ptr())
                if storage.nbytes() and key not in inputs:  # _unsafe_view returns its input's storage unannotated
                    self.made[key] = (storage.nbytes(), slot, call, leaf, _geometry(t))
                    # A dropped mask's memory is freed after forward reads it: new memory there holds no draw.
                    self.drawn.discard(key)

    def _source(self, t: torch.Tensor) -> Any:
        if not _tracked(t):
            return None  # no storage to tell apart: rebuilt by the replay
        key = _storage_key(t)
        if key in self.drawn:
            return None
        seen = self.made.get(key)
        if seen is None or seen[0] != t.untyped_storage().nbytes():
            return _EXTERNAL
        _, slot, call, leaf, geometry = seen
        kept = slot.kept.get(call)
        if kept is None or (isinstance(kept, _Draw) and kept.target is not None):
            return None  # recomputed, or kept as a private copy (an in-place draw): the storage is not kept
        offloaded = any(k.offloaded for k in kept.tensors())
        return _Source(slot.op, call, leaf, _geometry(t) == geometry, geometry, offloaded)

    def hold(self, index: int, t: torch.Tensor) -> torch.Tensor | None:
        """The engine's pack hook saw ``t``: the tensor its placeholder holds, or None (see ``run_nonreentrant``)."""
        source = self._source(t)
        self.program.pack(t)
        self.packs.append((t.shape, t.dtype, t._version, source))
        if source is not None and not (isinstance(source, _Source) and source.offloaded):
            return detached(t)
        # Rebuilt by the replay (an offloaded output is served to it from host memory, as recorded).
        # The pack may come before or after its op's output is seen.
        self.replay_end = self.ops_run + 1
        return None

    def _module_output(self, module: Any, args: Any, output: Any) -> None:
        self.modules.append(module)
        found = []
        leaves = (output,) if isinstance(output, torch.Tensor) else tree_flatten(output)[0]
        for leaf, t in enumerate(leaves):
            if isinstance(t, torch.Tensor):
                source = self._source(t)
                if isinstance(source, _Source):
                    found.append((leaf, source))
        self.module_outputs.append(found)

    def _write(self) -> None:
        """Forward ended (the policy's kept outputs are final): file the tape, or None if it cannot be used."""
        store = self.store
        kept_calls = {(id(slot.op), call): kept for slot in store.slots.values() for call, kept in slot.kept.items()}
        packs = [(shape, dtype, version, self._still_kept(source, kept_calls))
                 for shape, dtype, version, source in self.packs]
        reached = {(id(s.op), s.call, s.leaf) for *_, s in packs if isinstance(s, _Source)}
        modules: dict[int, list[tuple[int, _Source]]] = {}
        for number, found in enumerate(self.module_outputs):
            wanted = [(leaf, s) for leaf, s in found
                      if (id(s.op), s.call) in kept_calls and (id(s.op), s.call, s.leaf) not in reached]
            if wanted:
                modules[number] = wanted
                reached.update((id(s.op), s.call, s.leaf) for _, s in wanted)
        outputs = {}
        uncaptured = []
        for slot in store.slots.values():
            for call, kept in slot.kept.items():
                if isinstance(kept, _Draw):
                    if kept.target is not None:
                        return self._refuse()  # an in-place draw is kept by value, not by its storage
                    kept = kept.kept
                leaves, spec = tree_flatten(kept.structure if isinstance(kept, _KeptOutputs) else kept)
                placed = [self._placed((id(slot.op), call, leaf), item, reached) for leaf, item in enumerate(leaves)]
                if any(item is None for item in placed):
                    # Neither saved nor a module's output: the follower cannot capture it.
                    if self.position.get((id(slot.op), call), 0) < self.replay_end:
                        uncaptured.append((id(slot.op), call))
                    continue
                offloaded = any(k.offloaded for k in kept.tensors())
                outputs[(id(slot.op), call)] = (spec, placed, offloaded)
        program = self.program.finish(self.modules, outputs)
        programs = _enabled[1] and program is not None
        if uncaptured and (not programs or set(uncaptured) & _calls_needed(program, self._dropped(packs))):
            # The replay would run an op the recording serves (time, and bytes the plan counts, would differ).
            # The Python rerun may, where it runs before the replay's end; a program only where a dropped saved
            # tensor needs it.
            return self._refuse()
        slots = [(slot.op, slot.action, slot.calls) for slot in store.slots.values()]
        self._file(_Tape(packs, modules, slots, outputs, program, self.program.refused))

    @staticmethod
    def _dropped(packs: list[tuple[torch.Size, torch.dtype, int, Any]]) -> list[int]:
        """The saved tensors a follower does not hold (refilled by the replay)."""
        return [i for i, (*_, source) in enumerate(packs)
                if source is None or isinstance(source, _Source) and source.offloaded]

    @staticmethod
    def _placed(where: tuple[int, int, int], item: Any, reached: set) -> Any:
        """What the tape files for one leaf of a kept call's outputs: ``_TENSOR`` (captured when followed), an
        :class:`_Empty` to make afresh, the leaf itself (not a tensor), or None (a tensor it cannot capture)."""
        if not isinstance(item, _Kept):
            return item
        if where in reached:
            return _TENSOR
        if item.nbytes == 0 and item.value is not None:
            value = item.value
            return _Empty(tuple(value.shape), value.stride(), value.dtype, value.device)
        return None

    @staticmethod
    def _still_kept(source: Any, kept_calls: dict) -> Any:
        if isinstance(source, _Source) and (id(source.op), source.call) not in kept_calls:
            return None  # the region changed it in place, so the policy recomputes it after all
        return source

    def _refuse(self) -> None:
        self._file(None)

    def _file(self, tape: _Tape | None) -> None:
        tapes = self.book.tapes
        if len(tapes) >= _BOOK_SIZE:
            tapes.pop(next(iter(tapes)))
        tapes[self.key] = (weakref.ref(self.anchor), tape)


class _Follower:
    """Answers the pack hook from a tape, with no dispatch mode; captures the kept outputs for the replay."""

    def __init__(self, tape: _Tape) -> None:
        self.tape = tape
        self.captured: dict[tuple[int, int], dict[int, tuple[torch.Tensor, int]]] = {}
        # Captured outputs held on the device, filed into ``captured`` only if a replay is served them: most
        # regions that keep outputs never run one.  (source, the saved tensor detached, its version)
        self.unfiled: list[tuple[_Source, torch.Tensor, int]] = []
        self.seen = 0
        self.module_calls = 0
        self.diverged = False
        # Programs are on, and every module called held the parameters and buffers the program reads.
        self.program_ok = _enabled[1]
        self.hook: Any = None

    def enter(self) -> None:
        program = self.tape.program
        if self.tape.modules or (self.program_ok and program is not None and program.checks):
            self.hook = register_module_forward_hook(self._module_output)

    def exit(self) -> None:
        if self.hook is not None:
            self.hook.remove()
        if self.seen != len(self.tape.packs):
            self.diverged = True
        self._settle_offloaded()

    def _settle_offloaded(self) -> None:
        """Forward ended: as the recording mode does, a call whose offloaded output the region changed in
        place while it was being copied is recomputed instead, and the device waits for the other copies."""
        if not self.captured:  # what it holds there is offloaded (the rest waits in ``unfiled``)
            return
        stashed = []
        for key, leaves in list(self.captured.items()):
            kept = [value for value, _ in leaves.values() if isinstance(value, _Kept)]
            if not kept:
                continue
            if any(k.modified() for k in kept):
                del self.captured[key]
                continue
            stashed.extend(k for k in kept if k.stashed is not None)
        if stashed:
            _settle(stashed)

    @property
    def offloads(self) -> bool:
        """Whether the replay is served outputs kept in host memory."""
        return self.tape.offloads

    def hold(self, index: int, t: torch.Tensor) -> torch.Tensor | None:
        """The engine's pack hook saw ``t``: the tensor its placeholder holds, or None (see ``run_nonreentrant``)."""
        packs = self.tape.packs
        self.seen = index + 1
        if self.diverged or index >= len(packs):
            self.diverged = True
            return None
        shape, dtype, version, source = packs[index]
        if t.shape != shape or t.dtype != dtype or t._version != version:
            self.diverged = True
            return None
        if source is None:
            return None
        if source is not _EXTERNAL:
            return self._capture(t, source, version)
        if self.program_ok:
            program = self.tape.program
            state = program.saved_state.get(index) if program is not None else None
            if state is not None and t is not program.state[state]():
                self.program_ok = False  # the program would read the tensor the recorded forward saved here
        return detached(t)

    def _module_output(self, module: Any, args: Any, output: Any) -> None:
        number = self.module_calls
        self.module_calls += 1
        program = self.tape.program
        if self.program_ok and program is not None and program.checks and not state_matches(program, number, module):
            self.program_ok = False
        wanted = self.tape.modules.get(number)
        if wanted and not self.diverged:
            leaves = (output,) if isinstance(output, torch.Tensor) else tree_flatten(output)[0]
            for leaf, source in wanted:
                t = leaves[leaf] if leaf < len(leaves) else None
                if not isinstance(t, torch.Tensor):
                    self.diverged = True
                    return
                self._capture(t, source, t._version)

    def _capture(self, t: torch.Tensor, source: _Source, version: int) -> torch.Tensor | None:
        """Capture the kept output ``t`` (at ``version``) shares storage with; returns ``t`` detached to hold,
        or None where the output is offloaded (never held on the device)."""
        held = detached(t)  # no grad_fn: the frame that holds it must not keep the graph alive
        if not source.offloaded:
            self.unfiled.append((source, held, version))
            return held
        leaves = self.captured.setdefault((id(source.op), source.call), {})
        if source.leaf not in leaves:  # else saved twice: copied out once
            # It starts its copy out now, as the recording mode's does when its op returns.
            value = self._output(held, source)
            leaves[source.leaf] = (_Kept(value, offload=True), version)
        return None

    @staticmethod
    def _output(held: torch.Tensor, source: _Source) -> torch.Tensor:
        """The kept output itself, from a tensor that shares its storage."""
        if source.exact:
            return held
        size, stride, offset = source.geometry
        return held.as_strided(size, stride, offset)

    def _file_captures(self) -> None:
        captured, output = self.captured, self._output
        for source, held, version in self.unfiled:
            captured.setdefault((id(source.op), source.call), {})[source.leaf] = (output(held, source), version)
        self.unfiled = []

    def release(self) -> None:
        """Let go of every captured output (they belong to the replay's slots now, or are not served)."""
        self.captured, self.unfiled = {}, []

    def kept(self) -> Iterator[tuple[Any, int, _Kept | _KeptOutputs]]:
        """``(op, call, kept)`` for every kept call captured whole (none if the call diverged from the tape).

        Each kept tensor carries its version when captured, so a change after forward is seen when it is
        served, as for outputs the recording mode keeps.
        """
        if self.diverged:
            return
        self._file_captures()
        ops = {id(op): op for op, _, _ in self.tape.slots}
        for (op_id, call), (spec, leaves, offloaded) in self.tape.outputs.items():
            captured = self.captured.get((op_id, call), {})
            if len(captured) != leaves.count(_TENSOR):
                continue  # not captured in this call: recomputed
            values = [captured[i][0] if item is _TENSOR else item.make() if isinstance(item, _Empty) else item
                      for i, item in enumerate(leaves)]
            if offloaded:  # already kept (and on its way to host memory) when captured
                values = [_Kept(v, False) if isinstance(v, torch.Tensor) else v for v in values]
                structure = tree_unflatten(values, spec)
                yield ops[op_id], call, structure if isinstance(structure, _Kept) else _KeptOutputs.of(structure)
                continue
            kept = _keep(tree_unflatten(values, spec), False)
            # in the order of kept.tensors(): each captured tensor's version then (a made one is new)
            versions = [captured[i][1] if item is _TENSOR else 0 for i, item in enumerate(leaves)
                        if item is _TENSOR or isinstance(item, _Empty)]
            for tensor, version in zip(kept.tensors(), versions):
                tensor.version = version
            yield ops[op_id], call, kept
