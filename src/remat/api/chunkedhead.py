"""Switch a Hugging Face causal LM's output layer and loss to :func:`~remat.api.chunkedloss.chunked_lm_loss`.

``chunk_lm_head(model, chunks)`` gives the model an instance ``forward`` that, in training with ``labels``,
runs the model's own forward with ``logits_to_keep`` selecting no position (so its output layer and any
soft-capping run on zero tokens), takes the last hidden state from the base model, and computes the loss with
``chunked_lm_loss`` on the output layer's weight (tied or not) and bias, the config's
``final_logit_softcapping``, and the ``num_items_in_batch`` / ``shift_labels`` the call was given.  The
output's ``logits`` is then ``None``: the whole logits are never made.  Without labels, or in eval mode, the
model's forward runs unchanged.

A model's loss is the chunked one only if its forward computes it from the output layer applied to the last
hidden state and nothing else: a logit multiplier, a dense layer before the output embedding or a router's
auxiliary loss make it another.  No list of model names keeps up with transformers, so the model proves it: a
*probe* runs its own forward and the chunked one on one row of at most 16 tokens of the call (the whole call
where it has tensors other than token ids, labels, masks and positions: images, audio), under ``no_grad``, from
the same random state, and compares the losses.  It runs when the head is installed (on a made-up batch) and
again on the first training call of each *call signature* (the argument names, the flags and other plain
values passed, the config, the loss function, the output layer's hooks), under ``torch.compile`` too; a call
whose loss differs is refused before anything is computed.  The probe leaves the random number generators and
the model's buffers as it found them, and runs through the model's own ``__call__``, so wrappers' hooks
(FSDP2's gathers) run as in training.  What else a forward reads (an attribute, a global) is not watched.

Only the Hugging Face conventions are used (``get_output_embeddings``, ``base_model``, ``logits_to_keep``), no
import of transformers, so that plans (``remat.planning``) can install it too.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import math
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..engine.buffers import RegionBuffers
from .chunkedloss import chunked_lm_loss

__all__ = ["chunk_lm_head", "lm_head_chunks", "lm_head_probing", "lm_head_refusal", "unchunk_lm_head"]

_CHUNKS = "_remat_lm_head_chunks"
_PROVEN = "_remat_lm_head_proven"  # the call signatures whose loss the probe showed to be the chunked one
_PROBING = "_remat_lm_head_probing"  # set while a probe runs through the model's own __call__
_PROBE_TOKENS = 16
# Relative difference allowed between the model's loss and the chunked one on the probe: a few float32 ulps
# (kernels on other shapes may round differently on accelerators); a changed loss differs by far more.
_PROBE_TOLERANCE = 1e-6
# Tensor arguments whose layout the probe knows, so it can cut them to its first tokens: (batch, tokens, ...)
# for all of them but cache_position (tokens,).
_SEQUENCE_ARGUMENTS = {"input_ids", "labels", "attention_mask", "position_ids", "token_type_ids", "inputs_embeds",
                       "shift_labels", "cache_position"}


class _Refused(ValueError):
    """A call whose loss is not the chunked one (raised by the probe, one line)."""


def chunk_lm_head(model: nn.Module, chunks: int = 8) -> nn.Module:
    """Compute a Hugging Face causal LM's training loss over ``chunks`` token chunks; returns the model.

    In training mode with ``labels``, the output's ``loss`` is :func:`remat.chunked_lm_loss` of the last hidden
    state and ``logits`` is ``None``; otherwise the model's own forward runs.  With ``chunks=1`` the loss and
    gradients are bitwise the model's own.  A model (or a call's arguments) whose own loss is not the chunked
    one is refused in one line, the model left as it was.  Calling it again changes the chunk count;
    :func:`unchunk_lm_head` undoes it.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = chunk_lm_head(LlamaForCausalLM(LlamaConfig(num_hidden_layers=2)), chunks=8).train()
        >>> model(input_ids=ids, labels=ids).loss.backward()
    """
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"chunk_lm_head: chunks must be a positive int, got {chunks!r}.")
    refusal = lm_head_refusal(model)
    if refusal:
        raise ValueError(refusal)
    setattr(model, _CHUNKS, chunks)
    _install_chunked_forward(model)
    return model


def unchunk_lm_head(model: nn.Module) -> nn.Module:
    """Undo :func:`chunk_lm_head`: the model's own forward and loss again; returns the model.

    Example:
        >>> unchunk_lm_head(chunk_lm_head(model)) is model
        True
    """
    if hasattr(model, _CHUNKS):
        delattr(model, _CHUNKS)
        installed = model.__dict__.pop("forward", None)
        if getattr(installed, "previous", None) is not None:  # a forward of the instance's own, as it was
            model.forward = installed.previous
    if hasattr(model, _PROVEN):
        delattr(model, _PROVEN)
    return model


def lm_head_chunks(model: nn.Module) -> int | None:
    """The chunk count :func:`chunk_lm_head` set on ``model``, or None.

    Example:
        >>> lm_head_chunks(chunk_lm_head(model, 4))
        4
    """
    return getattr(model, _CHUNKS, None)


def lm_head_probing(model: nn.Module) -> bool:
    """Whether ``model``'s forward now is :func:`chunk_lm_head`'s probe (on a made-up or cut batch), not a call
    of the user's: hooks that check the user's calls let it be.

    Example:
        >>> lm_head_probing(model)
        False
    """
    return bool(getattr(model, _PROBING, False))


def lm_head_refusal(model: nn.Module, *args: Any, **kwargs: Any) -> str:
    """Why :func:`chunk_lm_head` refuses ``model``, in one line naming the fix ('' if it accepts it).

    Beyond the model's structure, this runs the probe (see the module's notes): the model's own loss and the
    chunked one on one row of at most 16 tokens of the call ``model(*args, **kwargs)`` (a made-up batch when
    no call is given), under ``no_grad``, the random state and buffers left as they were.

    Example:
        >>> lm_head_refusal(torch.nn.Linear(4, 4))[:40]
        'chunk_lm_head: Linear is not a Hugging F'
    """
    name = type(model).__name__
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Linear) or getattr(model, "base_model", model) is model:
        return (f"chunk_lm_head: {name} is not a Hugging Face causal LM with an nn.Linear output layer; for your "
                "own model, compute the loss with remat.chunked_lm_loss(last_hidden_state, head.weight, labels).")
    if "logits_to_keep" not in inspect.signature(type(model).forward).parameters:
        return (f"chunk_lm_head: {name}.forward takes no logits_to_keep (transformers 4.50 on, most causal LMs), "
                "so its logits cannot be skipped; use remat.chunked_lm_loss on the base model's last hidden state.")
    if head.weight.is_meta:  # nothing to compute with: the first training call probes
        return ""
    if not args and not kwargs:
        ids = (torch.arange(_PROBE_TOKENS, device=head.weight.device) % head.out_features)[None]
        kwargs = {"input_ids": ids, "labels": ids}
    return _probe_through_call(model, args, kwargs)


def _install_chunked_forward(model: nn.Module) -> None:
    own = model.__dict__.get("forward")  # a wrapper's (accelerate's): put back by unchunk_lm_head
    model.forward = _ChunkedForward(model, own.previous if isinstance(own, _ChunkedForward) else own)


class _ChunkedForward:
    """The forward :func:`chunk_lm_head` installs on a model.

    It shows the signature of the class's forward (the Hugging Face Trainer keeps only the dataset columns that
    signature names), and it pickles as itself on the unpickled model (a bound method would be looked up again
    by name on the half-built copy, and find the class's forward).  ``previous``: the forward the instance had
    of its own before, if any.
    """

    def __init__(self, model: nn.Module, previous: Any = None) -> None:
        self.model, self.previous = model, previous

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _chunked_forward(self.model, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(types.MethodType(type(self.model).forward, self.model))

    def __reduce__(self) -> tuple:
        return _ChunkedForward, (self.model, self.previous)


def _probe_through_call(model: nn.Module, args: tuple, kwargs: dict) -> str:
    """Run the probe on the call ``model(*args, **kwargs)`` through the model's own ``__call__`` (its wrappers'
    hooks included), in training mode; the refusal or ''."""
    chunked = hasattr(model, _CHUNKS)
    if not chunked:
        setattr(model, _CHUNKS, 1)
        _install_chunked_forward(model)
    setattr(model, _PROBING, True)
    modes = [(module, module.training) for module in model.modules()]
    try:
        model.train()
        model(*args, **kwargs)
    except _Refused as refusal:
        return str(refusal)
    finally:
        for module, training in modes:
            module.training = training
        delattr(model, _PROBING)
        if not chunked:
            unchunk_lm_head(model)
    return ""


def _chunked_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = type(self).forward
    bound = inspect.signature(forward).bind(self, *args, **kwargs)
    labels = bound.arguments.get("labels")
    if labels is None or not self.training:
        return forward(*bound.args, **bound.kwargs)
    if torch.compiler.is_compiling():  # the proof runs eagerly: dynamo breaks the graph at it
        torch.compiler.disable(_prove)(self, bound)
    else:
        _prove(self, bound)
    if getattr(self, _PROBING, False):
        return None
    return _chunked_loss_output(self, bound, getattr(self, _CHUNKS))


def _prove(self: nn.Module, bound: inspect.BoundArguments) -> None:
    """Probe the call unless its signature was proven already (always while :func:`lm_head_refusal` probes);
    refuse it if its loss is not the chunked one.  Run eagerly under ``torch.compile`` too, so a compiled
    model's calls are proven as an eager model's are."""
    if bound.arguments["labels"].is_meta:  # nothing to compute with
        return
    probing = getattr(self, _PROBING, False)
    key = _call_key(self, bound)
    proven = self.__dict__.setdefault(_PROVEN, set())
    if probing or key not in proven:
        refusal = _probe(self, bound)
        if refusal:
            raise _Refused(refusal)
        proven.add(key)


def _chunked_loss_output(self: nn.Module, bound: inspect.BoundArguments, chunks: int) -> Any:
    """The model's output with the loss computed over ``chunks`` token chunks and no logits."""
    forward = type(self).forward
    labels = bound.arguments["labels"]
    extra = _arguments(bound)
    bound = _rebound(bound, labels=None,
                     logits_to_keep=torch.empty(0, dtype=torch.long, device=labels.device))
    hidden: list[torch.Tensor] = []
    # The base model's first output is the last hidden state (final norm included): what the head is given.
    hook = self.base_model.register_forward_hook(lambda module, inputs, output: hidden.append(output[0]))
    try:
        output = forward(*bound.args, **bound.kwargs)
    finally:
        hook.remove()
    if not isinstance(output, Mapping):
        raise ValueError(f"chunk_lm_head: {type(self).__name__} returned a tuple; call it with return_dict=True "
                         "(the default), whose output has a loss field.")
    head = self.get_output_embeddings()
    shifted = extra.get("shift_labels")
    loss = chunked_lm_loss(
        hidden[-1], head.weight, labels if shifted is None else shifted, head.bias, chunks=chunks,
        ignore_index=extra.get("ignore_index", -100), num_items_in_batch=extra.get("num_items_in_batch"),
        softcap=getattr(self.config, "final_logit_softcapping", None), shift=shifted is None,
    )
    return type(output)(**{**{k: v for k, v in output.items() if k != "logits"}, "loss": loss})


def _probe(self: nn.Module, bound: inspect.BoundArguments) -> str:
    """The model's own loss and the chunked one (one chunk) on a small cut of the call, from the same random
    state; a one-line refusal where they differ, else ''."""
    small = _probe_call(bound)
    forward = type(self).forward
    with torch.no_grad(), _state_kept(self):
        state = _rng_states(self)
        own = forward(*small.args, **small.kwargs)
        _set_rng_states(state)
        chunked = _chunked_loss_output(self, small, 1)
    own_loss = own.get("loss") if isinstance(own, Mapping) else None
    if not isinstance(own_loss, torch.Tensor):
        return (f"chunk_lm_head: {type(self).__name__} returned no loss for labels; train it without "
                "chunk_lm_head.")
    a, b = float(own_loss), float(chunked["loss"])
    if a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= _PROBE_TOLERANCE * max(abs(a), 1.0):
        return ""
    passed = _plain_arguments(bound)
    called = f" when called with {', '.join(passed)}" if passed else ""
    return (f"chunk_lm_head: {type(self).__name__}'s own loss{called} is not the output layer's cross-entropy "
            f"on the last hidden state (a probe: {a:.6g}, chunked {b:.6g}), so chunking would change it; train "
            f"it without chunk_lm_head{' or call it without those arguments' if passed else ''}.")


def _probe_call(bound: inspect.BoundArguments) -> inspect.BoundArguments:
    """The call cut to one row and, where every tensor argument's layout is known, its first 16 tokens; the
    labels are the row's tokens (the probe compares formulas, so every position should count)."""
    arguments = _arguments(bound)
    labels = arguments["labels"]
    tensors = {k: v for k, v in arguments.items() if isinstance(v, torch.Tensor)}
    mask = tensors.get("attention_mask")
    # other tensors (images, audio) relate to rows and tokens in the model's own ways: the call is probed whole
    if labels.dim() != 2 or not set(tensors) <= _SEQUENCE_ARGUMENTS or (mask is not None and mask.dim() != 2):
        return bound
    rows, tokens = labels.shape
    cut = min(tokens, _PROBE_TOKENS)
    small: dict[str, Any] = {}
    for name, value in tensors.items():
        if name == "cache_position":
            small[name] = value[:cut]
            continue
        if value.dim() >= 1 and value.shape[0] == rows:
            value = value[:1]
        if value.dim() >= 2 and value.shape[1] == tokens:
            value = value[:, :cut]
        small[name] = value
    ids = small.get("input_ids")
    shape = small["labels"].shape
    if isinstance(ids, torch.Tensor) and ids.shape == shape:
        targets = ids
    else:
        vocab = bound.arguments["self"].get_output_embeddings().out_features
        targets = torch.arange(math.prod(shape), device=labels.device).reshape(shape) % vocab
    small["labels"] = targets
    if "shift_labels" in small:
        small["shift_labels"] = nn.functional.pad(targets, (0, 1), value=-100)[..., 1:].contiguous()
    return _rebound(bound, **small)


def _call_key(model: nn.Module, bound: inspect.BoundArguments) -> tuple:
    """What decides whether a call's loss is the chunked one: the arguments' names, their plain values (flags,
    strings), the tensors' ranks, the config, the loss function and the output layer's hooks."""
    head = model.get_output_embeddings()
    return (
        tuple(sorted((name, _value_key(value)) for name, value in _arguments(bound).items())),
        id(head), tuple(head._forward_hooks), tuple(head._forward_pre_hooks),
        repr(sorted(vars(getattr(model, "config", object())).items())),
        _identity(getattr(model, "loss_function", None)),
    )


def _identity(value: Any) -> Any:
    """``value`` itself where it can be a key (a function), else its id (kept only for the call's duration)."""
    try:
        hash(value)
    except TypeError:
        return id(value)
    return value


def _value_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dim())
    if value is None or isinstance(value, bool | str | enum.Enum):
        return value
    return type(value).__name__  # numbers (num_items_in_batch changes every step) and objects by kind


def _plain_arguments(bound: inspect.BoundArguments) -> list[str]:
    """The call's flags and strings other than the defaults, as ``name=value`` (what a refusal names)."""
    parameters = bound.signature.parameters
    return [f"{name}={value!r}" for name, value in _arguments(bound).items()
            if isinstance(value, bool | str) and (name not in parameters or value != parameters[name].default)]


def _arguments(bound: inspect.BoundArguments) -> dict[str, Any]:
    """The call's arguments by name, those the forward's ``**kwargs`` gathered included (``self`` left out)."""
    var = _var_keyword(bound)
    named = {k: v for k, v in bound.arguments.items() if k not in ("self", var)}
    return {**named, **(bound.arguments.get(var, {}) if var else {})}


def _var_keyword(bound: inspect.BoundArguments) -> str | None:
    return next((p.name for p in bound.signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)


def _rebound(bound: inspect.BoundArguments, **values: Any) -> inspect.BoundArguments:
    """A copy of ``bound`` with ``values`` set (in the forward's ``**kwargs`` where it has no such parameter)."""
    arguments = dict(bound.arguments)
    var = _var_keyword(bound)
    extra = dict(arguments.get(var, {})) if var else {}
    for name, value in values.items():
        if name in bound.signature.parameters:
            arguments[name] = value
        else:
            extra[name] = value
    if var:
        arguments[var] = extra
    return inspect.BoundArguments(bound.signature, arguments)


def _rng_states(model: nn.Module) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
    devices = sorted({p.get_device() for p in model.parameters() if p.device.type == "cuda"})
    return torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in devices]


def _set_rng_states(states: tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]) -> None:
    cpu, accelerators = states
    torch.set_rng_state(cpu)
    for device, state in accelerators:
        torch.cuda.set_rng_state(state, device)


@contextlib.contextmanager
def _state_kept(model: nn.Module) -> Iterator[None]:
    """Run the body, then put back the random number generators and the buffers it wrote (a probe is no step)."""
    states = _rng_states(model)
    buffers = RegionBuffers.before_forward(model)
    try:
        yield
    finally:
        _set_rng_states(states)
        if buffers is not None:
            buffers.after_forward()
            buffers.restore()
