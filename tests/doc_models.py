""""Your model" in the docs' command lines: a small residual MLP and its batch.

The docs write ``remat plan mypkg.models:build --inputs mypkg.data:batch ...``. Before such a block,
``tests/test_doc_examples.py`` runs the block's declared setup, ``write_mypkg()``, which writes this file as
``mypkg/models.py`` and ``mypkg/data.py`` (its ``batch``) in the folder the block runs in, so that the line
runs as printed. ``--input-shape 2048,64`` fits it too (any batch of 64-wide rows).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

__all__ = ["Block", "batch", "build", "write_mypkg"]

WIDTH = 64


class Block(nn.Module):
    """A residual MLP block: the repeated block the planner finds."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def build() -> nn.Module:
    """The model: eight blocks."""
    return nn.Sequential(*[Block() for _ in range(8)])


def batch() -> torch.Tensor:
    """Its input: 2048 rows."""
    return torch.randn(2048, WIDTH)


def write_mypkg(folder: str | Path = ".") -> None:
    """Write the package ``mypkg`` (``models``: this file; ``data``: its ``batch``) into ``folder``."""
    package = Path(folder) / "mypkg"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    shutil.copyfile(__file__, package / "models.py")
    (package / "data.py").write_text("from .models import batch\n\n__all__ = ['batch']\n")
