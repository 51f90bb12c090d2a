"""Switch a Hugging Face causal LM's output layer and loss to :func:`~remat.api.chunkedloss.chunked_lm_loss`.

``chunk_lm_head(model, chunks)`` gives the model an instance ``forward`` that, in training with ``labels``,
runs the model's own forward with ``logits_to_keep`` selecting no position (so its output layer and any
soft-capping run on zero tokens), takes the last hidden state from the base model, and computes the loss with
``chunked_lm_loss`` on the output layer's weight (tied or not) and bias, the config's
``final_logit_softcapping``, and the ``num_items_in_batch`` / ``shift_labels`` the call was given.  The
output's ``logits`` is then ``None``: the whole logits are never made.  Without labels, or in eval mode, the
model's forward runs unchanged.

Only the Hugging Face conventions are used (``get_output_embeddings``, ``base_model``, ``logits_to_keep``), no
import of transformers, so that plans (``remat.planning``) can install it too.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .chunkedloss import chunked_lm_loss

__all__ = ["chunk_lm_head", "lm_head_chunks", "lm_head_refusal", "unchunk_lm_head"]

_CHUNKS = "_remat_lm_head_chunks"
# Config fields of causal LMs whose forward changes the logits in ways the chunked loss does not repeat.
_UNSUPPORTED = {"logit_scale": "Cohere's logit_scale", "logits_scaling": "Granite's logits_scaling"}


def chunk_lm_head(model: nn.Module, chunks: int = 8) -> nn.Module:
    """Compute a Hugging Face causal LM's training loss over ``chunks`` token chunks; returns the model.

    In training mode with ``labels``, the output's ``loss`` is :func:`remat.chunked_lm_loss` of the last hidden
    state and ``logits`` is ``None``; otherwise the model's own forward runs.  With ``chunks=1`` the loss and
    gradients are bitwise the model's own.  Calling it again changes the chunk count;
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
    model.forward = types.MethodType(_chunked_forward, model)
    return model


def unchunk_lm_head(model: nn.Module) -> nn.Module:
    """Undo :func:`chunk_lm_head`: the model's own forward and loss again; returns the model.

    Example:
        >>> unchunk_lm_head(chunk_lm_head(model)) is model
        True
    """
    if hasattr(model, _CHUNKS):
        delattr(model, _CHUNKS)
        del model.forward
    return model


def lm_head_chunks(model: nn.Module) -> int | None:
    """The chunk count :func:`chunk_lm_head` set on ``model``, or None.

    Example:
        >>> lm_head_chunks(chunk_lm_head(model, 4))
        4
    """
    return getattr(model, _CHUNKS, None)


def lm_head_refusal(model: nn.Module) -> str:
    """Why :func:`chunk_lm_head` refuses ``model``, in one line naming the fix ('' if it accepts it).

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
    config = getattr(model, "config", None)
    for field, what in _UNSUPPORTED.items():
        if getattr(config, field, None) not in (None, 1, 1.0):
            return (f"chunk_lm_head: {name} scales its logits ({what}), which the chunked loss does not repeat; "
                    "train it without chunk_lm_head.")
    if getattr(config, "output_router_logits", False):
        return (f"chunk_lm_head: {name} adds a router loss to its output's loss; set "
                "config.output_router_logits = False or train it without chunk_lm_head.")
    return ""


def _chunked_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = type(self).forward
    bound = inspect.signature(forward).bind(self, *args, **kwargs)
    labels = bound.arguments.get("labels")
    if labels is None or not self.training:
        return forward(*bound.args, **bound.kwargs)
    bound.arguments["labels"] = None
    extra = bound.arguments.get(next(
        (p.name for p in inspect.signature(forward).parameters.values() if p.kind is p.VAR_KEYWORD), ""), {})
    hidden: list[torch.Tensor] = []
    # The base model's first output is the last hidden state (final norm included): what the head is given.
    hook = self.base_model.register_forward_hook(lambda module, inputs, output: hidden.append(output[0]))
    try:
        bound.arguments["logits_to_keep"] = torch.empty(0, dtype=torch.long, device=labels.device)
        output = forward(*bound.args, **bound.kwargs)
    finally:
        hook.remove()
    if not isinstance(output, Mapping):
        raise ValueError(f"chunk_lm_head: {type(self).__name__} returned a tuple; call it with return_dict=True "
                         "(the default), whose output has a loss field.")
    head = self.get_output_embeddings()
    shifted = extra.get("shift_labels")
    loss = chunked_lm_loss(
        hidden[-1], head.weight, labels if shifted is None else shifted, head.bias, chunks=getattr(self, _CHUNKS),
        ignore_index=extra.get("ignore_index", -100), num_items_in_batch=extra.get("num_items_in_batch"),
        softcap=getattr(self.config, "final_logit_softcapping", None), shift=shifted is None,
    )
    return type(output)(**{**{k: v for k, v in output.items() if k != "logits"}, "loss": loss})
