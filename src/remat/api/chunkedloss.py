"""A causal language model's output layer and loss, recomputed over token chunks.

``chunked_lm_loss(hidden, weight, labels)`` is ``cross_entropy(linear(hidden, weight).float(), labels)`` as
Hugging Face's causal-LM loss computes it (labels shifted by one, ``ignore_index``, the mean over the kept
tokens or the sum over ``num_items_in_batch``, optional logit soft-capping), without ever holding the whole
logits: forward computes each chunk's logits and loss and drops them; backward computes each chunk's logits
again and takes that chunk's share of the gradients.  At most one chunk's logits, their float32 copy and their
gradient are alive at once.

Numerics: each chunk runs the unchunked head's own ops (linear, soft-capping, ``.float()``, ``cross_entropy``
with a summed reduction, divided outside) on its rows, so with ``chunks=1`` the loss and every gradient are
bitwise those of the unchunked head.  With several chunks the per-chunk sums of the loss and of the weight's
gradient are added in a different order (the weight's in float32, then rounded to its dtype once): equal within
float tolerance, not bitwise.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["chunked_lm_loss", "chunked_tolerance", "shift_labels"]


def chunked_tolerance(dtype: torch.dtype) -> float:
    """How far a gradient (or loss) of several chunks may be from the unchunked one, relative to its largest
    magnitude: float32 1e-5, float64 1e-12, 16-bit floats (and autocast's bfloat16 matmuls) 2e-2.

    Example:
        >>> chunked_tolerance(torch.float32)
        1e-05
    """
    return {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 2e-2)


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Next-token targets as Hugging Face shifts them: position t predicts label t + 1, the last predicts nothing.

    Example:
        >>> shift_labels(torch.tensor([[5, 6, 7]]))
        tensor([[   6,    7, -100]])
    """
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()


def chunked_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    chunks: int = 8,
    ignore_index: int = -100,
    num_items_in_batch: int | torch.Tensor | None = None,
    softcap: float | None = None,
    shift: bool = True,
) -> torch.Tensor:
    """The cross-entropy loss of the logits ``hidden @ weight.T (+ bias)``, computed ``chunks`` tokens slices at a time.

    ``hidden`` is ``(..., tokens, features)`` (the last hidden state, before the output layer), ``labels``
    ``(..., tokens)``.  ``shift=True`` shifts ``labels`` as Hugging Face does (:func:`shift_labels`); pass
    ``shift=False`` with labels already aligned to ``hidden``.  The loss is the mean over labels that are not
    ``ignore_index``, or their sum divided by ``num_items_in_batch`` when given (Hugging Face's gradient
    accumulation normalization).  ``softcap`` applies ``softcap * tanh(logits / softcap)`` first (Gemma's
    ``final_logit_softcapping``).  Autocast applies as it would to the unchunked head.  ``weight`` may be tied to
    an embedding: its gradient adds to the embedding's as autograd does.

    Example:
        >>> hidden = torch.randn(2, 16, 32, requires_grad=True)
        >>> head = torch.nn.Linear(32, 100, bias=False)
        >>> labels = torch.randint(0, 100, (2, 16))
        >>> chunked_lm_loss(hidden, head.weight, labels, chunks=4).backward()
    """
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"chunked_lm_loss: chunks must be a positive int, got {chunks!r}.")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"chunked_lm_loss: labels {tuple(labels.shape)} must match hidden {tuple(hidden.shape)} without its "
            "last (feature) dimension."
        )
    if softcap is not None and softcap <= 0:
        raise ValueError(f"chunked_lm_loss: softcap must be positive (or None), got {softcap!r}.")
    if shift:
        labels = shift_labels(labels, ignore_index)
    flat_labels = labels.reshape(-1).to(hidden.device)
    total = _ChunkedCrossEntropySum.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, flat_labels,
                                          chunks, ignore_index, softcap)
    if num_items_in_batch is None:
        # cross_entropy's own mean divides its sum by the kept tokens' count as a float: the same division here.
        return total / (flat_labels != ignore_index).sum().to(total.dtype)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _head_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
              ignore_index: int, softcap: float | None) -> torch.Tensor:
    """One chunk's summed loss, by the unchunked head's ops in its order."""
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")


class _ChunkedCrossEntropySum(torch.autograd.Function):
    """The summed loss over chunks of rows; backward recomputes each chunk's logits to take its gradients."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor, chunks: int, ignore_index: int, softcap: float | None) -> torch.Tensor:
        device = hidden.device.type
        # The backward runs outside the caller's autocast: it reruns the chunks under the state seen here.
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.chunks, ctx.ignore_index, ctx.softcap = chunks, ignore_index, softcap
        ctx.save_for_backward(hidden, weight, bias, labels)
        total = None
        for rows, targets in zip(hidden.tensor_split(chunks), labels.tensor_split(chunks)):
            part = _head_sum(rows, weight, bias, targets, ignore_index, softcap)
            total = part if total is None else total + part
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, labels = ctx.saved_tensors
        wants_hidden, wants_weight, wants_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None
        grad_weight = grad_bias = None
        device, enabled, dtype = ctx.autocast
        start = 0
        for rows, targets in zip(hidden.tensor_split(ctx.chunks), labels.tensor_split(ctx.chunks)):
            leaves = (rows.detach().requires_grad_(wants_hidden), weight.detach().requires_grad_(wants_weight),
                      None if bias is None else bias.detach().requires_grad_(wants_bias))
            wanted = [leaf for leaf, wants in zip(leaves, (wants_hidden, wants_weight, wants_bias)) if wants]
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                part = _head_sum(*leaves, targets, ctx.ignore_index, ctx.softcap)
            grads = iter(torch.autograd.grad(part, wanted, grad_total))
            if wants_hidden:
                grad_hidden[start:start + rows.shape[0]] = next(grads)
            if wants_weight:
                grad_weight = _add(grad_weight, next(grads), ctx.chunks)
            if wants_bias:
                grad_bias = _add(grad_bias, next(grads), ctx.chunks)
            start += rows.shape[0]
        return (grad_hidden, _cast(grad_weight, weight), _cast(grad_bias, bias), None, None, None, None)


def _add(total: torch.Tensor | None, part: torch.Tensor, chunks: int) -> torch.Tensor:
    if total is not None:
        return total.add_(part)
    # One chunk's gradient is returned as autograd made it: exactly the unchunked one.  Several are summed in
    # float32, so that a bfloat16 weight's gradient is rounded once, as one matmul over all tokens rounds it.
    return part if chunks == 1 or part.dtype == torch.float64 else part.float()


def _cast(grad: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return grad if grad is None or like is None else grad.to(like.dtype)
