"""Programs: a followed region's recomputation runs only the ops backward needs (remat.policies.program).

Every test compares gradients bitwise with plain autograd over several calls: the first records the region
(and writes its program), the later ones follow the tape and are refilled from the program, or, where the
program cannot be trusted, by the usual rerun of the region.
"""

import ctypes
import dataclasses
import functools
import weakref

import pytest
import torch
from helpers import MM, assert_bitwise, grads
from torch import nn

import remat
from remat import CheckpointPolicy
from remat.policies import Policy, save_matmuls, tapes
from remat.policies import selective as selective_module
from remat.policies.tape import _books


@pytest.fixture
def runs(monkeypatch):
    """Each refill from a program, as (steps run, steps served)."""
    seen = []
    real = selective_module.run

    def counting(program, plan, *args):
        seen.append(([n for n in plan.order if n not in plan.served], sorted(plan.served)))
        return real(program, plan, *args)

    monkeypatch.setattr(selective_module, "run", counting)
    return seen


def _keep(ops):
    return Policy(op_rule=lambda op: CheckpointPolicy.MUST_SAVE if op in ops else None, name="keep listed")


class Norm(nn.Module):
    """An RMSNorm as Hugging Face writes it: float32 statistics, a weight."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x):
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class Layer(nn.Module):
    """A pre-norm residual MLP with a gated activation (a Llama layer's feed-forward half)."""

    def __init__(self, width: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.norm = Norm(width)
        self.gate, self.up = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


def _steps(fn, wrapped, params, count=3):
    for step in range(count):
        expected = grads(lambda: fn().sum(), params, seed=step)
        got = grads(lambda: wrapped().sum(), params, seed=step)
        assert_bitwise(expected[1], got[1])


def _program_of(policy):
    (entry,) = _books[policy].tapes.values()
    return entry[1].program


def test_a_followed_region_reruns_only_what_its_dropped_tensors_need(runs):
    torch.manual_seed(0)
    layer = Layer()
    x = torch.randn(4, 16, requires_grad=True)
    policy = _keep(MM)
    _steps(lambda: layer(x), lambda: remat.checkpoint(layer, x, policy=policy), [x, *layer.parameters()])
    steps = _program_of(policy).steps
    assert len(runs) == 2 and runs[0] == runs[1]  # the two calls that followed the tape
    ran, served = runs[0]
    # The gate and up projections are served (their outputs feed the activation and the product); the norm,
    # the activation and the product rerun; the down projection and the residual sum (the last op) do not:
    # backward needs nothing they make.
    assert [steps[n].op for n in served] == [torch.ops.aten.mm.default] * 2
    assert not any(steps[n].op in MM for n in ran) and len(steps) - 1 not in ran
    ops_run = {steps[n].op for n in ran}
    assert {torch.ops.aten.rsqrt.default, torch.ops.aten.silu.default, torch.ops.aten.mul.Tensor} <= ops_run


def test_a_policy_keeping_everything_runs_nothing(runs):
    torch.manual_seed(0)
    layer = Layer()
    x = torch.randn(4, 16, requires_grad=True)
    policy = Policy(op_rule=lambda op: CheckpointPolicy.MUST_SAVE, name="everything")
    _steps(lambda: layer(x), lambda: remat.checkpoint(layer, x, policy=policy), [x, *layer.parameters()])
    assert runs == []  # every saved tensor is held: nothing to refill


def test_a_program_runs_under_the_forward_autocast_once(runs):
    torch.manual_seed(0)
    layer = Layer()
    x = torch.randn(4, 16, requires_grad=True)
    policy = _keep(MM)

    def under_autocast(run):
        def call():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return run().float()
        return call

    _steps(under_autocast(lambda: layer(x)), under_autocast(lambda: remat.checkpoint(layer, x, policy=policy)),
           [x, *layer.parameters()])
    assert len(runs) == 2


def test_random_ops_rerun_from_the_regions_rng(runs):
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16, requires_grad=True)

    def noisy(t):
        h = (t @ w).sin()
        h = h * (torch.rand_like(h) < 0.7)  # a draw the program reruns, from the RNG as the region began
        h = (h @ w).cos()
        return h * torch.randn_like(h)

    policy = _keep(MM)
    _steps(lambda: noisy(x), lambda: remat.checkpoint(noisy, x, policy=policy), [x, w])
    assert len(runs) == 2


def test_a_kept_draw_before_a_random_op_reruns_for_its_draw(runs):
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16, requires_grad=True)

    def noisy(t):
        a = torch.rand(8, 16)  # kept (autograd saves it), yet reruns: the next draw starts where it ended
        h = (t @ w).sin() * a
        return h * torch.rand_like(h)

    policy = _keep({*MM, torch.ops.aten.rand.default})
    _steps(lambda: noisy(x), lambda: remat.checkpoint(noisy, x, policy=policy), [x, w])
    assert len(runs) == 2


def test_python_values_and_unchecked_outside_tensors_get_no_program_but_correct_gradients(runs):
    # (In-place ops: tests/test_program_inplace.py.)
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)  # saved by autograd: the follower checks it is the same one
    x = torch.randn(8, 8, requires_grad=True)
    outside = torch.randn(8, 8)  # only added: nothing would tell if a later call read another one

    def python_value(t):
        h = (t @ w).sin()
        return h.cos() * h.max().item()

    def unchecked(t):
        return ((t @ w).sin() + outside).cos()

    cases = [(python_value, "returns a Python value"), (unchecked, "autograd does not save it")]
    for fn, why in cases:
        policy = _keep(MM)
        _steps(lambda: fn(x), lambda: remat.checkpoint(fn, x, policy=policy), [x, w])  # noqa: B023
        (entry,) = _books[policy].tapes.values()
        assert entry[1].program is None and why in entry[1].no_program
    assert runs == []


def test_a_program_is_not_run_where_autograd_saved_another_outside_tensor(runs):
    torch.manual_seed(0)
    x = torch.randn(8, 8, requires_grad=True)
    weights = [torch.randn(8, 8, requires_grad=True) for _ in range(2)]
    current = [weights[0]]

    def fn(t):
        return (t @ current[0]).sin().cos()

    policy = _keep(MM)
    for w in [weights[0], weights[0], weights[1], weights[1]]:
        current[0] = w
        _steps(lambda: fn(x), lambda: remat.checkpoint(fn, x, policy=policy), [x, w], count=1)  # noqa: B023
    assert len(runs) == 1  # the second call: the first records, the later ones read another weight


def test_a_program_is_not_run_where_a_module_holds_another_parameter(runs):
    torch.manual_seed(0)
    layer = Layer()
    x = torch.randn(4, 16, requires_grad=True)
    policy = _keep(MM)
    _steps(lambda: layer(x), lambda: remat.checkpoint(layer, x, policy=policy), [x, *layer.parameters()], count=2)
    assert len(runs) == 1
    # Another weight of the same shape, as after swapping adapters: the tape is still right for forward,
    # but the program would read the old one.
    layer.norm.weight = nn.Parameter(torch.rand(16) + 0.5)
    _steps(lambda: layer(x), lambda: remat.checkpoint(layer, x, policy=policy), [x, *layer.parameters()], count=2)
    assert len(runs) == 1


def test_tapes_without_programs_rerun_the_region(runs):
    torch.manual_seed(0)
    layer = Layer()
    x = torch.randn(4, 16, requires_grad=True)
    policy = _keep(MM)

    def wrapped():
        with tapes(True, programs=False):
            return remat.checkpoint(layer, x, policy=policy)

    _steps(lambda: layer(x), wrapped, [x, *layer.parameters()])
    assert runs == [] and _program_of(policy) is not None


def test_retained_and_partial_backward_run_the_program_each_time(runs):
    torch.manual_seed(0)
    layer = Layer()
    x = torch.randn(4, 16, requires_grad=True)
    params = [x, *layer.parameters()]
    policy = _keep(MM)
    remat.checkpoint(layer, x, policy=policy).sum().backward()  # records
    expected = torch.autograd.grad(layer(x).sum(), params)
    out = remat.checkpoint(layer, x, policy=policy).sum()
    first = torch.autograd.grad(out, params, retain_graph=True)
    second = torch.autograd.grad(out, params)
    assert_bitwise(expected, first)
    assert_bitwise(expected, second)
    assert len(runs) == 2


def test_a_kept_output_modified_after_forward_is_an_error_or_recomputed(runs):
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(8, 8, requires_grad=True)
    policy = _keep(MM)
    kept = []

    def fn(t):
        h = t @ w
        kept.append(h)
        return h.sin().cos()

    remat.checkpoint(fn, x, policy=policy).sum().backward()  # records
    out = remat.checkpoint(fn, x, policy=policy)
    kept[-1].mul_(2)  # autograd never saved h: only the kept output sees the change
    with pytest.raises(RuntimeError, match="modified in place after forward"):
        out.sum().backward()
    context = functools.partial(remat.create_selective_checkpoint_contexts, policy, allow_cache_entry_mutation=True)
    expected = torch.autograd.grad(fn(x).sum(), [x, w])
    out = remat.checkpoint(fn, x, context_fn=context)
    kept[-1].mul_(2)
    assert_bitwise(expected, torch.autograd.grad(out.sum(), [x, w]))


def llama_pair():
    """A tiny HF Llama (SDPA) with its layers under ``save_matmuls``, an unwrapped twin, and token ids."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="sdpa", use_cache=False)
    model = transformers.LlamaForCausalLM(cfg).train()
    reference = transformers.LlamaForCausalLM(cfg).train()
    reference.load_state_dict(model.state_dict())
    remat.apply_activation_checkpointing(model, check_fn=lambda m: type(m).__name__ == "LlamaDecoderLayer",
                                         policy=save_matmuls)
    return model, reference, torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))


def test_a_hugging_face_llama_layer_with_sdpa_runs_its_program_bitwise():
    model, reference, ids = llama_pair()
    refills = []
    real = selective_module.run
    selective_module.run = lambda program, plan, *a: refills.append(len(plan.order)) or real(program, plan, *a)
    try:
        for step in range(3):
            expected = grads(lambda: reference(input_ids=ids, labels=ids).loss, list(reference.parameters()), step)
            got = grads(lambda: model(input_ids=ids, labels=ids).loss, list(model.parameters()), step)
            assert_bitwise(expected[1], got[1])
    finally:
        selective_module.run = real
    assert len(refills) == 4  # both layers, in the two steps that followed their tapes


def test_a_kept_output_no_tape_can_capture_is_fine_where_no_dropped_tensor_needs_it(runs):
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(8, 8, requires_grad=True)
    asked = [0]

    def rule(op):
        asked[0] += 1
        return CheckpointPolicy.MUST_SAVE if op in (torch.ops.aten.mm.default, torch.ops.aten.mul.Tensor) else None

    policy = Policy(op_rule=rule, name="mm and mul")

    def fn(t):
        h = t @ w
        u = h * 3  # kept, but autograd saves nothing of it: a follower cannot capture it
        s = h.sin()  # dropped: rebuilt from the served matmul alone
        return s.cos() + (u + 1)

    for step in range(3):
        asked[0] = 0
        _steps(lambda: fn(x), lambda: remat.checkpoint(fn, x, policy=policy), [x, w], count=1)
        assert (asked[0] > 0) == (step == 0)  # recorded once, then followed
    assert len(runs) == 2


def test_a_kept_output_no_tape_can_capture_refuses_the_tape_where_a_dropped_tensor_needs_it():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(8, 8, requires_grad=True)
    policy = _keep({torch.ops.aten.mm.default, torch.ops.aten.mul.Tensor})

    def fn(t):
        u = (t @ w) * 3  # kept, not capturable, and the dropped sine input below is made from it
        return (u + 1).sin()

    _steps(lambda: fn(x), lambda: remat.checkpoint(fn, x, policy=policy), [x, w])
    (entry,) = _books[policy].tapes.values()
    assert entry[1] is None  # recorded on every call, as the policy asks


def _write_unseen(target, source):
    """Copy ``source`` into ``target`` the way a Triton or extension kernel writes: straight to memory, with no
    aten op, nor a Python read of a tensor's data, for the recording to see."""
    nbytes = target.numel() * target.element_size()
    ctypes.memmove(target.untyped_storage().data_ptr(), source.contiguous().untyped_storage().data_ptr(), nbytes)


class _Opaque(torch.autograd.Function):
    """Squares its input into a buffer with a write no aten op shows."""

    @staticmethod
    def forward(ctx, x):
        out = torch.zeros_like(x)
        _write_unseen(out, x.detach() ** 2)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 2 * x


def _opaque_function(w):
    def fn(t):
        return _Opaque.apply(t @ w).sin()  # sin saves what only the opaque write made
    return fn


def _opaque_buffer(w):
    def fn(t):
        h = (t @ w).sin()
        buffer = torch.empty_like(h)
        _write_unseen(buffer, torch.full_like(h, 2.0))
        return (h * buffer).cos()  # saves the buffer, which only the opaque write filled
    return fn


def _python_read(w):
    def fn(t):
        h = (t @ w).sin()
        scale = max(h.detach().flatten().tolist())  # a number later ops take as a constant
        return h.cos() * scale
    return fn


def _no_grad_write(w):
    def fn(t):
        h = (t @ w).sin()
        with torch.no_grad():  # an extension writing a buffer an op made (a histogram, an atomic add)
            buffer = torch.zeros_like(h)
            _write_unseen(buffer, h * 2)
        return (h * buffer).cos()
    return fn


def _value_shaped(w):
    def fn(t):
        h = (t @ w).sin()
        chosen = h[h > 0]  # as many as are positive: the view below takes that count as a constant
        return (chosen.view(chosen.shape[0], 1) * 2).sin()
    return fn


@pytest.mark.parametrize(("make", "why"), [(_opaque_function, "custom autograd.Function"),
                                           (_no_grad_write, "with grad disabled"),
                                           (_value_shaped, "shape depends on values"),
                                           (_opaque_buffer, "empty-like op"),
                                           (_python_read, "Python reads a tensor's data (tolist)")])
def test_what_no_aten_op_shows_gets_no_program(runs, make, why):
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(8, 8, requires_grad=True)
    fn, policy = make(w), _keep(MM)
    _steps(lambda: fn(x), lambda: remat.checkpoint(fn, x, policy=policy), [x, w])
    (entry,) = _books[policy].tapes.values()
    assert entry[1].program is None and why in entry[1].no_program
    assert runs == []


def test_inputs_that_share_memory_when_recorded_get_no_program(runs):
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    x, y = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)

    def fn(a, b):
        return ((a.sin() @ w) * b).cos()  # the sine of a is dropped and rebuilt from a

    policy = _keep(MM)
    for a, b in [(x, x), (x, y), (y, x)]:
        expected = torch.autograd.grad(fn(a, b).sum(), [x, y, w], allow_unused=True)
        got = torch.autograd.grad(remat.checkpoint(fn, a, b, policy=policy).sum(), [x, y, w], allow_unused=True)
        assert_bitwise(expected, got)
    (entry,) = _books[policy].tapes.values()
    assert "two inputs share memory" in entry[1].no_program and runs == []


def test_a_region_that_sets_the_rng_gets_no_program(runs):
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(8, 8, requires_grad=True)

    def fn(t):
        h = (t @ w).sin()
        torch.manual_seed(3)  # the Python rerun seeds again; a program would draw on from the region's start
        return h * torch.rand_like(h)

    policy = _keep(MM)
    _steps(lambda: fn(x), lambda: remat.checkpoint(fn, x, policy=policy), [x, w])
    (entry,) = _books[policy].tapes.values()
    assert "sets the RNG" in entry[1].no_program and runs == []


def test_a_negative_view_is_told_from_its_base(runs):
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)

    def fn(t):
        h = t * t
        return (h.exp() * torch.ops.aten._neg_view(h).sin()).sum(-1)  # the view shares h's storage and strides

    policy = _keep(set())
    _steps(lambda: fn(x), lambda: remat.checkpoint(fn, x, policy=policy), [x])
    assert len(runs) == 2


def test_a_draw_rerun_for_the_rng_alone_is_let_go_at_once():
    # Every draw reruns so the last one draws as in forward, but only the last one's output is needed:
    # the others must not pile up (the Python rerun frees each as it goes).
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)

    def fn(t):
        h = t
        for _ in range(6):
            h = (h + torch.randn_like(h)).sigmoid()  # kept: it saves its own output
        return (h * torch.rand_like(h)).sin()

    policy = _keep({torch.ops.aten.sigmoid.default})
    held = []
    real = selective_module.run

    def watching(program, plan, *args):
        for number in plan.order:
            step = program.steps[number]
            if step.random:
                op = step.op

                def counted(*a, op=op, **k):
                    held.append(sum(t.numel() == 64 * 64 for t in live))
                    out = op(*a, **k)
                    live.add(out)
                    return out

                program.steps[number] = dataclasses.replace(step, op=counted)
        return real(program, plan, *args)

    live = weakref.WeakSet()
    selective_module.run = watching
    try:
        _steps(lambda: fn(x), lambda: remat.checkpoint(fn, x, policy=policy), [x], count=2)
    finally:
        selective_module.run = real
    assert len(held) == 7 and max(held) <= 1  # no earlier draw is alive when the next one runs


def test_two_outside_tensors_on_one_memory_are_checked_apart(runs):
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = nn.Parameter(torch.randn(8))
            self.q = self.p.detach()  # a plain attribute on the parameter's memory

        def forward(self, t):
            return ((t @ w) * self.p * self.q).sin()

    module, policy = Scaled(), _keep(MM)
    for step in range(4):
        if step == 2:
            module.q = torch.randn(8)  # another tensor now: autograd saves it where the program read the old one
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).requires_grad_()
        params = [x, w, module.p]
        assert_bitwise(torch.autograd.grad(module(x).sum(), params),
                       torch.autograd.grad(remat.checkpoint(module, x, policy=policy).sum(), params))
    assert len(runs) == 1  # the second step; from the third on the follower sees another tensor saved


def test_a_sparse_tensor_in_a_region_records_and_follows():
    torch.manual_seed(0)
    indices = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])
    adjacency = torch.sparse_coo_tensor(indices, torch.ones(4), (4, 4), check_invariants=True).coalesce()
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def fn(a, t):
        return torch.sparse.mm(a, (t @ w).sin()).cos()

    _steps(lambda: fn(adjacency, x), lambda: remat.checkpoint(fn, adjacency, x, policy=save_matmuls), [x, w])
