"""Programs: a followed region's recomputation, run straight from the ops its recorded forward ran.

A region that follows its tape (:mod:`.tape`) runs forward with no dispatch mode, and the usual replay
reruns its whole Python forward in backward, under a dispatch mode, serving the kept outputs.  On a GPU
that rerun is host work the device waits for: a layer whose matmuls are kept still pays a Python trip per
op, for ops that mostly produce nothing backward needs.

While the recording forward runs, a :class:`_ProgramWriter` also writes down every op call with where each
of its tensor arguments came from: an earlier call's output, a region input, or a parameter or buffer of a
module the region calls.  That list, the *program*, is filed with the tape.  A later backward of a region
that followed the tape runs only the calls the dropped saved tensors depend on, in forward order, with the
kept outputs served instead of rerun: no module code, no dispatch mode, and no ops whose outputs nobody
needs.  A policy that keeps a layer's matmuls reruns its norms, rotary embedding and activations only.

Each call runs below autograd and autocast, as it ran in forward (its arguments were already cast there),
and every intermediate is let go after its last use in the run.  An in-place op on memory the region made
(dropout's mask on the CPU, an in-place ReLU, a residual ``add_``, ``masked_fill_``) is a step like any
other, writing what the run made (:mod:`.inplace`): a step reading that memory through another tensor runs
after the write, and a kept output a step of the run writes is rerun rather than served.

A region gets no program (its replay reruns the Python forward, as before) where a direct run could differ
from that rerun:

- an op writes in place where a rerun could differ from forward (:mod:`.inplace`): memory the region did
  not make (an input, a parameter or buffer, a view of one: a rerun would write it again), an argument
  other than the ``self`` it returns (``out=``), a tensor's shape or memory (``resize_``, ``set_``), or
  memory autograd saved a tensor on before the write; or an op updates running statistics its schema does
  not show written (``native_batch_norm`` in training, without BatchNorm's batch counter): a rerun would
  update them again;
- an op returns a Python value (``.item()``), or Python reads a tensor's data (``tolist``, ``numpy``,
  ``__array__``, ``__dlpack__``, ``data_ptr``): later ops were given what it read as a constant, or a
  kernel the program cannot see wrote there;
- a tensor argument comes from neither an earlier op nor an input, and is neither a parameter or buffer of
  a module the region calls nor saved by autograd (a tensor from a closure or a global that only feeds an
  addition, say: the follower could not tell whether a later call reads another one);
- a custom ``autograd.Function`` runs in the region (its kernels may be Triton or an extension's, which
  write what no aten op shows), or a tensor made by ``empty`` and friends (something the program cannot see
  may have filled it) or made with grad disabled (a custom Function's forward, or a ``no_grad`` block: where
  extensions write buffers) is read before an op overwrote all of it (``bernoulli_``, ``fill_``, ``copy_``);
- an op's output shape depends on values (``nonzero``, a boolean mask): later ops took its shape as a
  constant;
- a tensor is a subclass, on the meta device, or functorch transforms are active.

Random ops rerun as the Python rerun does them: the RNG is put where it was when the region started, and
every random op before a needed one reruns too (a kept one included, which then draws its kept value
again), so each draws what it drew in forward.  A run is given up for the Python rerun where a module the
forward called held another parameter or buffer under the name the program reads, or where autograd saved
another tensor than the one the program reads from outside (both checked by identity in forward: after
swapping adapters, say).

What a program cannot see: a Python number that changes between calls with inputs alike (a scale
annealed by a global counter), which the program reruns with the number of the recorded forward; and a
kernel no aten op shows writing, with grad enabled and outside any custom Function, into a tensor an op
made.
Run such a region with ``remat.policies.tapes(True, programs=False)``, and one that branches on values
with ``tapes(False)``.

Example:
    >>> y = remat.checkpoint(block, x, policy=remat.policies.save_matmuls)  # records: program written
    >>> y = remat.checkpoint(block, x, policy=remat.policies.save_matmuls)  # follows the tape
    >>> y.sum().backward()  # reruns only the ops whose outputs backward needs, from the program
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .inplace import _FULL_WRITES, _Memory, _tracked, covers, updates_statistics
from .rngwatch import _RngWatch

__all__: list[str] = []

# Where a tensor argument comes from: (_STEP, step, output leaf), (_INPUT, position, 0), (_STATE, index, 0).
_STEP, _INPUT, _STATE = 0, 1, 2
Ref = tuple[int, int, int]

_MASKS = (torch.bool, torch.uint8)
_UNINITIALIZED = frozenset(
    getattr(getattr(torch.ops.aten, name), overload)
    for name, overload in [("empty", "memory_format"), ("empty_like", "default"), ("empty_strided", "default"),
                           ("new_empty", "default"), ("new_empty_strided", "default"), ("empty_permuted", "default")]
    if hasattr(torch.ops.aten, name) and hasattr(getattr(torch.ops.aten, name), overload))
_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
for _name in dir(torch._C.DispatchKey):
    if _name.startswith("Autocast"):
        _AUTOCAST = _AUTOCAST | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, _name))


@dataclass(frozen=True)
class _Step:
    """One op call of the recorded forward; its tensor arguments are filled in from ``fills``."""

    op: Any
    args: tuple
    kwargs: dict
    fills: tuple[tuple[Any, Ref], ...]  # (argument position, kwarg name or (position, list index), source)
    call: int | None  # the call index the policy's slot counts (None: an op no policy decides)
    random: bool
    after: tuple[int, ...] = ()  # in-place writes it must run after: to memory it reads through another tensor
    writes: int | None = None  # for an in-place op: the step that allocated the memory it writes (.inplace)


@dataclass
class _Program:
    """A region's op calls, where each saved tensor comes from, and the module state they read."""

    steps: list[_Step]
    packs: list[Ref]  # per saved tensor, in the pack hook's order
    pack_after: list[tuple[int, ...]]  # per saved tensor, the in-place write to its memory it needs too
    state: list[weakref.ref]  # the tensors from outside the region the steps read
    checks: dict[int, list[tuple[str, str, int]]]  # module call -> (its dict, name, state index) to verify
    saved_state: dict[int, int]  # pack index -> state index of the tensor from outside autograd saves there
    previous_draw: list[int]  # per step, the random step before it (-1: none)
    kept_steps: tuple[int, ...] = ()  # steps whose outputs the follower captures (served when kept)
    schedules: dict[tuple, _Schedule] = field(default_factory=dict)  # by wanted packs and servable steps
    fused: dict[tuple, tuple] = field(default_factory=dict)  # its compiled refills, by schedule and backend (.fused)


@dataclass(frozen=True)
class _Schedule:
    """How one refill runs (:func:`schedule`): the same for every backward that wants the same tensors."""

    order: tuple[int, ...]  # the steps, in forward order
    served: frozenset[int]
    draws: bool  # whether a random op runs
    kept_leaves: dict[int, frozenset[int]]  # step -> its output leaves a later step reads
    frees: dict[int, tuple[int, ...]]  # step -> the steps whose outputs it reads last
    results: dict[int, tuple[tuple[int, int], ...]]  # step -> (pack index, output leaf) it refills
    direct: tuple[tuple[int, Ref], ...]  # (pack index, source) refilled from inputs or outside tensors


def _key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr(), t.shape, t.stride(), t.storage_offset(), t.dtype,
            t.is_conj(), t.is_neg())


class _ProgramWriter:
    """Writes the program of one recorded forward, or the reason it cannot have one."""

    def __init__(self, inputs: Sequence[torch.Tensor]) -> None:
        # tensor key -> where it comes from, and its storage (a freed address may be taken by a tensor made
        # outside any op: ``torch.tensor(...)``)
        self.refs: dict[tuple, tuple[Ref, StorageWeakRef]] = {}
        self.inputs = list(inputs)  # strong only while forward runs
        self.steps: list[_Step] = []
        self.packs: list[Ref] = []
        self.pack_after: list[tuple[int, ...]] = []
        self.memory = _Memory()
        self.outside: list[torch.Tensor] = []  # strong only while forward runs
        self.outside_index: dict[int, int] = {}
        self.saved_state: dict[int, int] = {}
        self.uninitialized: set[int] = set()  # steps that allocate without writing, or run with grad disabled
        self.covering: set[int] = set()  # of those, the ones whose one output spans its whole memory
        self.grad_fns: list[Any] = []  # of the saved tensors: the autograd nodes the region made lead to them
        self.first_node = _next_node_number()
        self.rng = _RngWatch()
        self.refused: str | None = None
        if torch._C._are_functorch_transforms_active():
            self.refused = "functorch transforms are active"
        if not all(_tracked(t) for t in inputs):
            self.refused = "an input is a sparse tensor, a tensor subclass or on the meta device"
            return
        storages = [(t.device, t.untyped_storage().data_ptr()) for t in inputs if t.untyped_storage().nbytes()]
        if len(set(storages)) < len(storages):
            self.refused = "two inputs share memory (a later call may pass tensors that do not)"
        for position, t in enumerate(inputs):
            if _tracked(t):
                self._register(t, (_INPUT, position, 0))

    def step(self, op: Any, args: tuple, kwargs: dict, out: Any, call: int | None) -> None:
        """An op ran under the recording mode."""
        if self.refused is not None:
            return
        if not isinstance(op, torch._ops.OpOverload):
            return self._refuse(f"{op} is not an ATen operator")
        mutable = op._schema.is_mutable
        why = self.memory.refusal(op, args, out) if mutable else (
            f"{op} updates running statistics in place, which its schema does not show"
            if updates_statistics(op, args, kwargs) else None)
        if why is not None:
            return self._refuse(why)
        if torch.Tag.dynamic_output_shape in op.tags and (op is not torch.ops.aten.index.Tensor or any(
                isinstance(i, torch.Tensor) and i.dtype in _MASKS for i in args[1])):
            return self._refuse(f"{op}'s output shape depends on values: later ops took it as a constant")
        random = torch.Tag.nondeterministic_seeded in op.tags
        if random:
            self.rng.drew(args, kwargs)
        fills: list[tuple[Any, Ref]] = []
        before_args, before_kwargs = args, kwargs
        args = self._template(list(args), range(len(args)), fills)
        kwargs = self._template(dict(kwargs), list(kwargs), fills)
        if self.refused is not None:
            return
        index = len(self.steps)
        leaves = (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]
        if not isinstance(out, (torch.Tensor, tuple, list)) and out is not None:
            return self._refuse(f"{op} returns a Python value that later ops may use as a constant")
        outputs = [t for t in leaves if isinstance(t, torch.Tensor)]
        for t in outputs:
            if not _tracked(t):
                return self._refuse(f"{op} returns a {type(t).__name__} on {t.device}")
        read = [t for t in tree_flatten((before_args, before_kwargs))[0] if isinstance(t, torch.Tensor)]
        after = self.memory.last_writes(read) - {where for _, (kind, where, _) in fills if kind == _STEP}
        writes = self.memory.wrote(index, out) if mutable else None
        if not any(r.alias_info is not None for r in op._schema.returns):
            self.memory.allocated(index, outputs, read)
        for leaf, t in enumerate(leaves):
            if isinstance(t, torch.Tensor):
                self._register(t, (_STEP, index, leaf))
        if op in _UNINITIALIZED or not torch.is_grad_enabled():
            self.uninitialized.add(index)
            if len(outputs) == 1 and covers(outputs[0]):
                self.covering.add(index)
        self.steps.append(_Step(op, tuple(args), kwargs, tuple(fills), call, random, tuple(sorted(after)), writes))

    def watching(self) -> TorchFunctionMode:
        """The mode to run the recording forward under: it sees Python read a tensor's data."""
        return watching_reads(self._refuse)

    def before_draw(self, op: Any, args: tuple, kwargs: dict) -> None:
        """A random op is about to run: the program replays it only where it draws on from the last draw."""
        if self.refused is None:
            why = self.rng.check(op, args, kwargs)
            if why is not None:
                self._refuse(why)

    def pack(self, t: torch.Tensor) -> None:
        """Autograd saved ``t`` (the pack hook's next index)."""
        if self.refused is None:
            ref = self._ref(t)
            if ref[0] == _STATE:
                self.saved_state[len(self.packs)] = ref[1]
            self.packs.append(ref)
            written = self.memory.saved(t) if _tracked(t) else None
            self.pack_after.append((written,) if written is not None and ref[:2] != (_STEP, written) else ())
            if t.grad_fn is not None:
                self.grad_fns.append(t.grad_fn)

    def finish(self, modules: Sequence[torch.nn.Module], kept_calls: Any = ()) -> _Program | None:
        """Forward ended; ``modules`` are the modules it called, in the order their forwards returned, and
        ``kept_calls`` the (op id, call) whose outputs a follower captures."""
        if self.refused is None and self._custom_function():
            self._refuse("a custom autograd.Function ran: its kernels may write what no aten op shows")
        if self.refused is None and self._reads_uninitialized():
            self._refuse("a tensor made by an empty-like op, or with grad disabled, is read: a kernel no aten op "
                         "shows may have written it")
        self.grad_fns, self.inputs, self.rng = [], [], None
        if self.refused is not None:
            return None
        checks: dict[int, list[tuple[str, str, int]]] = {}
        saved = set(self.saved_state.values())
        for index, t in enumerate(self.outside):
            found = _owner(t, modules)
            if found is None:
                if index in saved:
                    continue  # the follower sees autograd save it
                return self._refuse(
                    f"a {tuple(t.shape)} tensor comes from outside the region, is no parameter or buffer of a "
                    "module it calls, and autograd does not save it")
            number, where, name = found
            checks.setdefault(number, []).append((where, name, index))
        previous_draw, last = [], -1
        for number, step in enumerate(self.steps):
            previous_draw.append(last)
            if step.random:
                last = number
        state = [weakref.ref(t) for t in self.outside]
        kept = tuple(n for n, step in enumerate(self.steps) if (id(step.op), step.call) in kept_calls)
        return _Program(self.steps, self.packs, self.pack_after, state, checks, self.saved_state, previous_draw, kept)

    def keeping_nothing(self, modules: Sequence[torch.nn.Module],
                        made: Sequence[bool]) -> tuple[_Program, _Schedule] | None:
        """Forward ended (as :meth:`finish`): the program and its refill if the policy kept nothing (None where
        there is none), where ``made[i]`` says whether saved tensor ``i`` is on memory the region made (the
        others are held)."""
        program = self.finish(modules)
        if program is None:
            return None
        dropped = [i for i, ((kind, _, _), mine) in enumerate(zip(program.packs, made)) if kind == _STEP and mine]
        found = schedule(program, dropped, ())
        return (program, found) if found is not None else None

    def _reads_uninitialized(self) -> bool:
        """Whether a step or autograd reads what an empty-like op (or one with grad disabled) made, other than
        an op that overwrites all of it (:mod:`.inplace`)."""
        unset = self.uninitialized
        for step in self.steps:
            overwrites = step.op in _FULL_WRITES
            if any(kind == _STEP and where in unset and not (overwrites and position == 0 and where in self.covering)
                   for position, (kind, where, _) in step.fills) or unset.intersection(step.after):
                return True
        return any(kind == _STEP and where in unset for kind, where, _ in self.packs) or any(
            unset.intersection(after) for after in self.pack_after)

    def _custom_function(self) -> bool:
        """Whether a node of a custom ``autograd.Function`` (other than remat's own input saver) made in the
        region leads to a saved tensor."""
        seen, stack = set(), list(self.grad_fns)
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen or node._sequence_nr() < self.first_node:
                continue
            seen.add(id(node))
            if isinstance(node, torch.autograd.function.BackwardCFunction) and not getattr(
                    node._forward_cls, "_remat_internal", False):
                return True
            stack.extend(next_node for next_node, _ in node.next_functions)
        return False

    def _template(self, container: Any, positions: Any, fills: list) -> Any:
        for position in positions:
            value = container[position]
            if isinstance(value, torch.Tensor):
                fills.append((position, self._ref(value)))
                container[position] = None  # the program must not keep forward's tensors alive
            elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
                inner = container[position] = list(value)
                for item, v in enumerate(value):
                    if isinstance(v, torch.Tensor):
                        fills.append(((position, item), self._ref(v)))
                        inner[item] = None
        return container

    def _ref(self, t: torch.Tensor) -> Ref:
        if self.refused is not None:
            return (_STATE, -1, 0)
        if not _tracked(t):
            self._refuse(f"a {type(t).__name__} on {t.device} is an argument")
            return (_STATE, -1, 0)
        entry = self.refs.get(_key(t))
        if entry is not None and not entry[1].expired():
            ref = entry[0]
            if ref[0] == _STEP:
                return ref
            if ref[0] == _INPUT:
                if t is not self.inputs[ref[1]]:
                    self._refuse("a tensor from outside aliases a region input (a later call may pass another)")
                return ref
            if t is self.outside[ref[1]]:
                return ref
            # another tensor from outside on the same memory: each is checked as itself
        index = self.outside_index.get(id(t))
        if index is None:
            index = self.outside_index[id(t)] = len(self.outside)
            self.outside.append(t)
        ref = (_STATE, index, 0)
        self._register(t, ref)
        return ref

    def _register(self, t: torch.Tensor, ref: Ref) -> None:
        self.refs[_key(t)] = (ref, StorageWeakRef(t.untyped_storage()))

    def _refuse(self, why: str) -> None:
        if self.refused is None:
            self.refused = why
        self.outside, self.inputs = [], []


def _calls_needed(program: _Program, wanted: Sequence[int]) -> set[tuple[int, int]]:
    """The (op id, call) of every step a refill of ``wanted`` runs, every captured kept output served."""
    found = plan(program, wanted, frozenset(program.kept_steps))
    if found is None:
        return {(id(step.op), step.call) for step in program.steps}  # the Python rerun may run any
    order, served, _ = found
    return {(id(program.steps[n].op), program.steps[n].call) for n in order if n not in served}


_DATA_READS = frozenset(getattr(torch.Tensor, name) for name in
                        ("tolist", "numpy", "__array__", "__dlpack__", "data_ptr") if hasattr(torch.Tensor, name))


class _DataReads(TorchFunctionMode):
    """While recording: refuses a program (``refuse(why)``) where Python reads a tensor's data (no aten op
    shows it)."""

    def __init__(self, refuse: Callable[[str], None]) -> None:
        super().__init__()
        self.refuse = refuse

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _DATA_READS:
            self.refuse(f"Python reads a tensor's data ({func.__name__}): what it read, or what a kernel wrote "
                        "there, is no op the program can rerun")
        return func(*args, **(kwargs or {}))


def watching_reads(refuse: Callable[[str], None]) -> TorchFunctionMode:
    """The mode a recording forward runs under to see Python read a tensor's data; ``refuse(why)`` is called
    for each read."""
    return _DataReads(refuse)


def _next_node_number() -> int:
    """The sequence number the next autograd node made on this thread gets (a probe node takes one)."""
    with torch._C._DisableTorchDispatch(), torch.enable_grad():
        return torch.ones((), requires_grad=True).neg().grad_fn._sequence_nr() + 1


def _owner(t: torch.Tensor, modules: Sequence[torch.nn.Module]) -> tuple[int, str, str] | None:
    """The first module call whose module holds ``t`` as a parameter or buffer: (call, dict, name)."""
    for number, module in enumerate(modules):
        for where in ("_parameters", "_buffers"):
            for name, value in getattr(module, where).items():
                if value is t:
                    return number, where, name
    return None


def state_matches(program: _Program, number: int, module: torch.nn.Module) -> bool:
    """Whether module call ``number`` of a followed forward holds the state the program reads."""
    for where, name, index in program.checks.get(number, ()):
        held = program.state[index]()
        if held is None or getattr(module, where).get(name) is not held:
            return False
    return True


def plan(program: _Program, wanted: Sequence[int], serve: Any) -> tuple[list, set, bool] | None:
    """The steps for the saved tensors ``wanted`` (in forward order), those of them to serve (of the steps in
    ``serve``, those with a kept output to serve), and whether a random op runs; None where only the Python
    rerun can refill them."""
    steps = program.steps
    needed = [False] * len(steps)
    for index in wanted:
        kind, where, _ = program.packs[index]
        if kind == _STEP:
            needed[where] = True
        elif kind == _STATE and program.state[where]() is None:
            return None
        for write in program.pack_after[index]:
            needed[write] = True
    served = set()
    draws = False  # whether a random op after the step at hand runs
    written = set()  # the steps whose memory a step that runs after them writes in place
    for number in range(len(steps) - 1, -1, -1):
        if not needed[number]:
            continue
        step = steps[number]
        # A kept output that a later step writes in place is rerun rather than served: the write would change
        # the kept value, which a backward that keeps its graph is served again.
        if number in serve and number not in written:
            if not (step.random and draws):
                served.add(number)
                continue
            # A kept draw with a random op after it reruns so that op draws what it drew in forward (the same
            # value: the RNG is where forward had it), as the Python rerun reruns it for its advance.
        if step.random:
            draws = True
            if program.previous_draw[number] >= 0:
                needed[program.previous_draw[number]] = True
        if step.writes is not None:
            written.add(step.writes)
        for write in step.after:
            needed[write] = True
        for _, (kind, where, _) in step.fills:
            if kind == _STEP:
                needed[where] = True
            elif kind == _STATE and program.state[where]() is None:
                return None
    return [number for number, need in enumerate(needed) if need], served, draws


_SCHEDULES = 16  # kept per program (sets of wanted tensors and servable outputs)


def schedule(program: _Program, wanted: Sequence[int], servable: Sequence[bool]) -> _Schedule | None:
    """How to refill ``wanted`` where ``servable`` says, per :attr:`_Program.kept_steps`, which kept outputs
    can be served (computed once per such pair); None where only the Python rerun can."""
    key = (tuple(wanted), tuple(servable))
    found = program.schedules.get(key)
    if found is not None:
        return found
    serve = {number for number, can in zip(program.kept_steps, servable) if can}
    planned = plan(program, wanted, serve)
    if planned is None:
        return None
    order, served, draws = planned
    steps, packs = program.steps, program.packs
    last_use: dict[int, int] = {}
    read: dict[int, set[int]] = {}
    for number in order:
        if number not in served:
            for _, (kind, where, leaf) in steps[number].fills:
                if kind == _STEP:
                    last_use[where] = number
                    read.setdefault(where, set()).add(leaf)
    frees: dict[int, list[int]] = {}
    for made, reader in last_use.items():
        frees.setdefault(reader, []).append(made)
    results: dict[int, list[tuple[int, int]]] = {}
    direct = []
    for index in wanted:
        ref = packs[index]
        if ref[0] == _STEP:
            results.setdefault(ref[1], []).append((index, ref[2]))
        else:
            direct.append((index, ref))
    found = _Schedule(tuple(order), frozenset(served), draws, {n: frozenset(leaves) for n, leaves in read.items()},
                      {n: tuple(made) for n, made in frees.items()}, {n: tuple(r) for n, r in results.items()},
                      tuple(direct))
    if len(program.schedules) >= _SCHEDULES:
        program.schedules.pop(next(iter(program.schedules)))
    program.schedules[key] = found
    return found


def run(program: _Program, plan_: _Schedule, count: int, inputs: Sequence[torch.Tensor],
        serve: Callable[[_Step], Any]) -> list[Any]:
    """Run a :func:`schedule`; the refilled saved tensors, by pack index (None where not wanted).

    Random ops draw from the RNG as the caller set it (where it was when the region started)."""
    steps, state = program.steps, program.state
    result: list[Any] = [None] * count
    for index, (kind, where, leaf) in plan_.direct:
        result[index] = _value(kind, where, leaf, None, inputs, state).detach()
    values: dict[int, list[Any]] = {}
    served, kept_leaves, frees, results = plan_.served, plan_.kept_leaves, plan_.frees, plan_.results
    with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST), torch._C._AutoDispatchBelowADInplaceOrView():
        for number in plan_.order:
            step = steps[number]
            if number in served:
                out = serve(step)
            else:
                args, kwargs = _arguments(step, values, inputs, state)
                out = step.op(*args, **kwargs)
            flat = [out] if isinstance(out, torch.Tensor) else tree_flatten(out)[0]
            for index, leaf in results.get(number, ()):
                value = flat[leaf]
                result[index] = value.detach() if value.requires_grad else value
            used = kept_leaves.get(number)
            if used:  # kept only until its last reader has run, and only the leaves read
                values[number] = flat if len(flat) == 1 else [v if i in used else None for i, v in enumerate(flat)]
            for made in frees.get(number, ()):
                del values[made]
    return result


def _value(kind: int, where: int, leaf: int, values: Any, inputs: Sequence[torch.Tensor], state: list) -> Any:
    if kind == _STEP:
        return values[where][leaf]
    if kind == _INPUT:
        return inputs[where]
    return state[where]()


def _arguments(step: _Step, values: dict, inputs: Sequence[torch.Tensor], state: list) -> tuple[list, dict]:
    args = list(step.args)
    kwargs = dict(step.kwargs)
    for position, (kind, where, leaf) in step.fills:
        value = _value(kind, where, leaf, values, inputs, state)
        if isinstance(position, tuple):  # an item of a tensor list
            outer, item = position
            container, template = (kwargs, step.kwargs) if isinstance(outer, str) else (args, step.args)
            if container[outer] is template[outer]:
                container[outer] = list(template[outer])  # the template's list stays as recorded
            container[outer][item] = value
        elif isinstance(position, str):
            kwargs[position] = value
        else:
            args[position] = value
    return args, kwargs
