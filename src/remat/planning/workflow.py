"""The planning front door: profile a model, plan for a budget.

:func:`profile` measures one training step (memory timeline, per-block prices, op graphs) and returns a
:class:`Profile`, whose :meth:`Profile.plan` solves for any budget without measuring again; :func:`plan`
does both in one call.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import nn

from ..api.sequential import checkpointed_runs
from .basics.discovery import chain_links, resolve_blocks
from .basics.fakeworld import fake_ranks, meta_sharded
from .basics.inputs import describe_inputs
from .basics.kvcache import cache_off
from .basics.metadata import MetaData, MetaKernels, MetaLayouts, NeedsRealData
from .basics.ranks import Ranks, mesh_of, unverified_settings
from .basics.units import Budget, parse_budget
from .basics.untouched import left_as_found
from .basics.userline import user_stacklevel
from .choices.options import DEFAULT_ALLOW, offloads_note, unavailable_offloads
from .choices.partitioned import PARTITIONED
from .measure.gathers import partitioned_inputs
from .measure.interconnect import DEFAULT_BANDWIDTH, DEFAULT_LATENCY, Interconnect
from .measure.profile import StepProfile, default_loss, measure
from .measure.timecache import measuring_afresh
from .solve.alternatives import plan_for
from .solve.head import (
    NOT_ON_META,
    HeadOption,
    alternatives_with_head,
    head_applies,
    measure_head,
    plan_with_head,
    price_with_head,
)
from .solve.plan import Plan, describe_model
from .solve.refusal import InfeasibleBudget
from .solve.rulefront import Front, front

__all__ = ["Profile", "SummedLossWarning", "check_inputs", "forward_mismatch", "plan", "profile", "refuse_checkpointed"]

_WRAPPED = "_checkpoint_wrapped_module"  # where remat's and torch's checkpoint wrappers hold the module they wrap


class SummedLossWarning(UserWarning):
    """No ``loss_fn`` was given and the model's output has no ``.loss``: the profile backpropagates the sum
    of the output's floating tensors.  ``labels_missing``: the output has an empty ``loss`` field, as a
    Hugging Face model called without ``labels`` returns."""

    def __init__(self, message: str, labels_missing: bool) -> None:
        super().__init__(message)
        self.labels_missing = labels_missing


@dataclass
class Profile(StepProfile):
    """The result of :func:`profile`: what one step keeps per block, and the prices of each option.

    ``model_meta`` is what was profiled (:func:`~remat.planning.solve.plan.describe_model`); plans made from this
    profile carry it in ``Plan.meta`` and check it when applied.

    Example:
        >>> prof = remat.profile(model, input_ids=ids, labels=ids)
        >>> print(prof); plan = prof.plan("50%")
    """

    model_meta: dict[str, Any] = field(default_factory=dict)
    head: HeadOption | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON; the chunked head's option as its chunk count, peak and extra time."""
        out = StepProfile.to_dict(replace(self, head=None))
        out["head"] = None if self.head is None else {
            "chunks": self.head.chunks, "peak_bytes": self.head.profile.peak_bytes, "extra_time": self.head.extra_time}
        return out

    def plan(self, budget: Budget | int | float | str, allow: Sequence[str] | None = None) -> Plan:
        """The cheapest plan for ``budget`` from this profile: no new measurement, milliseconds.

        ``budget`` as in :func:`remat.plan` (``"50%"``, ``0.5``, ``"8GiB"``, bytes).  ``allow``: the options a
        block may take besides ``keep`` (default: all of them, see :func:`remat.plan`).

        Example:
            >>> prof = remat.profile(model, input_ids=ids, labels=ids)
            >>> plans = {b: prof.plan(b) for b in (0.3, 0.5, 0.7)}
        """
        with self._no_head_told():
            made = plan_with_head(self, self.head, budget, allow)  # a refusal says it in its line
        _warn_unavailable(self, allow)
        return self._for_this_model(made)

    def alternatives(self, budget: Budget | int | float | str, count: int = 5,
                     allow: Sequence[str] = DEFAULT_ALLOW) -> list[Plan]:
        """Up to ``count`` distinct plans that fit ``budget``, cheapest predicted first, the first being
        :meth:`plan`'s: the runners-up a run on a machine whose timings moved might pick, to check them all
        (:func:`~remat.planning.solve.alternatives.plans_near`, with the chunked head's timeline too where the profile
        has one: :mod:`remat.planning.solve.head`).

        Example:
            >>> for p in prof.alternatives("50%", count=3):
            ...     assert remat.check_plan(model, p, x, loss_fn=loss_fn).holds
        """
        with self._no_head_told():
            made = alternatives_with_head(self, self.head, budget, count, allow)
        _warn_unavailable(self, allow)
        return [self._for_this_model(p) for p in made]

    def price(self, decisions: Mapping[str, str], segments: Sequence[Sequence[str]] = (), head: bool = False) -> Plan:
        """The plan that takes ``decisions`` (block name to option; blocks not named are kept) and runs each of
        ``segments`` as one region, with its predicted peak and extra time
        (:func:`~remat.planning.solve.alternatives.plan_for`); ``head=True``: with the output layer and loss in
        chunks as well, as the profile's chunked-head plans have it (``self.head``).

        Example:
            >>> every_other = prof.price({"blocks.0": "checkpoint", "blocks.2": "checkpoint"})
            >>> every_other.predicted_peak, every_other.predicted_extra_time
        """
        made = price_with_head(self, self.head, decisions, segments) if head else plan_for(self, decisions, segments)
        return self._for_this_model(made)

    @contextlib.contextmanager
    def _no_head_told(self) -> Iterator[None]:
        """A refusal says the chunked head was not considered where the profile notes so (the meta device)."""
        try:
            yield
        except InfeasibleBudget as refused:
            if NOT_ON_META in self.notes:
                refused.args = (f"{refused.args[0]} {NOT_ON_META[0].upper()}{NOT_ON_META[1:]}.", *refused.args[1:])
            raise

    def _for_this_model(self, made: Plan) -> Plan:
        made.meta = {**self.model_meta, **made.meta}
        return made

    def front(self, budgets: Sequence[Budget | int | float | str] = (), allow: Sequence[str] | None = None) -> Front:
        """remat's plans beside the rules people checkpoint by (every-k spread for each n, every block,
        offloaded inputs), each as predicted peak and extra time (:mod:`remat.planning.solve.rulefront`); remat's
        plans as :meth:`plan` makes them, with the chunked head where the profile has it.

        Example:
            >>> print(prof.front(budgets=("50%", "30%")))
        """
        _warn_unavailable(self, allow)
        return front(self, budgets, DEFAULT_ALLOW if allow is None else allow, self.head)


def _warn_unavailable(prof: StepProfile, allow: Sequence[str] | None) -> None:
    """One line where options asked for by name are not available to the blocks of ``prof`` and the others still
    plan (where none is, the options' builder refuses)."""
    if allow is None or tuple(allow) == DEFAULT_ALLOW:
        return
    left = [o for o in allow if o not in unavailable_offloads(prof, allow)]
    if left and len(left) < len(allow):
        warnings.warn(f"remat.plan: {offloads_note(prof, allow)[:-1]}; planning with {', '.join(left)} only.",
                      stacklevel=user_stacklevel())


def profile(
    model: nn.Module,
    *example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    modules: Sequence[str] | None = None,
    device: str | None = None,
    throughput: float = 100e12,
    interconnect_bandwidth: float = DEFAULT_BANDWIDTH,
    interconnect_latency: float = DEFAULT_LATENCY,
    repeats: int = 5,
    ops: bool = True,
    fresh_timings: bool = False,
    hold_output: bool = True,
    **example_kwargs: Any,
) -> Profile:
    """Profile training steps of ``model(*example_inputs, **example_kwargs)`` (no checkpointing).

    ``loss_fn(output)`` turns the output into a scalar (default: the output's ``.loss``, as Hugging Face
    models return when given ``labels=``, or else the sum of its floating tensors, with a
    :class:`SummedLossWarning`).  Gradients are left as they were before the call.  Times are on the device's
    clock, medians over ``repeats`` rounds, and every option is priced from each block's op graph
    (:func:`remat.profile_ops`); ``ops=True`` keeps the graphs in ``.ops``, from which plans draw their op-level
    ``selective`` options.  Measured times are kept per machine and reused by later profiles of the same blocks
    (:mod:`remat.planning.measure.timecache`), so the same model, inputs and budget give the same plan from one run to
    the next; ``fresh_timings=True`` measures again.  A Hugging Face model with ``use_cache=True`` is
    profiled with the cache off, as transformers trains with gradient checkpointing (one warning; its config
    is left as it was).

    ``hold_output``: the step measured keeps the model's output (a causal LM's logits) alive until backward ends,
    as ``out = model(x); loss = out.loss; loss.backward()`` does, and so do the peaks predicted for plans made from
    the profile (``Plan.hold_output`` records it; :func:`remat.check_plan` trains that way).  ``False``: the output
    dies once the loss is computed, as in ``loss_fn(model(x)).backward()``; a peak lower by what the output holds
    after the loss.

    ``device="meta"`` profiles without allocating: build the model and the inputs on the meta device
    (``with torch.device("meta"): model = ...``); bytes are those the same step keeps on the CPU (attention runs
    the kernel the CPU picks), times are FLOPs
    (``torch.utils.flop_counter``) divided by ``throughput`` (FLOP/s of the target accelerator).  Yes/no
    checks a model makes on its data (transformers' "packed? padded?") are taken as the ordinary case
    (:class:`~remat.planning.basics.metadata.MetaData`, listed in ``.notes``); a model that needs its data's
    values is refused with a :class:`~remat.planning.basics.metadata.NeedsRealData` saying where.  A model
    sharded by FSDP2 in :func:`remat.fake_world` (N ranks, this process rank 0) profiles there as one rank of N.
    A collective (a tensor-parallel layer's all-reduce) costs there what crossing the ranks' interconnect costs,
    ``interconnect_latency + bus bytes / interconnect_bandwidth``, with nccl-tests' bus bytes per rank (an
    all-reduce's ``2 (n - 1) / n`` of its tensor, an all-gather's or reduce-scatter's ``(n - 1) / n`` of the whole
    tensor, ``n`` ranks; :mod:`~remat.planning.measure.interconnect`): ``interconnect_bandwidth`` is what each rank's
    link carries (default 200e9 B/s: NVLink-class, as nccl-tests measures an A100 node), ``interconnect_latency``
    the seconds every collective costs (default 10e-6).  Off the meta device collectives are timed as they run.

    Example:
        >>> prof = remat.profile(model, input_ids=ids, labels=ids)       # a Hugging Face model
        >>> prof = remat.profile(gpt, tokens, loss_fn=lambda logits: ...)
        >>> print(prof); plan = prof.plan(0.5)
    """
    check_inputs(model, example_inputs, example_kwargs, "remat.profile")
    ranks = Ranks.of(model)
    model = ranks.model  # DDP: the module it wraps, whose step this rank runs alone (no collective)
    refuse_checkpointed(model, "remat.profile")
    ranks.agree("remat.profile", _what_is_profiled(model, example_inputs, example_kwargs, modules))
    if device not in (None, "meta"):
        raise ValueError(f"remat.profile: device must be None (the model's own) or 'meta', got {device!r}.")
    if repeats < 1:
        raise ValueError(f"remat.profile: repeats must be at least 1, got {repeats}.")
    interconnect = Interconnect(interconnect_bandwidth, interconnect_latency)  # refuses a bad value in one line
    if device != "meta" and (interconnect_bandwidth, interconnect_latency) != (DEFAULT_BANDWIDTH, DEFAULT_LATENCY):
        warnings.warn("remat.profile: interconnect_bandwidth and interconnect_latency price collectives on the meta "
                      "device only; this profile times them on the process group (leave them out, or pass "
                      "device='meta').", stacklevel=user_stacklevel())
    blocks = resolve_blocks(model, modules)
    names = [name for name, _ in blocks]
    links = chain_links(model, names)
    on_meta = MetaData() if device == "meta" else None
    with (cache_off(model, example_kwargs, "remat.profile") as kwargs, on_meta or contextlib.nullcontext(),
          MetaKernels() if on_meta is not None else contextlib.nullcontext(),
          MetaLayouts() if on_meta is not None else contextlib.nullcontext(),
          meta_sharded(model),
          measuring_afresh(fresh_timings), left_as_found(model),
          _forwards_run(model, {name.rpartition(".")[0] for name, link in zip(names, links) if link}) as ran):
        try:
            measured = measure(model, example_inputs, kwargs, blocks, loss_fn or _summed_loss_warned(model), device,
                               throughput, repeats, hold_output, interconnect)
        except (RuntimeError, NotImplementedError) as error:
            if on_meta is None or "meta" not in str(error).lower():
                raise
            first_line = (str(error).strip().splitlines() or [""])[0]
            raise NeedsRealData(
                f"{on_meta.who}: {type(model).__name__} needs the values of its data, which meta tensors do not "
                f"have ({type(error).__name__}: {first_line}); profile it on real tensors instead, with a smaller "
                "batch or sequence (activation bytes scale with them).") from error
        # a tensor-parallel block's inputs kept as shards: which, and their all-gathers timed on every rank (on meta:
        # priced over the interconnect)
        measured.partitioned = partitioned_inputs(model, blocks, lambda: model(*example_inputs, **kwargs), ranks,
                                                  interconnect)
        # the output layer and loss over token chunks: one more instrumented step (a causal LM with labels)
        chunkable = on_meta is None and ranks.chunked_head
        head = None if not chunkable else measure_head(model, example_inputs, kwargs, blocks, loss_fn is not None,
                                                       measured, repeats)
    modules = dict(blocks)
    for row in measured.rows:
        if row.writes_input and row.name in modules:  # the refusal's advice: build these with inplace=False
            row.in_place_layers = tuple(".".join(filter(None, (row.name, path)))
                                        for path, layer in modules[row.name].named_modules()
                                        if getattr(layer, "inplace", None) is True)
    # a segment's container must run its children itself: one its parent iterates never runs its forward
    measured.links = [link and name.rpartition(".")[0] in ran for name, link in zip(names, links)]
    # The shapes travel with every plan from this profile: its predictions hold at them (Plan.apply checks).
    model_meta = {**describe_model(model, names), "inputs": describe_inputs(example_inputs, example_kwargs)}
    result = Profile(**{f.name: getattr(measured, f.name) for f in fields(measured)}, model_meta=model_meta,
                     head=head)
    if head is not None:
        head.profile.links, head.profile.partitioned = measured.links, measured.partitioned
    if not ops:  # the op graphs priced the options; kept only when plans may draw selective options from them
        result.ops = None
        if head is not None:
            head.profile.ops = None
    if on_meta is not None and head_applies(model, example_inputs, kwargs, loss_fn is not None):
        result.notes.append(NOT_ON_META)
    if on_meta is not None and on_meta.answered:
        result.notes.append(f"on the meta device, the data checks at {', '.join(on_meta.answered)} were taken as "
                            "true (the ordinary case: for transformers' masks, sequences neither packed nor padded)")
    if fake_ranks():
        result.notes.append(f"rank 0 of a fake world of {fake_ranks()} ranks (remat.fake_world): peaks are one rank's")
    for line in unverified_settings(model):
        warnings.warn(f"remat.profile: {line}.", stacklevel=user_stacklevel())
        result.notes.append(line)
    # trained by several ranks: rank 0's timings on every rank, one plan everywhere
    return ranks.same(ranks.per_rank(result))


def _what_is_profiled(model: nn.Module, args: tuple, kwargs: dict[str, Any], modules: Sequence[str] | None
                      ) -> dict[str, Any]:
    """What every rank must profile alike: the model (whole shapes: FSDP2's are its sharded parameters'),
    the inputs' shapes and the blocks asked for."""
    params = [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()]
    return {"the model": describe_model(model, [])["model"],
            "parameters": f"{len(params)} tensors, {sum(math.prod(s) for _, s, _ in params)} elements",
            "inputs": describe_inputs(args, kwargs), "the blocks asked for": modules, "the mesh": mesh_of(model)}


def check_inputs(model: Any, args: tuple, kwargs: dict[str, Any], who: str = "remat.profile") -> None:
    """Raise TypeError, in one line naming ``who``, if ``model(*args, **kwargs)`` cannot be a model's step:
    ``model`` is not a Module, an input is a NumPy array, a positional input is a dict of the forward's keyword
    arguments (a batch not unpacked), or the inputs do not fit the forward's signature.

    Example:
        >>> check_inputs(model, (ids,), {"labels": ids})
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who}: the model must be a torch.nn.Module, got {type(model).__name__}; wrap a function in "
                        "a Module whose forward calls it.")
    name = type(model).__name__
    for where, value in [*((f"input {i}", v) for i, v in enumerate(args)), *kwargs.items()]:
        if type(value).__module__ == "numpy":
            raise TypeError(f"{who}: {where} is a NumPy {type(value).__name__}; pass tensors, e.g. "
                            "torch.from_numpy(array).")
    parameters = _forward_parameters(model)
    for index, value in enumerate(args):
        if isinstance(value, dict) and value and parameters and set(value) <= set(parameters):
            raise TypeError(f"{who}: input {index} is a dict of {name}.forward's keyword arguments "
                            f"({', '.join(map(str, value))}); unpack it: {who}(model, **batch).")
    problem = forward_mismatch(model, args, kwargs)
    if problem:
        raise TypeError(f"{who}: {problem}; pass the inputs as the forward takes them, positional first and the rest "
                        f"by name ({who}(model, x, mask=mask)).")


def refuse_checkpointed(model: nn.Module, who: str = "remat.profile") -> None:
    """Raise ValueError, in one line naming ``who``, if ``model``'s blocks already checkpoint: a profile would
    see the step with checkpointing, in which no option frees memory.  Names what checkpoints and how to turn
    it off: remat's or torch's checkpoint wrappers, a plan's segments, transformers' gradient checkpointing
    (``gradient_checkpointing_enable``, ``remat.enable``, ``Trainer``).

    Example:
        >>> refuse_checkpointed(model, "remat.plan")
    """
    wrapped = [name for name, m in model.named_modules() if _WRAPPED in m._modules or checkpointed_runs(m)]
    flagged = [name for name, m in model.named_modules() if getattr(m, "gradient_checkpointing", None) is True]
    flagged = [name for name in flagged if not any(other.startswith(f"{name}.") for other in flagged)]  # the layers
    name = type(model).__name__
    if wrapped:
        torch_s = any(type(m).__module__.startswith("torch.") for m in model.modules() if _WRAPPED in m._modules)
        whose = "torch's checkpoint_wrapper" if torch_s else "remat's checkpoint/offload wrappers or a plan"
        raise ValueError(
            f"{who}: {_some(wrapped)} of {name} already checkpoint ({whose}), so a profile would see a step in which "
            "no option frees more; profile the model without them (plan.remove(model) for a plan's; build it without "
            "checkpoint_wrapper / apply_activation_checkpointing otherwise): the plan does the checkpointing.")
    if flagged:
        switch = ("activation_checkpointing_disable" if hasattr(type(model), "activation_checkpointing_disable")
                  else "gradient_checkpointing_disable")
        raise ValueError(
            f"{who}: {name} has transformers' gradient checkpointing on ({_some(flagged)}; turned on by "
            "activation_/gradient_checkpointing_enable, remat.enable or Trainer), so a profile "
            f"would see a step in which no option frees more; call model.{switch}() first, then plan and apply the "
            "plan instead: it does the checkpointing.")


def _some(names: list[str]) -> str:
    return names[0] + (f" and {len(names) - 1} more" if len(names) > 1 else "")


def forward_mismatch(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> str:
    """Why ``model(*args, **kwargs)`` does not fit ``model.forward``'s signature, in a phrase naming the forward
    and the argument ('' if it fits or the signature cannot be read).

    Example:
        >>> forward_mismatch(model, (x,), {})
        "Masked.forward(x, mask) is missing a required argument: 'mask'"
    """
    if model._forward_pre_hooks:  # a pre-hook may supply or change arguments: the call itself will tell
        return ""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # no readable signature: the call itself will tell
        return ""
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        shown = ", ".join(signature.parameters)
        reason = str(error).replace("missing a required", "is missing a required")
        verb = "" if reason.startswith("is ") else "cannot take these inputs: "
        return f"{type(model).__name__}.forward({shown}) {verb}{reason}"
    return ""


def _forward_parameters(model: nn.Module) -> list[str]:
    try:
        return list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return []
@contextlib.contextmanager
def _forwards_run(model: nn.Module, containers: set[str]) -> Iterator[set[str]]:
    """The names among ``containers`` whose own forward ran inside the ``with`` block."""
    ran: set[str] = set()
    named = dict(model.named_modules())
    handles = [named[name].register_forward_pre_hook(lambda *_, name=name: ran.add(name)) for name in containers]
    try:
        yield ran
    finally:
        for handle in handles:
            handle.remove()


def _summed_loss_warned(model: nn.Module) -> Callable[[Any], torch.Tensor]:
    """:func:`default_loss`, warning on its first call if it has to sum the output (no ``.loss``)."""
    warned = False

    def loss(output: Any) -> torch.Tensor:
        nonlocal warned
        if not warned and not _carries_loss(output):
            warned = True
            name = type(model).__name__
            labels_missing = hasattr(output, "loss") or (isinstance(output, dict) and "loss" in output)
            if labels_missing:
                text = (f"remat.profile: {name} returned no loss (no labels were given) and no loss_fn was given, "
                        "so the profile backpropagates the sum of its outputs, not your training loss; pass "
                        "labels= (e.g. labels=input_ids) or loss_fn=.")
            else:
                text = (f"remat.profile: {name}'s output has no .loss and no loss_fn was given, so the profile "
                        "backpropagates the sum of its outputs; pass loss_fn= (e.g. lambda out: "
                        "F.cross_entropy(out, targets)) to profile your training loss.")
            warnings.warn(SummedLossWarning(text, labels_missing), stacklevel=user_stacklevel())
        return default_loss(output)

    return loss


def _carries_loss(output: Any) -> bool:
    if isinstance(getattr(output, "loss", None), torch.Tensor):
        return True
    return isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor)


def plan(
    model: nn.Module,
    *example_inputs: Any,
    budget: Budget | int | float | str,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    allow: Sequence[str] = DEFAULT_ALLOW,
    modules: Sequence[str] | None = None,
    hold_output: bool = True,
    **example_kwargs: Any,
) -> Plan:
    """Profile ``model(*example_inputs, **example_kwargs)`` and return the cheapest :class:`Plan` that fits.

    ``budget``: a fraction of the unplanned step's peak above the parameters (``0.5`` or ``"50%"``), or the
    whole step's peak as a size (``"8GiB"``, ``"512MB"``) or bytes (an int; 1 to 100 is refused: did you mean
    50%?); the ``remat`` command reads it the same way (:func:`~remat.planning.basics.units.parse_budget`).  ``allow``
    lists the options a block may take besides ``keep``: ``checkpoint``, ``save_matmuls``, ``selective``
    (op-level: keep chosen op outputs of the block, recompute the rest; needs one more forward to record the op
    graphs), ``offload`` (only considered on an accelerator) and ``checkpoint_partitioned`` (a tensor-parallel block's
    inputs kept as one shard per rank, all-gathered in backward; on a mesh under torchrun).  For several budgets,
    profile once and call ``prof.plan(budget)`` for each.  ``hold_output``: the training loop keeps the model's
    output until backward ends (the default) or lets go of it once the loss is computed, as in
    :func:`remat.profile`.  The plan records the model it was made for (``plan.meta``) and checks it when applied.

    Example:
        >>> p = remat.plan(model, input_ids=ids, labels=ids, budget="50%")   # Hugging Face: .loss is the loss
        >>> print(p)
        >>> p.apply(model)
    """
    budget = parse_budget(budget)  # a mistake in it is told before the profile runs
    check_inputs(model, example_inputs, example_kwargs, "remat.plan")
    Ranks.of(model).agree("remat.plan", {"the budget": str(budget)})
    refuse_checkpointed(model, "remat.plan")
    graphs = bool({"selective", PARTITIONED} & set(allow))  # the options drawn from the op graphs
    prof = profile(model, *example_inputs, loss_fn=loss_fn, modules=modules, ops=graphs, hold_output=hold_output,
                   **example_kwargs)
    return prof.plan(budget, allow)
