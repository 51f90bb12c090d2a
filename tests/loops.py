"""Training loops run twice, plainly and under remat, compared bitwise at every step.

A :class:`Case` builds a small :class:`Net` and says what its training loop changes before each step (a flag,
a number, a submodule, a hook, where an argument goes).  :func:`check` trains one deep copy of the model
without checkpointing and another under one of :data:`MODES` (every way remat can run a region), from the same
weights and seeds, with one of :data:`OPTIMIZERS` (:func:`grid` spreads them over cases and modes), and
asserts at every step that the losses, every parameter's gradient, every buffer and whatever the case observes
after the step are equal bit for bit.

A case may declare that a mode cannot run it (:meth:`Case.error`): the test then asserts that
``torch.utils.checkpoint`` raises that error too, and that remat does.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import remat
from remat import CheckpointPolicy
from remat.planning.basics.blockpolicy import OpDecision, apply_block_policies
from remat.planning.choices.options import block_options
from remat.planning.measure.overheads import Overheads

WIDTH = 16
STEPS = 4
aten = torch.ops.aten

# Fused AdamW writes the parameters without moving their version counters (SGD and foreach AdamW move them):
# a record of an earlier call that is checked against versions looks valid under it after every step.
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "adamw_foreach": lambda params: torch.optim.AdamW(params, foreach=True),
    "adamw_fused": lambda params: torch.optim.AdamW(params, fused=True),
}

_SAVE, _RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
_OFFLOAD = CheckpointPolicy.MUST_CPU_OFFLOAD
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default}
# One op of each pair the cases switch between (sin/cos, relu/gelu, mul/div): which outputs are kept changes
# when the loop flips a branch, so a region that reused what an earlier call kept would be caught.
_KEPT_ELEMENTWISE = {aten.sin.default, aten.relu.default, aten.mul.Tensor, aten._softmax.default, aten.tanh.default}
_OFFLOADED = {aten.addmm.default, aten.gelu.default, aten.cos.default}

keep_rules = remat.policies.Policy(
    op_rule=lambda op: _SAVE if op in _MATMULS or op in _KEPT_ELEMENTWISE else _RECOMPUTE, name="keep mm+elementwise")
offload_rules = remat.policies.Policy(
    op_rule=lambda op: _OFFLOAD if op in _OFFLOADED else _SAVE if op in _KEPT_ELEMENTWISE else None,
    name="offload addmm/gelu/cos")


def policy_fn(ctx, op, *args, **kwargs):
    """A PyTorch-style policy function: keeps matmuls and the other op of each pair ``keep_rules`` keeps."""
    if op in _MATMULS or op in (aten.cos.default, aten.gelu.default, aten.div.Tensor):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


# Op-level decisions a planner could make for a block: the first two addmm outputs and the first output of each
# elementwise op the cases use.  Ops a block does not run are never asked about.
_BLOCK_DECISIONS = [OpDecision("aten.addmm.default", 0, 0, "keep"), OpDecision("aten.addmm.default", 1, 0, "keep"),
                    OpDecision("aten.mm.default", 0, 0, "keep"), OpDecision("aten.sin.default", 0, 0, "keep"),
                    OpDecision("aten.relu.default", 0, 0, "keep"), OpDecision("aten.mul.Tensor", 1, 0, "keep"),
                    OpDecision("aten.gelu.default", 0, 0, "offload")]


def unwrap(module: nn.Module) -> nn.Module:
    """The module a checkpoint wrapper runs (the module itself when unwrapped): what the loop changes."""
    return module._checkpoint_wrapped_module if isinstance(module, remat.ActivationWrapper) else module


class Net(nn.Module):
    """A model whose blocks named in ``regions`` are what remat checkpoints.

    Its forward calls each region through :meth:`run`; a call mode points ``checkpoint_fn`` at
    ``remat.checkpoint``, a wrapper mode replaces the blocks themselves.
    """

    regions: tuple[str, ...] = ("blocks.0", "blocks.1")

    def __init__(self) -> None:
        super().__init__()
        self.checkpoint_fn: Callable[..., Any] | None = None

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.checkpoint_fn is None:
            return fn(*args, **kwargs)
        return self.checkpoint_fn(fn, *args, **kwargs)

    def region(self, name: str) -> nn.Module:
        return unwrap(self.get_submodule(name))


class Stack(Net):
    """stem -> blocks (the regions) -> head: the regions' input requires grad, as the reentrant variant needs."""

    def __init__(self, *blocks: nn.Module, width: int = WIDTH) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = self.run(block, h)
        return self.head(h)


class Case:
    """One training loop: what it builds, feeds and changes. Subclasses override what they need."""

    micro_batches = 1
    kwargs = False  # the regions take keyword arguments (the reentrant variant takes none)
    batch_shape: tuple[int, ...] = (4, WIDTH)

    def build(self) -> Net:
        raise NotImplementedError

    def before(self, model: Net, step: int) -> None:
        """Change what the loop changes, before step ``step``'s forward."""

    def inputs(self, step: int, micro: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(100 * step + micro)
        return (torch.randn(self.batch_shape, generator=g),)

    def objective(self, output: torch.Tensor, step: int, micro: int) -> torch.Tensor:
        return output.float().square().mean()

    def loss(self, model: Net, step: int, micro: int) -> torch.Tensor:
        return self.objective(model(*self.inputs(step, micro)), step, micro)

    def after(self, model: Net, step: int) -> list[torch.Tensor]:
        """Run after the optimizer step (an evaluation, say); what it returns is compared too."""
        return []

    def regions(self, model: nn.Module) -> list[str]:
        """The qualified names of the modules remat checkpoints (wrapper and plan modes)."""
        return list(model.regions)

    def example(self) -> tuple[tuple, dict, Callable[[Any], torch.Tensor]]:
        """What a profile runs: ``model(*args, **kwargs)`` and the loss of its output (the first step's)."""
        return self.inputs(0, 0), {}, functools.partial(self.objective, step=0, micro=0)

    def error(self, mode: Mode) -> type[BaseException] | None:
        """The error ``torch.utils.checkpoint`` raises for this loop in ``mode`` (None: it trains)."""
        if mode.reentrant and self.kwargs and mode.calls:
            return ValueError  # the reentrant variant takes no keyword arguments for the function
        return None

    def cleanup(self) -> None:
        """Undo global changes (module-level flags) the loop made."""


# ---------------------------------------------------------------------------------------------------- modes
@dataclass(frozen=True)
class Mode:
    """One way remat runs a model's regions: ``install(model, case)`` sets it up on a deep copy."""

    name: str
    install: Callable[[Net, Case], None]
    reentrant: bool = False
    calls: bool = True  # through Net.run (False: wrappers replace the blocks)

    def __repr__(self) -> str:
        return self.name


def _calls(**checkpoint_kwargs: Any) -> Callable[[Net, Case], None]:
    def install(model: Net, case: Case) -> None:
        model.checkpoint_fn = functools.partial(remat.checkpoint, **checkpoint_kwargs)
    return install


def _wrapper(**kwargs: Any) -> Callable[[Net, Case], None]:
    def install(model: Net, case: Case) -> None:
        regions = case.regions(model)
        chosen = {id(model.get_submodule(name)) for name in regions}
        wrapped = remat.apply_activation_checkpointing(model, check_fn=lambda m: id(m) in chosen, **kwargs)
        assert sorted(wrapped) == sorted(regions)
    return install


def _wrapper_with_policy(model: Net, case: Case) -> None:
    for name in case.regions(model):
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, remat.checkpoint_wrapper(model.get_submodule(name),
                                                                             policy=keep_rules))


def _block_policies(model: Net, case: Case) -> None:
    policy = remat.BlockPolicy("selective", _BLOCK_DECISIONS)
    apply_block_policies(model, dict.fromkeys(case.regions(model), policy))


def _planned(model: Net, case: Case) -> None:
    # Profiled on a copy: a profile runs training steps, which would move the state the loop compares.
    # Op times estimated, machinery free: the op-level fronts depend on bytes and FLOPs, not on this machine.
    probe = copy.deepcopy(model)
    args, kwargs, loss_fn = case.example()
    regions = case.regions(model)
    prof = remat.profile(probe, *args, loss_fn=loss_fn, modules=regions, repeats=1, **kwargs)
    prof.ops = remat.profile_ops(probe, *args, modules=regions, timing="estimate",
                                 overheads=Overheads(0.0, 0.0, 0.0, 0.0, 0.0), **kwargs)
    # A budget every plan meets: the solver keeps each block whole.  Which op-level point it would pick under
    # a tight one depends on the profile's measured times; each block gets a middle point of its own front
    # instead (some outputs kept, some recomputed) or, for a front with no interior, every other output worth
    # keeping, written into the plan as a saved plan records it.
    plan = prof.plan(2 * prof.peak_bytes, allow=("selective",))
    for row, options in zip(prof.rows, block_options(prof, ("selective",))):
        points = [o for o in options if o.name == "selective"]
        if points:
            policy = points[len(points) // 2].policy
        else:
            graph = prof.ops.blocks.get(row.name)
            keepable = [graph.nodes[i] for i in graph.keepable] if graph is not None else []
            if not keepable:
                continue
            policy = remat.BlockPolicy("selective", [OpDecision(n.op, n.call, n.out_bytes, "recompute" if i % 2
                                                                else "keep") for i, n in enumerate(keepable)])
        plan.decisions[row.name] = "selective"
        plan.policies[row.name] = policy.to_dict()
    assert "selective" in plan.decisions.values(), plan.decisions
    plan.apply(model)


MODES = [
    Mode("checkpoint", _calls(use_reentrant=False)),
    Mode("reentrant", _calls(use_reentrant=True), reentrant=True),
    Mode("save_matmuls", _calls(policy=remat.policies.save_matmuls)),
    Mode("rules", _calls(policy=keep_rules)),
    Mode("policy_fn", _calls(policy=policy_fn)),
    Mode("offload", _calls(policy=offload_rules)),
    Mode("wrapper", _wrapper(), calls=False),
    Mode("wrapper_reentrant", _wrapper(use_reentrant=True), reentrant=True, calls=False),
    Mode("wrapper_policy", _wrapper_with_policy, calls=False),
    Mode("block_policy", _block_policies, calls=False),
    Mode("plan", _planned, calls=False),
]


def grid(cases: list[str], modes: list[Mode] = MODES) -> list[Any]:
    """``(case, mode, optimizer)`` parameters: every case under every mode, the optimizers taking turns so that
    every case and every mode meets each of them (the whole product takes minutes; ``REMAT_LOOPS_ALL=1`` runs it)."""
    names = list(OPTIMIZERS)
    every = os.environ.get("REMAT_LOOPS_ALL") == "1"
    return [pytest.param(case, mode, optimizer, id=f"{case}-{mode.name}-{optimizer}")
            for i, case in enumerate(cases) for j, mode in enumerate(modes)
            for optimizer in (names if every else [names[(i + j) % len(names)]])]


# ------------------------------------------------------------------------------------------------- training
@dataclass
class Record:
    losses: list[torch.Tensor]
    grads: list[tuple[str, torch.Tensor | None]]
    buffers: list[tuple[str, torch.Tensor]]
    observed: list[torch.Tensor]


def _public(name: str) -> str:
    # A wrapper hides its extra level from its own named_parameters() and from state_dict keys, but a parent's
    # named_parameters() walks the modules and shows it (as torch's checkpoint_wrapper does).
    return name.replace("_checkpoint_wrapped_module.", "")


def train(case: Case, model: Net, optimizer: str, steps: int):
    """Yield one :class:`Record` per training step of ``model`` (seeded the same for every model)."""
    opt = OPTIMIZERS[optimizer](model.parameters())
    for step in range(steps):
        case.before(model, step)
        losses = []
        for micro in range(case.micro_batches):
            torch.manual_seed(1000 * step + micro)
            loss = case.loss(model, step, micro)
            (loss / case.micro_batches).backward()
            losses.append(loss.detach())
        grads = [(_public(name), None if p.grad is None else p.grad.clone()) for name, p in model.named_parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(1000 * step + 999)
        observed = case.after(model, step)
        buffers = [(_public(name), b.clone()) for name, b in model.named_buffers()]
        yield Record(losses, grads, buffers, observed)


def _equal(what: str, step: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
    if a is None or b is None:
        assert a is None and b is None, f"step {step}: {what} is None in one run only"
        return
    assert a.dtype == b.dtype and a.shape == b.shape, f"step {step}: {what}"
    if not torch.equal(a, b):
        diff = (a.double() - b.double()).abs().max().item()
        raise AssertionError(f"step {step}: {what} differs from the plain run's (max abs diff {diff:.3g})")


def assert_same_steps(expected: Record, got: Record, step: int) -> None:
    assert len(expected.losses) == len(got.losses)
    for micro, (a, b) in enumerate(zip(expected.losses, got.losses)):
        _equal(f"loss of micro-batch {micro}", step, a, b)
    assert [n for n, _ in expected.grads] == [n for n, _ in got.grads]
    for (name, a), (_, b) in zip(expected.grads, got.grads):
        _equal(f"gradient of {name}", step, a, b)
    assert [n for n, _ in expected.buffers] == [n for n, _ in got.buffers]
    for (name, a), (_, b) in zip(expected.buffers, got.buffers):
        _equal(f"buffer {name}", step, a, b)
    assert len(expected.observed) == len(got.observed)
    for i, (a, b) in enumerate(zip(expected.observed, got.observed)):
        _equal(f"observed value {i}", step, a, b)


def _drive(case: Case, model: Net, optimizer: str) -> None:
    for _ in train(case, model, optimizer, STEPS):
        pass


def check(case: Case, mode: Mode, optimizer: str, steps: int = STEPS) -> None:
    """Train ``case``'s model plainly and under ``mode`` and compare every step bitwise (or the shared error)."""
    try:
        torch.manual_seed(0)
        model = case.build()
        expected_error = case.error(mode)
        if expected_error is not None:
            reference = copy.deepcopy(model)
            reference.checkpoint_fn = functools.partial(torch_checkpoint.checkpoint, use_reentrant=mode.reentrant)
            with pytest.raises(expected_error):
                _drive(case, reference, optimizer)
            checkpointed = copy.deepcopy(model)
            mode.install(checkpointed, case)
            with pytest.raises(expected_error):
                _drive(case, checkpointed, optimizer)
            return
        plain = copy.deepcopy(model)
        checkpointed = copy.deepcopy(model)
        mode.install(checkpointed, case)
        runs = zip(train(case, plain, optimizer, steps), train(case, checkpointed, optimizer, steps))
        for step, (expected, got) in enumerate(runs):
            assert_same_steps(expected, got, step)
    finally:
        case.cleanup()
