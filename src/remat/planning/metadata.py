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
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MetaData", "NeedsRealData"]

_ITEM = torch.ops.aten._local_scalar_dense.default
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
