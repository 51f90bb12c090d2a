"""Randomized equivalence: random programs with random nested checkpoints equal plain autograd, bitwise.

CI runs a fixed number of examples; run many more by hand with
``REMAT_HYPOTHESIS_EXAMPLES=2000 python -m pytest tests/test_random_programs.py``.
Counter-examples found are kept below as explicit regression tests.
"""

import os
from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import remat

UNARY = ("sin", "tanh", "sigmoid", "exp_small", "dropout", "inplace_mul", "transpose", "reshape")
BINARY = ("add", "mul", "matmul")


@dataclass(frozen=True)
class Op:
    kind: str
    a: int  # operand positions, taken modulo the current pool size
    b: int = 0


@dataclass(frozen=True)
class Region:
    body: tuple  # of Op | Region
    policy: int = 0  # index into POLICIES (0: plain checkpointing)


def _apply(op: Op, pool: list) -> torch.Tensor:
    a, b = pool[op.a % len(pool)], pool[op.b % len(pool)]
    if op.kind == "sin":
        return a.sin()
    if op.kind == "tanh":
        return a.tanh()
    if op.kind == "sigmoid":
        return a.sigmoid()
    if op.kind == "exp_small":
        return (a * 0.1).exp()
    if op.kind == "dropout":
        return torch.nn.functional.dropout(a, 0.3)
    if op.kind == "inplace_mul":
        fresh = a * 1.0  # in place on a fresh tensor that nothing saved
        return fresh.add_(0.5).mul_(0.9)
    if op.kind == "transpose":
        return a.t()
    if op.kind == "reshape":
        return a.reshape(-1).reshape(4, 4)
    if op.kind == "add":
        return a + b
    if op.kind == "mul":
        return a * b
    if op.kind == "matmul_relu_":
        return (a @ b).relu_()  # in place on an output a policy may keep
    if op.kind == "matmul_view_mul_":
        h = a @ b
        h.view(-1).mul_(0.5)  # in place through a view
        return h
    return (a @ b) * 0.5


def _run(body: tuple, pool: list, wrap) -> list:
    """Run ``body`` on ``pool``; return the tensors it created, in order."""
    created = []
    for item in body:
        current = pool + created
        if isinstance(item, Op):
            created.append(_apply(item, current))
        elif wrap is None:
            created.extend(_run(item.body, current, None))
        else:
            def region(*tensors, body=item.body):
                return tuple(_run(body, list(tensors), wrap))

            if not _creates_something(item.body):
                continue
            created.extend(wrap(region, *current, policy=item.policy))
    return created


def _creates_something(body: tuple) -> bool:
    return any(isinstance(i, Op) or _creates_something(i.body) for i in body)


def _flatten_ops(body: tuple, out: list) -> None:
    for item in body:
        out.append(item) if isinstance(item, Op) else _flatten_ops(item.body, out)


ops = st.builds(Op, st.sampled_from(UNARY + BINARY), st.integers(0, 50), st.integers(0, 50))


def _bodies(depth: int):
    item = ops if depth == 0 else st.one_of(ops, ops, st.builds(Region, _bodies(depth - 1)))
    return st.lists(item, min_size=1, max_size=6).map(tuple)


programs = st.builds(Region, _bodies(3))


def _loss(outputs: list) -> torch.Tensor:
    return sum((t * (i + 1)).sum() for i, t in enumerate(outputs))


def _check(program: Region, use_reentrant: bool, early_stop: bool, mode: str) -> None:
    """Non-reentrant: bitwise. Reentrant: to float rounding, because it sums a region input's gradient
    over the paths inside the region before autograd adds the paths outside (another summation order)."""
    torch.manual_seed(0)
    x = torch.randn(4, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    leaves = [x, w]

    def wrap(fn, *args, policy=0):
        return remat.checkpoint(fn, *args, use_reentrant=use_reentrant, early_stop=early_stop,
                                policy=POLICIES[policy])

    def gradients(use_wrap: bool):
        torch.manual_seed(42)
        outputs = _run(program.body, list(leaves), wrap if use_wrap else None)
        if not outputs:
            return []
        loss = _loss(outputs)
        if mode == "backward":
            x.grad = w.grad = None
            loss.backward()
            return [x.grad, w.grad]
        if mode == "grad_inputs":
            return list(torch.autograd.grad(loss, [w], allow_unused=True))
        first = torch.autograd.grad(loss, leaves, retain_graph=True, allow_unused=True)
        second = torch.autograd.grad(loss, leaves, allow_unused=True)
        return list(first) + list(second)

    expected, got = gradients(False), gradients(True)
    assert len(expected) == len(got)
    for e, g in zip(expected, got):
        assert (e is None) == (g is None)
        if e is None:
            continue
        if use_reentrant:
            torch.testing.assert_close(e, g, rtol=1e-4, atol=1e-4)
        else:
            assert torch.equal(e, g), f"max diff {(e - g).abs().max().item()}"


EXAMPLES = int(os.environ.get("REMAT_HYPOTHESIS_EXAMPLES", "200"))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(program=programs, early_stop=st.booleans(), mode=st.sampled_from(["grad_inputs", "retain_twice"]))
def test_random_programs_nonreentrant(program, early_stop, mode):
    _check(program, use_reentrant=False, early_stop=early_stop, mode=mode)


@settings(max_examples=EXAMPLES // 2, deadline=None, derandomize=True)
@given(program=programs)
def test_random_programs_reentrant(program):
    _check(program, use_reentrant=True, early_stop=True, mode="backward")


def _keep_mm_and_dropout(ctx, op, *args, **kwargs):
    keep = op in (torch.ops.aten.mm.default, torch.ops.aten.native_dropout.default)
    return remat.CheckpointPolicy.MUST_SAVE if keep else remat.CheckpointPolicy.PREFER_RECOMPUTE


POLICIES = (
    None,
    remat.policies.save_matmuls,
    remat.policies.save_all_but_names(),
    _keep_mm_and_dropout,
    remat.policies.Policy(call_rule=lambda op, i: remat.CheckpointPolicy.MUST_SAVE if i % 2 else None),
)
policy_ops = st.builds(Op, st.sampled_from(UNARY + BINARY + ("matmul_relu_", "matmul_view_mul_")),
                       st.integers(0, 50), st.integers(0, 50))


def _policy_bodies(depth: int):
    region = st.builds(Region, _policy_bodies(depth - 1), st.integers(0, len(POLICIES) - 1)) if depth else None
    item = policy_ops if depth == 0 else st.one_of(policy_ops, policy_ops, region)
    return st.lists(item, min_size=1, max_size=6).map(tuple)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True)
@given(program=st.builds(Region, _policy_bodies(3)), early_stop=st.booleans(),
       mode=st.sampled_from(["backward", "grad_inputs", "retain_twice"]))
def test_random_programs_with_policies_and_in_place_ops(program, early_stop, mode):
    _check(program, use_reentrant=False, early_stop=early_stop, mode=mode)
