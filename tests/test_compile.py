"""torch.compile: remat's regions and policies compile into the graph, fullgraph, in both orders.

Under dynamo, remat.checkpoint lowers to the compiler's activation-checkpoint op; these tests check that
the compiled programs are the ones PyTorch's checkpoint compiles to (same saved bytes, bitwise gradients),
that remat's policies, op lists, policy functions and tags reach the compiled graph, and that remat's
eager engine is never traced.

Saved bytes are those reaching an outer saved_tensors_hooks around the forward: distinct storages, parameters
excluded (deterministic). With aot_eager the compiled step runs eager kernels, so gradients are bitwise equal
to plain eager autograd, dropout included. Inductor draws dropout masks with its own generator and fuses
kernels, so there remat is compared bitwise with PyTorch's checkpoint compiled the same way, and (without
dropout) with eager within float32 rounding.

Inductor on CPU compiles C++ slowly: its tests use one tiny MLP, and remat's graph equals torch's, so the
second of each pair is an FX-graph-cache hit.
"""

import functools
import importlib

import pytest
import torch
import torch.utils.checkpoint as torch_ckpt
from helpers import MLPBlock, MLPStack, assert_bitwise
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_wrappers

import remat
from remat.models import GPT, Block, GPTConfig
from remat.planning.basics.memory import saved_bytes
from remat.policies.rules import MATMUL_OPS, offload_names, save_all_but_names, save_matmuls, save_names

PROJ = save_names("up")  # policies are built once, outside compiled code (see the last test)
KEEP_ALL = save_all_but_names()
CHECKPOINT_MODULE = importlib.import_module("remat.api.checkpoint")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def run(model, x, seed=3):
    """Loss and gradients (input first) of one step with a fixed RNG seed."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.manual_seed(seed)
    loss = model(x).float().pow(2).mean()
    params = list(model.parameters())
    return loss.detach(), torch.autograd.grad(loss, [x, *params])


def mlp(p=0.25):
    torch.manual_seed(0)
    return MLPStack(depth=2, width=16, hidden=32, p=p)


def is_block(m):
    return isinstance(m, MLPBlock)


def remat_wrapped(model, **kwargs):
    remat.apply_activation_checkpointing(model, check_fn=is_block, **kwargs)
    return model


def torch_wrapped(model, context_fn=None):
    extra = {} if context_fn is None else {"context_fn": context_fn}
    wrapper = functools.partial(torch_wrappers.checkpoint_wrapper, **extra)
    torch_wrappers.apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=is_block)
    return model


def compile_whole(model, backend):
    return torch.compile(model, backend=backend, fullgraph=True)


def compile_blocks(model, backend):
    # torchtitan's order: wrap each block, then compile each wrapped block
    for block in model.blocks:
        block.compile(backend=backend, fullgraph=True)
    return model


X = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("order", [compile_whole, compile_blocks], ids=["whole-model", "per-block"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fullgraph_in_both_orders_matches_torch_checkpoint(order, backend):
    p = 0.25 if backend == "aot_eager" else 0.0
    ours, theirs, plain = order(remat_wrapped(mlp(p)), backend), order(torch_wrapped(mlp(p)), backend), mlp(p)
    got, reference, eager = run(ours, X), run(theirs, X), run(plain, X)
    assert_bitwise((got[0], *got[1]), (reference[0], *reference[1]))
    if backend == "aot_eager":
        assert_bitwise((got[0], *got[1]), (eager[0], *eager[1]))  # dropout included
    else:
        for a, b in zip(got[1], eager[1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # fused kernels round differently
    bytes_ours = saved_bytes(lambda: ours(X).pow(2).mean(), ours.parameters())
    bytes_torch = saved_bytes(lambda: theirs(X).pow(2).mean(), theirs.parameters())
    bytes_plain = saved_bytes(lambda: plain(X).pow(2).mean(), plain.parameters())
    # (with aot_eager each region with dropout also keeps the 5 KB CPU generator state to replay its RNG)
    assert bytes_ours == bytes_torch < bytes_plain


def _torch_policy(decide):
    def policy(ctx, op, *args, **kwargs):
        return torch_ckpt.CheckpointPolicy[decide(op).name]

    return policy


def _keep_matmuls(op):
    return remat.CheckpointPolicy.PREFER_SAVE if op in MATMUL_OPS else remat.CheckpointPolicy.PREFER_RECOMPUTE


def _keep_gelu(ctx, op, *args, **kwargs):
    return remat.CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.gelu.default else \
        remat.CheckpointPolicy.PREFER_RECOMPUTE


FORMS = {
    "Policy object": ({"policy": save_matmuls}, _keep_matmuls),
    "op list": (
        {"context_fn": functools.partial(remat.create_selective_checkpoint_contexts, [torch.ops.aten.addmm.default])},
        lambda op: remat.CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.addmm.default
        else remat.CheckpointPolicy.PREFER_RECOMPUTE,
    ),
    "policy function": (
        {"context_fn": functools.partial(remat.create_selective_checkpoint_contexts, _keep_gelu)},
        lambda op: _keep_gelu(None, op),
    ),
    "policy= function": ({"policy": _keep_gelu}, lambda op: _keep_gelu(None, op)),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_policies_reach_the_compiled_graph(form):
    kwargs, decide = FORMS[form]
    checkpoint_fn = functools.partial(remat.checkpoint, **kwargs)
    ours = compile_whole(remat_wrapped(mlp(), checkpoint_wrapper_fn=functools.partial(
        remat.checkpoint_wrapper, checkpoint_fn=checkpoint_fn)), "aot_eager")
    theirs = compile_whole(torch_wrapped(mlp(), context_fn=functools.partial(
        torch_ckpt.create_selective_checkpoint_contexts, _torch_policy(decide))), "aot_eager")
    plain_ckpt = compile_whole(remat_wrapped(mlp()), "aot_eager")
    assert_bitwise(run(ours, X)[1], run(mlp(), X)[1])
    sizes = [saved_bytes(lambda m=m: m(X).pow(2).mean(), m.parameters()) for m in (ours, theirs, plain_ckpt)]
    assert sizes[0] == sizes[1] > sizes[2], sizes  # the policy kept something, exactly what torch's kept


def _tagged_block_model():
    torch.manual_seed(0)
    up, down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def block(x):
        h = remat.tag(up(x), "up")
        return down(torch.nn.functional.gelu(h)).sin()

    return block, [up.weight, up.bias, down.weight, down.bias]


@pytest.mark.parametrize(
    "policy, extra_bytes",
    [(None, 0), (PROJ, 64 * 32 * 4), (offload_names("up"), 64 * 32 * 4), (save_all_but_names("up"), None)],
    ids=["none", "save_names", "offload_names", "save_all_but_names"],
)
def test_tags_and_name_policies_under_compile(policy, extra_bytes):
    block, params = _tagged_block_model()
    x = X.clone().requires_grad_()
    step = torch.compile(lambda t: remat.checkpoint(block, t, policy=policy).sum(), backend="aot_eager",
                         fullgraph=True)
    expected = torch.autograd.grad(block(x).sum(), [x, *params])
    assert_bitwise(torch.autograd.grad(step(x), [x, *params]), expected)
    plain_ckpt = torch.compile(lambda t: remat.checkpoint(block, t).sum(), backend="aot_eager", fullgraph=True)
    base = saved_bytes(lambda: plain_ckpt(x), params)
    got = saved_bytes(lambda: step(x), params)
    if extra_bytes is not None:
        # the tagged (64, 32) float32 tensor is kept; CPU_OFFLOAD keeps it too (compile cannot offload)
        assert got == base + extra_bytes
    else:
        everything = torch.compile(lambda t: remat.checkpoint(block, t, policy=KEEP_ALL).sum(),
                                   backend="aot_eager", fullgraph=True)
        assert base < got < saved_bytes(lambda: everything(x), params)  # all but the tagged tensor kept


def test_gpt_with_attention_and_save_matmuls_matches_torch():
    cfg = GPTConfig(d_model=32, n_heads=2, n_layers=2, seq_len=16, vocab_size=64, dropout=0.1)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))

    def build(wrap):
        torch.manual_seed(0)
        model = GPT(cfg)
        wrap(model)
        return model

    def loss(model):
        torch.manual_seed(3)
        return model.loss(tokens, tokens)

    ours = build(lambda m: remat.apply_activation_checkpointing(m, check_fn=lambda b: isinstance(b, Block),
                                                                policy=save_matmuls))
    theirs = build(lambda m: torch_wrappers.apply_activation_checkpointing(
        m, check_fn=lambda b: isinstance(b, Block), checkpoint_wrapper_fn=functools.partial(
            torch_wrappers.checkpoint_wrapper,
            context_fn=functools.partial(torch_ckpt.create_selective_checkpoint_contexts,
                                         _torch_policy(_keep_matmuls)))))
    plain = build(lambda m: None)
    for model in (ours, theirs):
        model.loss = torch.compile(model.loss, backend="aot_eager", fullgraph=True)
    params = list(plain.parameters())
    expected = torch.autograd.grad(loss(plain), params)
    assert_bitwise(torch.autograd.grad(loss(ours), list(ours.parameters())), expected)
    sizes = [saved_bytes(lambda m=m: loss(m), m.parameters()) for m in (ours, theirs, plain)]
    assert sizes[0] == sizes[1] < sizes[2], sizes


def test_a_block_policy_keeping_dropout_draws_compiles_and_recomputes_them():
    # An eager profile names dropout's in-place draws (bernoulli_); under dynamo dropout is native_dropout, and
    # in-place ops are recomputed without asking the policy: the plan compiles, its kept draws are recomputed.
    from remat.planning.basics.blockpolicy import BlockPolicy, OpDecision, apply_block_policies

    keeps_draw = BlockPolicy("selective", [OpDecision("aten.bernoulli_.float", 0, 64 * 16 * 4, "keep")])
    ours = mlp()
    apply_block_policies(ours, {"blocks.0": keeps_draw, "blocks.1": keeps_draw})
    eager = run(ours, X)
    compiled = compile_whole(ours, "aot_eager")
    assert_bitwise(run(compiled, X)[1], run(mlp(), X)[1])
    assert_bitwise(eager[1], run(mlp(), X)[1])
    plain_ckpt = compile_whole(remat_wrapped(mlp()), "aot_eager")
    assert saved_bytes(lambda: compiled(X).pow(2).mean(), compiled.parameters()) == \
        saved_bytes(lambda: plain_ckpt(X).pow(2).mean(), plain_ckpt.parameters())

    def draw_in_place(t):
        h = t @ t.t()
        return (h * torch.empty_like(h).bernoulli_(0.7)).sin()

    keep = remat.policies.Policy(op_rule=lambda op: remat.CheckpointPolicy.MUST_SAVE
                                 if op is torch.ops.aten.bernoulli_.float else None)
    step = torch.compile(lambda t: remat.checkpoint(draw_in_place, t, policy=keep).sum(), backend="aot_eager",
                         fullgraph=True)
    x = X.clone().requires_grad_()
    torch.manual_seed(3)
    got = torch.autograd.grad(step(x), x)
    torch.manual_seed(3)
    assert_bitwise(got, torch.autograd.grad(draw_in_place(x).sum(), x))


def test_reentrant_wrappers_and_checkpoint_sequential_compile_fullgraph():
    reentrant = compile_whole(remat_wrapped(mlp(), use_reentrant=True), "aot_eager")
    nonreentrant = compile_whole(remat_wrapped(mlp()), "aot_eager")
    assert_bitwise(run(reentrant, X)[1], run(mlp(), X)[1])
    assert saved_bytes(lambda: reentrant(X).sum(), reentrant.parameters()) == \
        saved_bytes(lambda: nonreentrant(X).sum(), nonreentrant.parameters())
    seq = torch.nn.Sequential(*mlp().blocks, *mlp().blocks)
    step = torch.compile(lambda t: remat.checkpoint_sequential(seq, 2, t).sum(), backend="aot_eager", fullgraph=True)
    x = X.clone().requires_grad_()
    torch.manual_seed(3)
    got = torch.autograd.grad(step(x), [x, *seq.parameters()])
    torch.manual_seed(3)
    assert_bitwise(got, torch.autograd.grad(seq(x).sum(), [x, *seq.parameters()]))


def test_dynamo_never_traces_the_eager_engine(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("remat's eager engine ran under torch.compile")

    monkeypatch.setattr(CHECKPOINT_MODULE, "run_nonreentrant", refuse)
    monkeypatch.setattr(CHECKPOINT_MODULE.CheckpointFunction, "apply", refuse)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    for use_reentrant in (False, True):
        torch._dynamo.reset()
        model = torch.compile(remat_wrapped(mlp(), use_reentrant=use_reentrant), backend=backend, fullgraph=True)
        run(model, X)
    assert len(graphs) == 2
    for graph in graphs:
        hops = [n for n in graph.graph.nodes if n.target is torch.ops.higher_order.tag_activation_checkpoint]
        assert len(hops) == 2  # one compiler checkpoint region per block, in one graph


def test_graph_break_inside_a_region_still_gives_right_gradients():
    block, params = _tagged_block_model()

    def breaking(x):
        h = block(x)
        torch._dynamo.graph_break()
        return h.cos()

    x = X.clone().requires_grad_()
    step = torch.compile(lambda t: remat.checkpoint(breaking, t, policy=PROJ).sum() * 2, backend="aot_eager")
    assert_bitwise(torch.autograd.grad(step(x), [x, *params]),
                   torch.autograd.grad(breaking(x).sum() * 2, [x, *params]))


def test_offload_wrapper_is_a_graph_break_with_right_gradients():
    model = mlp()
    model.blocks[0] = remat.offload_wrapper(model.blocks[0], min_bytes=0)
    expected = run(mlp(), X)
    assert_bitwise(run(torch.compile(model, backend="aot_eager"), X)[1], expected[1])
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        run(torch.compile(model, backend="aot_eager", fullgraph=True), X)


def test_eager_only_options_under_compile():
    block, params = _tagged_block_model()
    x = X.clone().requires_grad_()
    # debug traces and the determinism check have nothing to compare in a compiled graph: accepted, no effect
    step = torch.compile(lambda t: remat.checkpoint(block, t, debug=True, determinism_check="none").sum(),
                         backend="aot_eager", fullgraph=True)
    assert_bitwise(torch.autograd.grad(step(x), [x, *params]), torch.autograd.grad(block(x).sum(), [x, *params]))
    torch._dynamo.reset()
    bad = torch.compile(lambda t: remat.checkpoint(block, t, determinism_check="shapes").sum(), backend="aot_eager")
    with pytest.raises(ValueError, match="determinism_check"):
        bad(x)


def test_context_fn_that_is_not_selective_is_refused_under_compile():
    block, _ = _tagged_block_model()
    step = torch.compile(lambda t: remat.checkpoint(block, t, context_fn=_autocast_contexts).sum(),
                         backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="only selective-checkpoint contexts"):
        step(X.clone().requires_grad_())


def _autocast_contexts():
    return torch.autocast("cpu"), torch.autocast("cpu")


def test_compiled_block_inside_eager_checkpoint():
    # the other nesting: an eager remat region whose function is compiled code, recomputed by calling it again
    block, params = _tagged_block_model()
    compiled = torch.compile(block, backend="aot_eager")
    x = X.clone().requires_grad_()
    expected = torch.autograd.grad(compiled(x).sum(), [x, *params])
    assert_bitwise(torch.autograd.grad(remat.checkpoint(compiled, x).sum(), [x, *params]), expected)


def test_a_policy_built_inside_compiled_code_is_reported():
    # dynamo hands the compiler constants only; a Policy object made while tracing is not one
    block, _ = _tagged_block_model()
    step = torch.compile(lambda t: remat.checkpoint(block, t, policy=save_names("up")).sum(), backend="aot_eager",
                         fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="Policy"):
        step(X.clone().requires_grad_())
