"""The meta device and a model that looks at its data.

Meta tensors have shapes and no values, so ``Tensor.item()`` fails on them.  Hugging Face models call it in
their mask code, on yes/no questions about the inputs: "is each sequence one sequence, not several packed
together?" (``(packed[:, -1] == 0).all()``) and "is there no padding?" (``fast_all(padding_mask)``).
:class:`MetaData` answers every such yes/no question on a meta tensor with *yes* — the ordinary case, the
path a real step on unpadded, unpacked data takes — and lists where it did so.  A model that reads a number
from its data (an integer or float ``.item()``: a length, a maximum) is refused with
:class:`NeedsRealData`, naming where: the meta device cannot know it.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MetaData", "MetaKernels", "MetaLayouts", "NeedsRealData"]

_ITEM = torch.ops.aten._local_scalar_dense.default
_LAYER_NORM_BACKWARD = torch.ops.aten.native_layer_norm_backward.default
_SKIPPED = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))


class NeedsRealData(ValueError):
    """The model reads a value from its data, which meta tensors do not have."""


class MetaData(TorchDispatchMode):
    """While active, a yes/no ``.item()`` on a meta tensor answers True; ``answered`` lists where
    (``"file.py:line"``), a numeric one raises :class:`NeedsRealData`.

    Example:
        >>> with MetaData() as answers:
        ...     ordinary = bool((torch.ones(3, device="meta") > 0).all())
        >>> ordinary, len(answers.answered)
        (True, 1)
    """

    def __init__(self, who: str = "remat.profile(device='meta')") -> None:
        super().__init__()
        self.who = who
        self.answered: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is _ITEM and args[0].device.type == "meta":
            where = _caller()
            if args[0].dtype is not torch.bool:
                raise NeedsRealData(
                    f"{self.who}: the model reads a number from its data at {where} (Tensor.item() of a "
                    f"{str(args[0].dtype).removeprefix('torch.')} tensor), which meta tensors do not have; profile "
                    "it on real tensors instead, with a smaller batch or sequence (activation bytes scale with them)."
                )
            if where not in self.answered:
                self.answered.append(where)
            return True
        return func(*args, **(kwargs or {}))


def _caller() -> str:
    """The innermost frame outside torch and remat, as ``dir/file.py:line``."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_SKIPPED):
            parts = frame.filename.replace(os.sep, "/").split("/")
            return f"{'/'.join(parts[-2:])}:{frame.lineno}"
    return "an unknown place"


class MetaKernels(TorchFunctionMode):
    """While active, ``scaled_dot_product_attention`` on meta tensors runs the kernel the CPU picks for the
    same arguments (its fused flash kernel where it applies, else the math path both devices take).

    The choice is the CPU's own (``torch._fused_sdp_choice``), asked on stand-ins of one row each: CPU
    tensors of the arguments' shapes, dtypes and ``requires_grad`` whose every dimension but the last is
    expanded, so asking allocates next to nothing.

    Example:
        >>> q = torch.empty(2, 4, 16, 8, device="meta", requires_grad=True)
        >>> with MetaKernels():
        ...     out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        >>> out.grad_fn.name()
        'ScaledDotProductFlashAttentionForCpuBackward0'
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and _on_meta(args, kwargs):
            flash = _cpu_flash(*args, **kwargs)
            if flash is not None:
                return flash
        return func(*args, **kwargs)


class MetaLayouts(TorchDispatchMode):
    """While active, an op whose meta kernel lays out its result otherwise than the CPU kernel does returns
    the CPU's layout, so that the views after it copy on meta exactly where they copy on the CPU.

    ``native_layer_norm_backward``: the CPU's input gradient is contiguous, the meta kernel's takes the
    incoming gradient's strides (transposed in Swin, after its window reshuffle), and a ``view`` of it then
    copies on meta alone.

    Example:
        >>> grad = torch.empty(2, 8, 4, device="meta").transpose(1, 2)
        >>> x, stat, w = (torch.empty(s, device="meta") for s in ((2, 4, 8), (2, 4, 1), (8,)))
        >>> with MetaLayouts():
        ...     dx = torch.ops.aten.native_layer_norm_backward(grad, x, [8], stat, stat, w, w, [True, True, True])[0]
        >>> dx.is_contiguous()
        True
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is _LAYER_NORM_BACKWARD and not kwargs and args[1].device.type == "meta" and args[-1][0]:
            if any(t is not torch.Tensor for t in types):  # a DTensor (sequence parallel): its local call comes next
                return NotImplemented
            x = args[1]
            _, weight_grad, bias_grad = func(*args[:-1], [False, *args[-1][1:]])
            return torch.empty(x.shape, dtype=x.dtype, device=x.device), weight_grad, bias_grad
        return func(*args, **(kwargs or {}))


def _on_meta(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in (*args, *kwargs.values()))


def _stand_in(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    # the CPU leaves its flash kernel for the math path when a mask requires grad (the flash backward gives
    # the mask no gradient), so the stand-in keeps requires_grad for the choice to see it
    return torch.empty(t.shape[-1:], dtype=t.dtype, requires_grad=t.requires_grad).expand(t.shape)


def _cpu_flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor | None:
    """The CPU's fused flash attention on these meta tensors, or None where the CPU would not take it."""
    if query.dim() != 4:
        return None
    stand_ins = [_stand_in(t) for t in (query, key, value, attn_mask)]
    choice = torch._fused_sdp_choice(*stand_ins, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if choice != SDPBackend.FLASH_ATTENTION.value:
        return None
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
