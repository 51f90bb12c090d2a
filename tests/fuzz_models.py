"""Random models as users write them, one per seed: what the plan fuzz (tests/fuzz_check.py) plans and trains.

Each seed picks a pattern and draws its layers with ``random.Random(seed)``; :func:`make_case` returns a
:class:`FuzzCase` whose ``build()`` gives the same model, with the same weights, every call.

Patterns:

* ``mlp``: an ``nn.Sequential`` of Linear layers, each followed by some of LayerNorm / BatchNorm1d, an
  activation and ``Dropout(p > 0)``;
* ``cnn``: an ``nn.Sequential`` of Conv2d layers with BatchNorm2d, activations, Dropout and pooling, then a
  pooled, flattened Linear head;
* ``residual``: a ``ModuleList`` of repeated residual blocks (``x + f(x)``) of Linear or Conv2d layers whose
  activations are often ``inplace=True`` inside the block, then a head;
* ``shared``: ``ctx = embed(x)`` added to the input of every block of a ``ModuleList`` and again before the
  head;
* ``shared_input``: the same ``ctx`` passed to every block as an argument (the block adds it to, or multiplies
  it with, its normed input);
* ``seq_inplace``: an ``nn.Sequential`` with in-place activations as layers of their own
  (``Conv, ReLU(inplace=True), Conv``), as classic CNNs are written.

Sizes are small (a step costs milliseconds) and widths vary, so that layers of one model differ in bytes.

Example:
    >>> case = make_case(7)
    >>> model = case.build()
    >>> case.loss_fn(model(case.inputs)).backward()
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ACTIVATIONS", "PATTERNS", "FuzzCase", "make_case"]

ACTIVATIONS: dict[str, Callable[..., nn.Module]] = {
    "relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid,
    "leaky_relu": nn.LeakyReLU,
}
_INPLACE = ("relu", "silu", "leaky_relu")  # the activations that take inplace=True
_CAN_BE_INPLACE = (nn.ReLU, nn.SiLU, nn.LeakyReLU)

PATTERNS = ("mlp", "cnn", "residual", "shared", "shared_input", "seq_inplace")


@dataclass
class FuzzCase:
    """One random model: ``build()`` returns it (fresh, same weights every call); ``loss_fn(model(inputs))``
    is a training step's loss; ``layers`` describes it in a line."""

    seed: int
    pattern: str
    layers: str
    build: Callable[[], nn.Module]
    inputs: torch.Tensor

    @staticmethod
    def loss_fn(output: torch.Tensor) -> torch.Tensor:
        return output.float().pow(2).mean()

    def __str__(self) -> str:
        return f"seed {self.seed} ({self.pattern}): {self.layers}"


def make_case(seed: int, patterns: tuple[str, ...] | None = None) -> FuzzCase:
    """The model of ``seed``, its pattern drawn from ``patterns`` (default: every pattern).

    Example:
        >>> make_case(3, patterns=("mlp",)).pattern
        'mlp'
    """
    rng = random.Random(seed)
    choices = patterns or PATTERNS
    pattern = choices[rng.randrange(len(choices))]
    spec, inputs_shape, describe = _BUILDERS[pattern](rng)
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(inputs_shape, generator=generator)

    def build() -> nn.Module:
        torch.manual_seed(seed)
        return spec()

    return FuzzCase(seed, pattern, describe, build, inputs)


def _activation(rng: random.Random, inplace: bool = False) -> tuple[nn.Module, str]:
    """A random activation; ``inplace``: an in-place one where that activation has the option, half the time."""
    name = rng.choice(tuple(ACTIVATIONS))
    if inplace and name in _INPLACE and rng.random() < 0.5:
        return ACTIVATIONS[name](inplace=True), f"{name}_"
    return ACTIVATIONS[name](), name


def _mlp(rng: random.Random) -> tuple[Callable[[], nn.Module], tuple[int, ...], str]:
    batch, width = rng.choice((64, 128, 256)), rng.choice((32, 48, 64))
    plan = []
    widths = [width] + [rng.choice((32, 64, 96)) for _ in range(rng.randint(2, 5))]
    for cin, cout in zip(widths, widths[1:]):
        plan.append(("linear", cin, cout))
        if rng.random() < 0.3:
            plan.append((rng.choice(("layernorm", "batchnorm")), cout))
        if rng.random() < 0.85:
            plan.append(("act", rng.randrange(1 << 30)))
        if rng.random() < 0.35:
            plan.append(("dropout", rng.choice((0.1, 0.25, 0.5))))
    plan.append(("linear", widths[-1], rng.choice((8, 16))))

    def spec() -> nn.Module:
        return nn.Sequential(*(_layer(step)[0] for step in plan))

    return spec, (batch, width), " ".join(_layer(step)[1] for step in plan)


def _layer(step: tuple) -> tuple[nn.Module, str]:
    """One layer of a Sequential plan; an activation is drawn from its own seed so that every build agrees."""
    kind = step[0]
    if kind == "linear":
        return nn.Linear(step[1], step[2]), f"Linear({step[1]},{step[2]})"
    if kind == "conv":
        return nn.Conv2d(step[1], step[2], 3, padding=1), f"Conv({step[1]},{step[2]})"
    if kind == "layernorm":
        return nn.LayerNorm(step[1]), "LayerNorm"
    if kind == "batchnorm":
        return nn.BatchNorm1d(step[1]), "BatchNorm1d"
    if kind == "batchnorm2d":
        return nn.BatchNorm2d(step[1]), "BatchNorm2d"
    if kind == "act":
        return _activation(random.Random(step[1]))
    if kind == "dropout":
        return nn.Dropout(step[1]), f"Dropout({step[1]})"
    if kind == "pool":
        return nn.MaxPool2d(2), "MaxPool"
    raise AssertionError(kind)


def _conv_plan(rng: random.Random, channels: list[int]) -> list[tuple]:
    plan = []
    for k, (cin, cout) in enumerate(zip(channels, channels[1:])):
        plan.append(("conv", cin, cout))
        if rng.random() < 0.5:
            plan.append(("batchnorm2d", cout))
        plan.append(("act", rng.randrange(1 << 30)))
        if rng.random() < 0.25:
            plan.append(("dropout", rng.choice((0.1, 0.25))))
        if k == 0 and rng.random() < 0.4:
            plan.append(("pool",))
    return plan


def _cnn(rng: random.Random) -> tuple[Callable[[], nn.Module], tuple[int, ...], str]:
    batch, side = rng.choice((2, 4)), rng.choice((8, 12, 16))
    channels = [3] + [rng.choice((4, 8, 12)) for _ in range(rng.randint(2, 4))]
    plan = _conv_plan(rng, channels)
    classes = rng.choice((5, 10))

    def layers() -> list[tuple[nn.Module, str]]:
        made = [_layer(step) for step in plan]
        return made + [(nn.AdaptiveAvgPool2d(1), "AvgPool"), (nn.Flatten(), "Flatten"),
                       (nn.Linear(channels[-1], classes), f"Linear({channels[-1]},{classes})")]

    def spec() -> nn.Module:
        return nn.Sequential(*(module for module, _ in layers()))

    return spec, (batch, 3, side, side), " ".join(name for _, name in layers())


def _seq_inplace(rng: random.Random) -> tuple[Callable[[], nn.Module], tuple[int, ...], str]:
    spec, shape, _ = _cnn(rng)

    def inplace_spec() -> nn.Module:
        model = spec()
        # every activation that can be in place is, after a layer that does not save its output (autograd's rule)
        for before, module in zip(model, list(model)[1:]):
            if isinstance(module, _CAN_BE_INPLACE) and isinstance(before, (nn.Conv2d, nn.BatchNorm2d)):
                module.inplace = True
        return model

    names = " ".join(f"{type(m).__name__}{'_' if getattr(m, 'inplace', False) else ''}" for m in inplace_spec())
    return inplace_spec, shape, names


class _LinearBlock(nn.Module):
    """``x + drop(down(act(up(norm(x)))))``; the activation may be in place, the norm and residual optional.
    Given ``ctx``, the block reads ``norm(x) + ctx`` (``mix="add"``: nothing saves it) or ``norm(x) * ctx``
    (``"mul"``: every block saves it)."""

    def __init__(self, width: int, hidden: int, act: nn.Module, norm: bool, p: float, residual: bool,
                 mix: str = "add") -> None:
        super().__init__()
        self.mix = mix
        self.norm = nn.LayerNorm(width) if norm else nn.Identity()
        self.up, self.act, self.down = nn.Linear(width, hidden), act, nn.Linear(hidden, width)
        self.drop = nn.Dropout(p) if p else nn.Identity()
        self.residual = residual

    def forward(self, x: torch.Tensor, ctx: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm(x)
        if ctx is not None:
            h = h + ctx if self.mix == "add" else h * ctx
        out = self.drop(self.down(self.act(self.up(h))))
        return x + out if self.residual else out


class _ConvBlock(nn.Module):
    """``act(x + bn(conv(act(bn(conv(x))))))`` as ResNet writes it, activations often in place."""

    def __init__(self, channels: int, act: nn.Module, act_out: nn.Module, norm: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels) if norm else nn.Identity()
        self.bn2 = nn.BatchNorm2d(channels) if norm else nn.Identity()
        self.act, self.act_out = act, act_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act_out(x + self.bn2(self.conv2(self.act(self.bn1(self.conv1(x))))))


class _Stack(nn.Module):
    """``head(blocks(stem(x)))``, the blocks in a ModuleList; with ``shared``, ``ctx = stem(x)`` is added to
    every block's input (``"before"``: ``h = block(h + ctx)``) or passed to it (``"argument"``:
    ``h = block(h, ctx)``), and added again before the head."""

    def __init__(self, stem: nn.Module, blocks: list[nn.Module], head: nn.Module, shared: str = "") -> None:
        super().__init__()
        self.stem, self.blocks, self.head, self.shared = stem, nn.ModuleList(blocks), head, shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = self.stem(x)
        h = ctx
        for block in self.blocks:
            if self.shared == "argument":
                h = block(h, ctx)
            else:
                h = block(h + ctx) if self.shared else block(h)
        return self.head(h + ctx if self.shared else h)


def _linear_stack(rng: random.Random, shared: str) -> tuple[Callable[[], nn.Module], tuple[int, ...], str]:
    batch, width, hidden = rng.choice((64, 128, 256)), rng.choice((32, 48)), rng.choice((64, 96, 128))
    depth, norm, p = rng.randint(2, 4), rng.random() < 0.6, rng.choice((0.0, 0.0, 0.1, 0.3))
    residual = shared or rng.random() < 0.8
    act_seed, features = rng.randrange(1 << 30), rng.choice((16, 32))
    mix = rng.choice(("add", "mul"))

    def spec() -> nn.Module:
        act_rng = random.Random(act_seed)  # every block takes the same activation: the blocks are equal
        act, _ = _activation(act_rng, inplace=True)
        blocks = [_LinearBlock(width, hidden, type(act)(**_kwargs(act)), norm, p, residual, mix)
                  for _ in range(depth)]
        return _Stack(nn.Linear(features, width), blocks, nn.Linear(width, 8), shared)

    _, act_name = _activation(random.Random(act_seed), inplace=True)
    ctx = {"": "", "before": " ctx shared", "argument": f" ctx shared ({mix}, an argument)"}[shared]
    text = (f"{depth} x [{'LayerNorm ' if norm else ''}Linear({width},{hidden}) {act_name} Linear({hidden},{width})"
            f"{f' Dropout({p})' if p else ''}{' +x' if residual else ''}]{ctx}")
    return spec, (batch, features), text


def _kwargs(act: nn.Module) -> dict:
    return {"inplace": True} if getattr(act, "inplace", False) else {}


def _conv_stack(rng: random.Random) -> tuple[Callable[[], nn.Module], tuple[int, ...], str]:
    batch, side, channels = rng.choice((2, 4)), rng.choice((8, 12)), rng.choice((4, 8))
    depth, norm = rng.randint(2, 3), rng.random() < 0.6
    act_seed = rng.randrange(1 << 30)

    def spec() -> nn.Module:
        act_rng = random.Random(act_seed)
        act, _ = _activation(act_rng, inplace=True)
        out, _ = _activation(act_rng, inplace=True)
        blocks = [_ConvBlock(channels, type(act)(**_kwargs(act)), type(out)(**_kwargs(out)), norm)
                  for _ in range(depth)]
        head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 5))
        return _Stack(nn.Conv2d(3, channels, 3, padding=1), blocks, head)

    act_rng = random.Random(act_seed)
    names = [_activation(act_rng, inplace=True)[1] for _ in range(2)]
    text = f"{depth} x [Conv {'BN ' if norm else ''}{names[0]} Conv {'BN ' if norm else ''}+x {names[1]}]"
    return spec, (batch, 3, side, side), text


def _residual(rng: random.Random) -> tuple[Callable[[], nn.Module], tuple[int, ...], str]:
    return _conv_stack(rng) if rng.random() < 0.35 else _linear_stack(rng, shared="")


def _shared(rng: random.Random) -> tuple[Callable[[], nn.Module], tuple[int, ...], str]:
    return _linear_stack(rng, shared="before")


def _shared_input(rng: random.Random) -> tuple[Callable[[], nn.Module], tuple[int, ...], str]:
    return _linear_stack(rng, shared="argument")


_BUILDERS = {"mlp": _mlp, "cnn": _cnn, "residual": _residual, "shared": _shared, "shared_input": _shared_input,
             "seq_inplace": _seq_inplace}
