"""Fused reruns: a program's refill compiled into a few kernels, for regions run inside :func:`fused_reruns`.

A region refilled from its program (:mod:`.program`) reruns its ops one by one: on a GPU each elementwise op
is a kernel that reads and writes its whole tensor, so a Llama layer that keeps its matmuls still moves its
RMSNorms' float32 copies, its rotary embedding and its SiLU through memory op by op.  Fused, the same ops
are handed to a compiler (Inductor by default) as one graph: the elementwise chains become a few kernels
that read the layer's inputs once and write only the tensors backward needs.

The graph is the refill itself: the ops the schedule runs, with the region's inputs, the module state they
read and the kept outputs served as its inputs, and the dropped saved tensors as its outputs.  Each is
compiled once per structure (ops, constants, and the inputs' shapes, strides, dtypes and devices), so the
layers of a model that keep the same outputs share one compilation; the backend is handed the graph as
dynamo would hand it one, with no per-call guards (the key already pins what they would check).  Inside
:func:`fused_reruns` a checkpoint without a policy keeps nothing as a policy (``save_nothing``), so that it
follows its tape and its whole rerun is fused too.

A random op in the graph (attention, which PyTorch marks random for its dropout) runs as eager runs it, from
the generator where the replay put it (forward's state at the region's start): with nothing random before
it, it draws what forward drew.  These run op by op instead:

- refills with two or more random ops (a compiler may reorder them);
- graphs the compiler rejects (a warning names the error, once);
- refills under a dispatch mode (a memory tracker must see every op).

Fused recomputation is not bitwise: a compiler reorders reductions and keeps intermediates in registers.
Inductor is asked to round where eager rounds (``emulate_precision_casts``, division rounding), so what
differs is what fusion itself changes (a reduction's order, a transcendental's last bit); gradients match
plain autograd to rounding, as those of a compiled model do.  That is why it is opt-in.

Example:
    >>> with remat.policies.fused_reruns():
    ...     loss = model(x).sum()  # regions that follow their tapes are marked to fuse their reruns
    >>> loss.backward()  # each layer's dropped tensors come back from one compiled graph
"""

from __future__ import annotations

import contextlib
import operator
import struct
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten

from .program import _INPUT, _STATE, _STEP, Ref, _arguments, _Program, _Schedule, _Step, _value, run

__all__ = ["fused_reruns"]

_backend: list[str | None] = [None]
_CONSTANTS = (int, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_COMPILED_KEPT = 64  # compiled graphs kept (structures × shapes)
_compiled: OrderedDict[tuple, _Compiled] = OrderedDict()
# Round where eager rounds; run random ops as eager does, from the generator the replay set (see run_fused).
_INDUCTOR_OPTIONS = {"emulate_precision_casts": True, "eager_numerics.division_rounding": True,
                     "fallback_random": True}


@contextlib.contextmanager
def fused_reruns(backend: str | None = "inductor") -> Iterator[None]:
    """Mark the selective regions whose forward runs inside to refill their dropped tensors with one compiled
    graph per region (``backend`` as ``torch.compile`` takes it), rather than op by op (``None``: op by op).

    It applies to regions that follow their tapes and have a program (:mod:`remat.policies.program`), and to
    checkpoints without a policy, which keep nothing as a policy inside it; the backward may run outside the
    ``with``.  Gradients match plain autograd to rounding, not bitwise.

    Example:
        >>> with remat.policies.fused_reruns():
        ...     loss = model(x).sum()
        >>> loss.backward()
    """
    before = _backend[0]
    _backend[0] = backend
    try:
        yield
    finally:
        _backend[0] = before


def current_backend() -> str | None:
    """The compiler backend regions starting now fuse their reruns with (None: they run op by op)."""
    return _backend[0]


@dataclass
class _Fused:
    """One refill as a compiled graph: where each graph input comes from, and which pack each output fills.

    The compiled graph itself belongs to the shared cache (bounded): this holds its key and a weak reference,
    and compiles again where the cache let it go."""

    key: tuple
    graph: torch.fx.Graph
    backend: Any
    sources: tuple[Ref, ...]  # (_INPUT, position, 0), (_STATE, index, 0) or (_STEP, served step, leaf)
    outputs: tuple[int, ...]  # pack index of each graph output
    compiled: Callable[[], _Compiled | None] = lambda: None

    def call(self, *arguments: torch.Tensor) -> Any:
        compiled = self.compiled()
        if compiled is None:
            compiled = _compile(self.key, self.graph, self.backend)
            self.compiled = weakref.ref(compiled)
        return compiled(*arguments)


def run_fused(program: _Program, plan: _Schedule, count: int, inputs: Sequence[torch.Tensor],
              serve: Callable[[_Step], Any], backend: Any) -> list[Any]:
    """:func:`~.program.run`, with the ops compiled into one graph by ``backend`` where it can be.

    Example:
        >>> refilled = run_fused(program, plan, count, inputs, serve, "inductor")
    """
    steps = program.steps
    served = {number: serve(steps[number]) for number in plan.order if number in plan.served}
    # A dispatch mode that is watching (a memory tracker, a FLOP counter) must see every op, as the program runs
    # them: a compiler would trace under it, and a graph module's call would show it a module that is not there.
    fused = _fused(program, plan, inputs, served, backend) if _get_current_dispatch_mode() is None else None
    if fused is None:
        by_step = {id(steps[number]): value for number, value in served.items()}
        return run(program, plan, count, inputs, lambda step: by_step[id(step)])
    result: list[Any] = [None] * count
    for index, (kind, where, leaf) in plan.direct:
        result[index] = _value(kind, where, leaf, None, inputs, program.state).detach()
    for number, out in served.items():
        for index, leaf in plan.results.get(number, ()):
            value = _leaf(out, leaf)
            result[index] = value.detach() if value.requires_grad else value
    arguments = [_source(ref, inputs, program, served) for ref in fused.sources]
    with torch.no_grad(), _autocast_off(arguments):
        outputs = fused.call(*arguments)
    for index, value in zip(fused.outputs, outputs):
        result[index] = value
    return result


def fuses(program: _Program, plan: _Schedule, inputs: Sequence[torch.Tensor], backend: Any) -> bool:
    """Whether :func:`run_fused` runs ``plan``, which serves no kept output, as one compiled graph: not with
    two random ops, under a dispatch mode, or once the backend failed to compile it.

    Example:
        >>> fuses(program, plan, inputs, "inductor")
    """
    if plan.served or _get_current_dispatch_mode() is not None:
        return False
    found = _fused(program, plan, inputs, {}, backend)
    compiled = found.compiled() if found is not None else None
    return found is not None and not (compiled is not None and compiled.failed)


_FUSED_PER_PROGRAM = 16  # as many as a program keeps schedules


def _fused(program: _Program, plan: _Schedule, inputs: Sequence[torch.Tensor], served: dict[int, Any],
           backend: Any) -> _Fused | None:
    """The compiled graph for ``plan`` under ``backend`` (built on its first refill, then kept with the
    program); None where it runs op by op."""
    found = program.fused.get((id(plan), id(backend)))
    if found is not None and found[0] is plan and found[1] is backend:
        return found[2]
    fused = _build(program, plan, inputs, served, backend)
    if len(program.fused) >= _FUSED_PER_PROGRAM:
        program.fused.pop(next(iter(program.fused)))
    program.fused[(id(plan), id(backend))] = (plan, backend, fused)
    return fused


def _build(program: _Program, plan: _Schedule, inputs: Sequence[torch.Tensor], served: dict[int, Any],
           backend: str) -> _Fused | None:
    steps = program.steps
    if sum(steps[n].random for n in plan.order if n not in plan.served) > 1:
        return None  # the compiler may reorder random ops, and each must draw where forward drew
    graph = _GraphWriter()
    key: list[Any] = [backend]
    for number in plan.order:
        if number in plan.served:
            continue
        step = steps[number]
        frozen = _frozen((step.args, step.kwargs))
        if frozen is _UNFIT or not _flat_returns(step.op):
            return None
        args, kwargs = _arguments(step, graph.nodes, graph.inputs, graph.state)
        graph.step(number, step.op, args, kwargs, len(step.op._schema.returns) == 1 and not _is_list(step.op))
        key.append((step.op, frozen, tuple((position, graph.local(ref)) for position, ref in step.fills)))
    outputs = [(index, (_STEP, number, leaf)) for number, refills in plan.results.items() if number not in plan.served
               for index, leaf in refills]
    if not outputs:
        return None
    graph.output([graph.value(ref) for _, ref in outputs])
    sources = tuple(graph.sources)
    for ref in sources:
        t = _source(ref, inputs, program, served)
        key.append((tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.is_conj(), t.is_neg()))
    key.append(tuple(graph.local(ref) for _, ref in outputs))
    return _Fused(tuple(key), graph.graph, backend, sources, tuple(index for index, _ in outputs))


class _GraphWriter:
    """An fx graph of a refill, written step by step; serves :func:`~.program._arguments` the nodes in place
    of the values it would read."""

    def __init__(self) -> None:
        self.graph = torch.fx.Graph()
        self.sources: list[Ref] = []
        self.placeholders: dict[Ref, torch.fx.Node] = {}
        self.made: dict[int, _Leaves] = {}  # program step -> its outputs in the graph
        self.position: dict[int, int] = {}  # program step -> its position among the graph's steps
        self.nodes = _Lookup(lambda where: self.made.get(where) or _Leaves(self, where, None, False))
        self.inputs = _Lookup(lambda where: self.placeholder((_INPUT, where, 0)))
        self.state = _Lookup(lambda where: lambda: self.placeholder((_STATE, where, 0)))

    def step(self, number: int, op: Any, args: list, kwargs: dict, single: bool) -> None:
        self.position[number] = len(self.position)
        self.made[number] = _Leaves(self, number, self.graph.call_function(op, tuple(args), kwargs), single)

    def value(self, ref: Ref) -> torch.fx.Node:
        kind, where, leaf = ref
        return self.nodes[where][leaf] if kind == _STEP else self.placeholder(ref)

    def placeholder(self, ref: Ref) -> torch.fx.Node:
        node = self.placeholders.get(ref)
        if node is None:
            node = self.placeholders[ref] = self.graph.placeholder(f"input_{len(self.sources)}")
            self.sources.append(ref)
        return node

    def local(self, ref: Ref) -> tuple:
        """``ref`` as the key names it: by graph input, or by graph step and leaf (not by program step: the
        layers of a model share a key)."""
        if ref in self.placeholders:
            return ("input", self.sources.index(ref))
        return ("step", self.position[ref[1]], ref[2])

    def output(self, nodes: list[torch.fx.Node]) -> None:
        self.graph.output(tuple(nodes))


class _Leaves:
    """The outputs of one graph step by leaf (or, for a served step, its placeholders)."""

    def __init__(self, writer: _GraphWriter, number: int, node: torch.fx.Node | None, single: bool) -> None:
        self.writer, self.number, self.node, self.single = writer, number, node, single
        self.items: dict[int, torch.fx.Node] = {}

    def __getitem__(self, leaf: int) -> torch.fx.Node:
        if self.node is None:  # a served step: its kept output is a graph input
            return self.writer.placeholder((_STEP, self.number, leaf))
        if self.single:
            return self.node
        if leaf not in self.items:
            self.items[leaf] = self.writer.graph.call_function(operator.getitem, (self.node, leaf))
        return self.items[leaf]


class _Lookup:
    def __init__(self, get: Callable[[int], Any]) -> None:
        self.get = get

    def __getitem__(self, where: int) -> Any:
        return self.get(where)


def _compile(key: tuple, graph: torch.fx.Graph, backend: Any) -> _Compiled:
    if key in _compiled:
        _compiled.move_to_end(key)
        return _compiled[key]
    call = _compiled[key] = _Compiled(torch.fx.GraphModule(torch.nn.Module(), graph), backend)
    if len(_compiled) > _COMPILED_KEPT:
        _compiled.popitem(last=False)
    return call


class _Compiled:
    """A refill's graph, compiled at its first call, or run op by op where the compiler failed.

    The backend is handed the graph directly, as dynamo hands it the graphs it captures: the structural key
    already pins every input's layout, so dynamo's per-call guards (some 60 µs a call) would check nothing
    more.  If the compiler fails, a warning names the error once and the graph runs op by op from then on;
    an error while the compiled graph runs (out of memory) is the caller's.
    """

    def __init__(self, module: torch.fx.GraphModule, backend: Any) -> None:
        self.module, self.backend = module, backend
        self.compiled: Callable | None = None
        self.failed = False

    def __call__(self, *arguments: torch.Tensor) -> Any:
        if self.compiled is None and not self.failed:
            self.compiled = self._compile(list(arguments))
        if self.compiled is not None:
            return self.compiled(*arguments)
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return self.module.forward(*arguments)

    def _compile(self, arguments: list[torch.Tensor]) -> Callable | None:
        from torch._dynamo import lookup_backend  # loaded on first use: `import remat` stays light

        options = contextlib.nullcontext()
        if self.backend == "inductor":
            import torch._inductor.config as inductor_config

            options = inductor_config.patch(_INDUCTOR_OPTIONS)
        try:
            with options:
                return lookup_backend(self.backend)(self.module, arguments)
        except Exception as error:  # noqa: BLE001 - any compiler failure leaves the eager graph correct
            warnings.warn(f"remat: a fused rerun failed to compile ({type(error).__name__}: {error}); "
                          "this region's reruns run op by op", stacklevel=3)
            self.failed = True
            return None


_UNFIT = object()


def _frozen(value: Any) -> Any:
    """``value`` as a key (types kept: 1, 1.0 and True are different constants); ``_UNFIT`` if it cannot be."""
    if isinstance(value, (list, tuple)):
        items = tuple(_frozen(v) for v in value)
        return _UNFIT if any(i is _UNFIT for i in items) else (type(value), items)
    if isinstance(value, dict):
        items = tuple((k, _frozen(v)) for k, v in value.items())
        return _UNFIT if any(i is _UNFIT for _, i in items) else (dict, items)
    if isinstance(value, float):  # by its bits: 0.0 == -0.0, and nan != nan
        return (float, struct.pack("<d", value))
    if isinstance(value, complex):
        return (complex, struct.pack("<dd", value.real, value.imag))
    if isinstance(value, _CONSTANTS):
        return (type(value), value)
    return _UNFIT


def _flat_returns(op: Any) -> bool:
    """Whether the op's outputs flatten to its returns in order (no list among several returns)."""
    returns = op._schema.returns
    return len(returns) == 1 or not any(_is_list_type(r.type) for r in returns)


def _is_list(op: Any) -> bool:
    return _is_list_type(op._schema.returns[0].type)


def _is_list_type(kind: Any) -> bool:
    return isinstance(kind, torch.ListType)


def _leaf(out: Any, leaf: int) -> Any:
    return out if isinstance(out, torch.Tensor) else tree_flatten(out)[0][leaf]


def _source(ref: Ref, inputs: Sequence[torch.Tensor], program: _Program, served: dict[int, Any]) -> torch.Tensor:
    kind, where, leaf = ref
    if kind == _STEP:
        return _leaf(served[where], leaf)
    return inputs[where] if kind == _INPUT else program.state[where]()


def _autocast_off(tensors: Sequence[torch.Tensor]) -> contextlib.ExitStack:
    """Autocast off on every device it is on: the graph's ops ran below it in forward, casts included."""
    stack = contextlib.ExitStack()
    for device in {"cpu", *(t.device.type for t in tensors)}:
        if torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device, enabled=False))
    return stack
