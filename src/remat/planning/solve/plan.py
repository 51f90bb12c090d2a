"""A plan: one decision per candidate block, as plain data that installs itself on a model.

:class:`Plan` carries each block's decision (and a selective block's op-level decisions), the predicted
peak and extra time, and what was planned for.  ``apply`` wraps the planned modules in place,
``remove`` undoes it, ``save``/``load`` round-trip it through JSON.

Blocks that a plan checkpoints together (a ``segment``: consecutive children of one ``nn.Sequential``, see
:mod:`remat.planning.choices.chain`) are listed in ``segments``; ``apply`` runs each as one region by giving their
container a forward that checkpoints the run (:func:`remat.api.sequential.checkpoint_runs`), so the blocks
stay where they are and ``state_dict`` keys do not change.

A plan made from a profile knows its model (``meta``, see :func:`describe_model`): the model's class, and
each planned block's class and parameter shapes.  ``apply`` checks the model against it before wrapping
anything, and warns about blocks like the planned ones that the plan leaves out.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from torch import nn

from ...api.chunkedhead import chunk_lm_head, lm_head_chunks, unchunk_lm_head
from ...api.modules import ActivationWrapper, checkpoint_wrapper, offload_wrapper
from ...api.sequential import checkpoint_runs, checkpointed_runs, remove_runs
from ...policies.rules import save_matmuls
from ...policies.schedule import schedule_hooks
from ..basics.blockpolicy import BlockPolicy
from ..basics.inputs import unwatch, watch_first_forward
from ..basics.kvcache import cache_off_in_training, restore_cache
from ..basics.ranks import mesh_of, original_class, unwrapped
from ..basics.units import format_bytes
from ..basics.userline import user_stacklevel
from ..choices.partitioned import PARTITIONED, partition_group, partitioned_wrapper

__all__ = ["Plan", "PlanFileError", "describe_model"]


class PlanFileError(ValueError):
    """A file given to :meth:`Plan.load` is not a plan :meth:`Plan.save` wrote; the message says why, in one line.

    Example:
        >>> try:
        ...     remat.Plan.load("notes.json")
        ... except remat.PlanFileError as error:
        ...     print(error)
    """


@dataclass
class Plan:
    """One decision per candidate module, with the predicted peak and extra time.

    ``decisions`` maps each module's qualified name to its option; a ``selective`` block's op-level
    decisions are in ``policies`` (``{"mode", "ops": [{"op", "call", "bytes", "decision"}, ...]}``, see
    :class:`~remat.planning.basics.blockpolicy.BlockPolicy`), and ``blocks`` holds what ``print(plan)`` shows per block.
    ``meta`` records the model it was made for (:func:`describe_model`), checked by :meth:`apply`.
    ``segments`` lists the runs of blocks checkpointed as one region each (their blocks' decision is
    ``"segment"``; ``blocks`` holds a run's summary under its first block).  ``head_chunks`` > 0: the output
    layer and loss are computed over that many token chunks (:func:`remat.chunk_lm_head`, a Hugging Face causal
    LM; :mod:`remat.planning.solve.head`).  ``copies``: where blocks move bytes to host memory, their copies' schedule
    (:class:`~remat.planning.choices.options.CopySchedule`: ``{"device", "ahead", "drains": {module: bytes},
    "ends": {module: bytes}, "last"}``): ``apply`` has those blocks prefetch ``ahead`` bytes, each module of
    ``drains`` wait, when its forward starts, until the copies in flight are within its bytes, each of ``ends`` when
    its forward ends (what the peak counts until the next block starts), and the ``last`` block wait for every copy
    when its forward ends (:mod:`remat.policies.schedule`).  ``hold_output``: the training loop the predicted
    peak assumes keeps the model's output alive until backward ends (``out = model(x); out.loss.backward()``, the
    default); False: it lets go of the output once the loss is computed (``loss_fn(model(x)).backward()``).  A
    plan file without it was made when profiles dropped the output, and loads as False.
    Everything is plain data: :meth:`save` writes it as JSON and :meth:`load` reads it back, ready to apply.

    Example:
        >>> p = prof.plan(0.5); p.save("plan.json")
        >>> remat.Plan.load("plan.json").apply(model)
    """

    decisions: dict[str, str]
    predicted_peak: int
    predicted_extra_time: float
    budget: int
    baseline_peak: int
    param_bytes: int
    step_time: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)
    policies: dict[str, dict[str, Any]] = field(default_factory=dict)
    blocks: dict[str, dict[str, Any]] = field(default_factory=dict)
    segments: list[list[str]] = field(default_factory=list)
    head_chunks: int = 0
    copies: dict[str, Any] = field(default_factory=dict)
    hold_output: bool = True

    def __post_init__(self) -> None:
        self._wrappers: dict[str, Callable[[nn.Module], nn.Module]] = {}  # per module: installers of custom options

    @property
    def collectives_rerun(self) -> int:
        """How many collectives (a tensor-parallel block's all-reduces) the plan's recomputations send again in
        each step's backward, beyond those backward runs anyway: 0 where every recomputed block keeps what
        crossed the wire.

        Example:
            >>> plan.collectives_rerun
            0
        """
        return sum(block.get("collectives", 0) for block in self.blocks.values())

    def _installer(self, name: str, decision: str, group: Any = None) -> tuple[Callable[[nn.Module], nn.Module], Any]:
        """How to install ``name``'s decision, and what identifies it (to skip modules already installed);
        ``group``: the model's tensor-parallel group, where blocks keep their inputs as shards over it."""
        if decision == PARTITIONED:  # its op-level policy keeps the collective outputs its recomputation reaches
            policy = BlockPolicy.from_dict(self.policies[name]) if name in self.policies else None
            return partitioned_wrapper(group, policy), (decision, self.policies.get(name))
        if name in self.policies:
            policy = BlockPolicy.from_dict(self.policies[name])
            if self.copies.get("ahead") and policy.mode == "keep" and policy.offloaded_bytes:  # back ahead by bytes
                ahead = self.copies["ahead"]
                return (lambda m: policy.wrap(m, prefetch_bytes=ahead, in_flight=math.inf),
                        (decision, policy.to_dict(), ahead))
            return policy.wrap, (decision, policy.to_dict())
        wrap = self._wrappers.get(name) or _WRAPPERS.get(decision)
        if wrap is None:
            raise ValueError(f"remat.Plan.apply: no way to install {decision!r} on `{name}`: a plan loaded from "
                             "JSON knows only the built-in options and op-level policies; rebuild it from the "
                             "profile and options.")
        return wrap, (decision, None)

    def apply(self, model: nn.Module) -> nn.Module:
        """Wrap the planned modules in place (idempotent; a changed plan re-wraps). Returns ``model``.

        The model is checked against the one the plan was made for before anything is wrapped: a model of
        another class, a planned block missing or of another class or parameter shape is refused (ValueError),
        and blocks like the planned ones that the plan does not cover are named in a warning.  A Hugging Face
        model's training-mode forwards then run with ``use_cache=False``, as transformers trains with gradient
        checkpointing (:func:`~remat.planning.basics.kvcache.cache_off_in_training`; :meth:`remove` undoes it).

        Segments are installed on their ``nn.Sequential`` (:func:`~remat.api.sequential.checkpoint_runs`): its
        own forward is replaced by one that runs each segment as one region.

        Example:
            >>> plan.apply(model)
        """
        self.check(model)
        given, model = model, unwrapped(model)  # DDP's module: the names and classes are those of the model itself
        group = partition_group(model, self.decisions)  # the model's own, found now: a group is no plain data
        _remove_drains(model, self.decisions)
        if any(decision != "keep" for decision in self.decisions.values()):
            cache_off_in_training(model)  # a checkpointed layer cannot rebuild a KV cache
        if self.head_chunks:  # first: its probe runs a forward that is not the user's first
            chunk_lm_head(model, self.head_chunks)
        elif lm_head_chunks(model) is not None:
            unchunk_lm_head(model)
        if self.meta.get("inputs"):
            watch_first_forward(model, self.meta["inputs"])  # the predictions hold at the profiled shapes only
        in_segments = {name for run in self.segments for name in run}
        for name, decision in self.decisions.items():
            parent, child, current = _locate(model, name)
            wrapped = isinstance(current, ActivationWrapper)
            inner = current._checkpoint_wrapped_module if wrapped else current
            if decision == "keep" or name in in_segments:  # a segment's blocks run plainly inside its region
                setattr(parent, child, inner)
                continue
            wrap, identity = self._installer(name, decision, group)
            if wrapped and getattr(current, "_remat_decision", None) == identity:
                continue
            inner._remat_path = name
            wrapper = wrap(inner)
            wrapper._remat_decision = identity
            setattr(parent, child, wrapper)
        for container_name, container in self._containers(model).items():
            runs = [_positions(container, run) for run in self.segments if run[0].rpartition(".")[0] == container_name]
            if checkpointed_runs(container) == runs:
                continue
            if runs:
                checkpoint_runs(container, runs, container_name)
            else:
                remove_runs(container)
        if self.copies:
            drains = self.copies["drains"]
            ends = {**self.copies.get("ends", {}), self.copies["last"]: 0}
            for name in {*drains, *ends}:
                module = _locate(model, name)[2]
                module._remat_schedule = schedule_hooks(module, self.copies["device"], before=drains.get(name),
                                                        after=ends.get(name))
        return given

    def _containers(self, model: nn.Module) -> dict[str, nn.Module]:
        """The modules holding the planned blocks, by name: where segments are installed."""
        found = {}
        for name in self.decisions:
            parent_name = name.rpartition(".")[0]
            if parent_name not in found:
                found[parent_name] = _unwrapped(_find(model, parent_name))
        return {name: container for name, container in found.items() if container is not None}

    def check(self, model: nn.Module) -> None:
        """Raise ValueError if this plan was made for another model; warn about blocks it leaves out.

        Example:
            >>> remat.Plan.load("plan.json").check(model)
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"remat.Plan.apply: expected the torch.nn.Module the plan was made for, got "
                            f"{type(model).__name__}; pass the model itself, e.g. plan.apply(model).")
        model = unwrapped(model)
        problem = _mismatch(self, model) or next(filter(None, (_run_problem(model, run) for run in self.segments)), "")
        if problem:
            raise ValueError(f"remat.Plan.apply: {problem}; plan this model (remat.plan or `remat plan`), or apply "
                             "the plan to the model it was made for.")
        left_out = [name for name in _same_kind(model, self.decisions) if name not in self.decisions
                    and name not in self.meta.get("candidates", ())]
        if left_out:
            shown = ", ".join(left_out[:4]) + (f" and {len(left_out) - 4} more" if len(left_out) > 4 else "")
            warnings.warn(f"remat.Plan.apply: the plan covers {len(self.decisions)} blocks and leaves out "
                          f"{len(left_out)} like them ({shown}), which stay unwrapped; make a plan for this model "
                          "to decide about them too.", stacklevel=user_stacklevel())

    def remove(self, model: nn.Module) -> nn.Module:
        """Undo :meth:`apply`. Returns ``model``.

        Example:
            >>> plan.remove(model)
        """
        given, model = model, unwrapped(model)
        _remove_drains(model, self.decisions)
        for name in self.decisions:
            parent, child, current = _locate(model, name)
            if isinstance(current, ActivationWrapper):
                setattr(parent, child, current._checkpoint_wrapped_module)
        for container in self._containers(model).values():
            remove_runs(container)
        if self.head_chunks:
            unchunk_lm_head(model)
        restore_cache(model)
        unwatch(model)
        return given

    def save(self, path: str) -> None:
        """Write the plan as JSON keyed by module qualified names.

        Example:
            >>> plan.save("plan.json")
        """
        with open(path, "w") as f:
            json.dump({f.name: getattr(self, f.name) for f in fields(self)}, f, indent=2)

    @classmethod
    def load(cls, path: str) -> Plan:
        """Read a plan written by :meth:`save`.  A file that is not one (truncated, another JSON file) is refused
        with a :class:`PlanFileError` naming the file and what is wrong; a missing file is a FileNotFoundError.

        Example:
            >>> remat.Plan.load("plan.json").apply(model)
        """
        with open(path, "rb") as f:
            raw = f.read()
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise PlanFileError(_not_a_plan(path, "not text")) from None
        except json.JSONDecodeError as error:
            if error.pos >= len(error.doc.rstrip()):
                reason = f"truncated JSON: it stops at line {error.lineno}"
            else:
                # json's messages may end in "at" ("Unterminated string starting at"): one "at" before the place
                reason = f"not JSON: {error.msg.removesuffix(' at')} at line {error.lineno}, column {error.colno}"
            raise PlanFileError(_not_a_plan(path, reason)) from None
        problem = _malformed(data)
        if problem:
            raise PlanFileError(_not_a_plan(path, problem))
        return cls(**{"hold_output": False, **data})  # older files: their profiles dropped the output

    def __str__(self) -> str:
        counts: dict[str, int] = {}
        starts = {run[0]: run for run in self.segments}
        inside = {name for run in self.segments for name in run[1:]}
        for name, decision in self.decisions.items():
            if name not in inside:
                counts[decision] = counts.get(decision, 0) + 1
        shown = {name: _run_name(starts[name]) if name in starts else name for name in self.decisions}
        width = max([len(n) for n in shown.values()] + [6])
        named = max([len(d) for d in self.decisions.values()] + [12])
        lines = [f"{'module':<{width}}  {'decision':<{named}} {'kept':>10} {'extra ms':>9} {'ops rerun':>9}  keeps",
                 "-" * (width + named + 48)]
        for name, decision in self.decisions.items():
            if name in inside:
                continue  # on its segment's row
            block = self.blocks.get(name, {})
            kept = format_bytes(block["kept"]) if "kept" in block else ""
            extra = f"{block['extra_time'] * 1e3:.1f}" if "extra_time" in block else ""
            rerun = str(block.get("recomputed_ops", ""))
            moved = (f"; offloads {format_bytes(block['offloaded'])}, copies "
                     f"+{block['copy_time'] * 1e3:.1f} ms unhidden" if block.get("offloaded") else "")
            run = f"{len(starts[name])} blocks as one region" if name in starts else ""
            lines.append(f"{shown[name]:<{width}}  {decision:<{named}} {kept:>10} {extra:>9} {rerun:>9}  "
                         f"{run}{_kept_ops(self.policies.get(name))}{moved}".rstrip())
        summary = ", ".join(f"{count} {option}" + ("s" if option == "segment" and count > 1 else "")
                            for option, count in counts.items() if count)
        if self.segments:
            summary += f" ({sum(len(run) for run in self.segments)} blocks in segments)"
        if self.head_chunks:
            summary += f"; output layer and loss in {self.head_chunks} chunks"
        if self.copies:
            ahead = self.copies["ahead"]
            summary += (f"; copies bounded where {len(self.copies['drains'])} blocks start and where blocks end, "
                        "all out before the loss" + (f", back up to {format_bytes(ahead)} ahead" if ahead else ""))
        if PARTITIONED in counts:
            summary += ("; checkpoint_partitioned blocks keep their inputs as one shard per tensor-parallel rank, "
                        "all-gathered in backward")
        if self.collectives_rerun:
            sending = {name: block["collectives"] for name, block in self.blocks.items() if block.get("collectives")}
            rerun = ", ".join(f"{name} {count}" for name, count in list(sending.items())[:_LISTED])
            if len(sending) > _LISTED:  # a deep model's every block: its count, not a line of names
                counts = set(sending.values())
                rerun = (f"{counts.pop()} in each of {len(sending)} blocks" if len(counts) == 1 else
                         f"{rerun}, and {len(sending) - _LISTED} more blocks")
            why = f" ({self.meta['collectives']})" if "collectives" in self.meta else ""
            summary += (f"; recomputation sends {self.collectives_rerun} collectives again per step ({rerun}), "
                        f"communication priced with the recomputation{why}")
        above = self.predicted_peak - self.param_bytes
        base_above = self.baseline_peak - self.param_bytes
        lines.append(
            f"{summary}. Predicted peak {format_bytes(self.predicted_peak)} (budget {format_bytes(self.budget)}"
            + (f" = {self.meta['budget']}" if "budget" in self.meta else "") + "; "
            f"{format_bytes(above)} above parameters vs {format_bytes(base_above)} without a plan); "
            f"predicted extra time {self.predicted_extra_time * 1e3:.1f} ms per step"
            + (f" (+{self.predicted_extra_time / self.step_time:.0%})" if self.step_time else "")
            + (". Peaks are for a loop that holds the model's output until backward ends." if self.hold_output else
               ". Peaks are for a loop that lets go of the model's output once the loss is computed.")
        )
        return "\n".join(lines)


_LISTED = 4  # blocks print(plan) names in its line on collectives sent again

_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "decisions": dict, "predicted_peak": int, "predicted_extra_time": (int, float), "budget": int,
    "baseline_peak": int, "param_bytes": int, "step_time": (int, float), "meta": dict, "policies": dict,
    "blocks": dict, "segments": list, "head_chunks": int, "copies": dict, "hold_output": bool,
}


def _malformed(data: Any) -> str:
    """What makes JSON data not a saved :class:`Plan`, in a phrase ('' if it is one)."""
    if not isinstance(data, dict):
        kind = {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(data), "number")
        return f"a JSON {kind}, not an object"
    unknown = [name for name in data if name not in _FIELD_TYPES]
    if unknown:
        return f"unknown field {unknown[0]!r}"
    required = [f.name for f in fields(Plan) if f.name in _FIELD_TYPES and f.default is MISSING
                and f.default_factory is MISSING]
    missing = [name for name in required if name not in data]
    if missing:
        return f"no field {missing[0]!r}"
    for name, value in data.items():
        expected = _FIELD_TYPES[name]
        if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
            wanted = {dict: "an object", int: "an integer", list: "an array", bool: "true or false"}.get(expected,
                                                                                                      "a number")
            return f"field {name!r} is {json.dumps(value)[:20]}, not {wanted}"
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in data["decisions"].items()):
        return "'decisions' must map module names to options"
    if not all(isinstance(run, list) and run and all(isinstance(name, str) for name in run)
               for run in data.get("segments", [])):
        return "'segments' must list runs of module names"
    return ""


def _not_a_plan(path: str, reason: str) -> str:
    return (f"remat.Plan.load: {path} is not a remat plan ({reason}); make one with `remat plan ... -o {path}` "
            "or Profile.plan(...).save(path).")


def _run_name(run: list[str]) -> str:
    """A segment as its first block and the last one's own name: ``features.0..5``."""
    return f"{run[0]}..{run[-1].rpartition('.')[2]}"


def _positions(container: nn.Module, run: list[str]) -> tuple[int, int]:
    """The ``(start, stop)`` positions of a run of ``container``'s children."""
    order = list(container._modules)
    return order.index(run[0].rpartition(".")[2]), order.index(run[-1].rpartition(".")[2]) + 1


def _run_problem(model: nn.Module, run: list[str]) -> str:
    """Why ``run`` cannot be one region of ``model`` ('' if it can): its blocks must be consecutive children
    of one ``nn.Sequential`` that chains them with its own forward."""
    parent_name = run[0].rpartition(".")[0]
    container = _unwrapped(_find(model, parent_name))
    where = parent_name or "the model"
    if not isinstance(container, nn.Sequential) or type(container).forward is not nn.Sequential.forward:
        kind = type(container).__name__ if container is not None else "missing"
        return f"the plan's segment {_run_name(run)} needs {where} to be an nn.Sequential here (it is {kind})"
    order = list(container._modules)
    children = [name.rpartition(".")[2] for name in run]
    if any(name.rpartition(".")[0] != parent_name for name in run) or any(c not in order for c in children):
        return f"the plan's segment {_run_name(run)} is not a run of children of {where} here"
    first = order.index(children[0])
    if order[first:first + len(children)] != children:
        return f"the plan's segment {_run_name(run)} is not a run of consecutive children of {where} here"
    return ""


def _kept_ops(policy: dict[str, Any] | None, shown: int = 4) -> str:
    """The largest op outputs a selective policy keeps, as ``op#call``."""
    if not policy:
        return ""
    kept = sorted((d for d in policy["ops"] if d["decision"] == "keep"), key=lambda d: -d["bytes"])
    names = [f"{d['op'].split('.')[1]}#{d['call']}" for d in kept[:shown]]
    more = f" +{len(kept) - shown} more" if len(kept) > shown else ""
    return ", ".join(names) + more


def describe_model(model: nn.Module, blocks: Sequence[str]) -> dict[str, Any]:
    """What a plan for ``blocks`` of ``model`` was made for: the model's class, the blocks that could have
    been planned (the planned ones and their siblings of the same class), each planned block's class
    and parameter shapes, and the device mesh tensor parallel spread its parameters over
    (:func:`~remat.planning.basics.ranks.mesh_of`; None: one process's whole tensors).  Plain data, stored in
    :attr:`Plan.meta`.

    Example:
        >>> describe_model(remat.models.GPT(), ["blocks.0"])["blocks"]["blocks.0"]["class"]
        'remat.models.Block'
    """
    described = {}
    for name in blocks:
        block = _unwrapped(_find(model, name))
        described[name] = {"class": _class_name(block), "params": _shapes(block)}
    return {"model": _class_name(model), "candidates": _same_kind(model, blocks), "blocks": described,
            "mesh": mesh_of(model)}


def _class_name(module: nn.Module) -> str:
    cls = original_class(_unwrapped(module))
    return f"{cls.__module__}.{cls.__qualname__}"


def _short(class_name: str) -> str:
    return class_name.rpartition(".")[2]


def _shapes(module: nn.Module) -> dict[str, str]:
    return {name: "x".join(map(str, p.shape)) for name, p in module.named_parameters()}


def _unwrapped(module: nn.Module | None) -> nn.Module | None:
    return module._checkpoint_wrapped_module if isinstance(module, ActivationWrapper) else module


def _find(model: nn.Module, name: str) -> nn.Module | None:
    """The module at ``name`` (through checkpoint/offload wrappers), or None."""
    module: nn.Module | None = model
    for part in name.split(".") if name else ():
        module = _unwrapped(module)._modules.get(part)
        if module is None:
            return None
    return module


def _mismatch(plan: Plan, model: nn.Module) -> str:
    """The first difference between ``model`` and the one ``plan`` was made for, in a phrase ('' if none)."""
    made_for = plan.meta.get("model")
    if made_for and made_for != _class_name(model):
        return f"this plan was made for a {_short(made_for)} and the model is a {type(_unwrapped(model)).__name__}"
    if "mesh" in plan.meta and plan.meta["mesh"] != mesh_of(model):  # a per-rank plan: its bytes are one rank's
        made_on, here = _on(plan.meta["mesh"]), _on(mesh_of(model))
        return f"this plan was made for {made_on} and the model is {here.removeprefix('a model ')}"
    model_name = type(_unwrapped(model)).__name__
    for name in plan.decisions:
        block = _unwrapped(_find(model, name))
        expected = plan.meta.get("blocks", {}).get(name)
        if block is None:
            kind = f"{_short(expected['class'])} " if expected else ""
            return f"the plan's {kind}block `{name}` is not in this {model_name}{_count_hint(model, plan)}"
        if expected is None:
            continue
        if expected["class"] != _class_name(block):
            return f"block `{name}` is a {type(block).__name__} here and a {_short(expected['class'])} in the plan"
        shapes = _shapes(block)
        if shapes != expected["params"]:
            difference = _first_difference(shapes, expected["params"])
            return f"block `{name}` has other parameters than in the plan ({difference})"
    return ""


def _on(mesh: dict[str, Any] | None) -> str:
    """A model's device mesh in words."""
    if mesh is None:
        return "a model not tensor parallel (whole parameters on every rank)"
    names = f" ({', '.join(mesh['dims'])})" if mesh["dims"] else ""
    return f"tensor parallel on a mesh of shape {tuple(mesh['shape'])}{names} over {mesh['world size']} ranks"


def _count_hint(model: nn.Module, plan: Plan) -> str:
    """How many blocks like the planned ones the model has, when it has fewer than the plan."""
    present = [n for n in plan.decisions if _find(model, n) is not None]
    if not present:
        return ""
    found = _same_kind(model, present)
    kinds = list(dict.fromkeys(type(_unwrapped(_find(model, name))).__name__ for name in found))
    return f" (it has {len(found)} {'/'.join(kinds)} blocks, the plan {len(plan.decisions)})"


def _first_difference(here: dict[str, str], planned: dict[str, str]) -> str:
    for name in {**planned, **here}:
        if here.get(name) != planned.get(name):
            shape_here, shape_planned = here.get(name, "absent"), planned.get(name, "absent")
            return f"{name}: {shape_here} here, {shape_planned} in the plan"
    return ""


def _same_kind(model: nn.Module, blocks: Sequence[str]) -> list[str]:
    """The planned blocks and their siblings of the same class, in the model's order."""
    found: list[str] = []
    parents: dict[str, set[type]] = {}
    for name in blocks:
        block = _unwrapped(_find(model, name))
        if block is not None:
            parents.setdefault(name.rpartition(".")[0], set()).add(type(block))
    for parent_name, classes in parents.items():
        parent = _unwrapped(_find(model, parent_name))
        for child_name, child in parent.named_children():
            if type(_unwrapped(child)) in classes:
                found.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    return found


def _remove_drains(model: nn.Module, names: Sequence[str]) -> None:
    for name in names:
        current = _locate(model, name)[2]
        for module in (current, getattr(current, "_checkpoint_wrapped_module", None)):
            for handle in getattr(module, "_remat_schedule", ()):
                handle.remove()
            if hasattr(module, "_remat_schedule"):
                del module._remat_schedule


def _locate(model: nn.Module, name: str) -> tuple[nn.Module, str, nn.Module]:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(parent, ActivationWrapper):
        parent = parent._checkpoint_wrapped_module
    return parent, child, getattr(parent, child)


_WRAPPERS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "checkpoint": checkpoint_wrapper,
    "save_matmuls": lambda m: checkpoint_wrapper(m, policy=save_matmuls),
    "checkpoint_offload": lambda m: checkpoint_wrapper(m, offload_inputs=True),
    # every saved activation moves, as the option is priced (the wrapper's default keeps tensors under 1 MiB)
    "offload": lambda m: offload_wrapper(m, min_bytes=0),
}
