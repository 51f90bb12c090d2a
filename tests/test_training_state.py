"""Regions that change state in forward: a recomputation must not change it a second time.

Spectral normalisation runs a power iteration in each training forward and writes its vectors ``u`` and ``v``
to buffers; BatchNorm in training mode updates its running statistics and counts its batches; a codebook
tracks a moving average of what it saw.  Plain autograd runs each forward once, so after every step these
buffers (compared by ``loops.check`` with the gradients, bitwise) must be those of one forward per step, and the
gradients those of the weights the plain forward used.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from loops import WIDTH, Case, Net, Stack, check, grid
from torch import nn
from torch.nn.utils import parametrizations

# An evaluation under no_grad runs the reentrant variant with no input needing grad: it warns, as torch does.
pytestmark = pytest.mark.filterwarnings("ignore:remat. none of the inputs:UserWarning")

HIDDEN = 24


class SpectralBlock(nn.Module):
    """A residual MLP whose first Linear is spectrally normalised (``legacy``: the hook-based
    ``torch.nn.utils.spectral_norm``; else the parametrization)."""

    def __init__(self, legacy: bool) -> None:
        super().__init__()
        if legacy:
            self.up = torch.nn.utils.spectral_norm(nn.Linear(WIDTH, HIDDEN))
        else:
            self.up = parametrizations.spectral_norm(nn.Linear(WIDTH, HIDDEN))
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class ConvBlock(nn.Module):
    """conv-BN-ReLU(in place)-conv-BN, residual, ReLU in place: a ResNet basic block."""

    def __init__(self, channels: int, momentum: float | None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels, momentum=momentum)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels, momentum=momentum)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(h)) + x)


class ConvNet(Net):
    def __init__(self, channels: int = 8, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(channels, momentum) for _ in range(2))
        self.head = nn.Linear(channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = self.run(block, h)
        return self.head(h.mean(dim=(2, 3)))


class Codebook(nn.Module):
    """Soft vector quantisation whose codebook usage is an exponential moving average kept in a buffer,
    updated in forward (under no_grad) while training."""

    def __init__(self, codes: int = 6) -> None:
        super().__init__()
        self.up, self.codes, self.down = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, codes), nn.Linear(codes, WIDTH)
        self.register_buffer("usage", torch.full((codes,), 1.0 / codes))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.codes(torch.tanh(self.up(x))), dim=-1)
        if self.training:
            with torch.no_grad():
                self.usage.mul_(0.9).add_(weights.mean(0), alpha=0.1)
                self.calls += 1
        return x + self.down(weights / self.usage)


class StateCase(Case):
    """Trains ``build``'s model and, after each step, evaluates it under no_grad (eval mode reads the state)."""

    def __init__(self, build, shape: tuple[int, ...] = (4, WIDTH)) -> None:
        self._build, self.batch_shape = build, shape

    def build(self) -> Net:
        return self._build()

    def after(self, model: Net, step: int) -> list[torch.Tensor]:
        x = torch.randn(self.batch_shape, generator=torch.Generator().manual_seed(50 + step))
        model.eval()
        try:
            with torch.no_grad():
                return [model(x)]
        finally:
            model.train()


CASES = {
    "spectral_norm": functools.partial(StateCase, lambda: Stack(SpectralBlock(False), SpectralBlock(False))),
    "spectral_norm_legacy": functools.partial(StateCase, lambda: Stack(SpectralBlock(True), SpectralBlock(True))),
    "batchnorm": functools.partial(StateCase, ConvNet, (2, 3, 6, 6)),
    "batchnorm_cumulative": functools.partial(StateCase, functools.partial(ConvNet, momentum=None), (2, 3, 6, 6)),
    "ema_buffer": functools.partial(StateCase, lambda: Stack(Codebook(), Codebook())),
}


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.nn.utils.spectral_norm is deprecated, still used
@pytest.mark.parametrize(("case", "mode", "optimizer"), grid(list(CASES)))
def test_state_a_region_updates_changes_once_per_step(case, mode, optimizer):
    check(CASES[case](), mode, optimizer)
