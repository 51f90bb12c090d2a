"""Op-level plans: per-op block graphs, exact per-block fronts, installed policies (bytes exact, gradients bitwise)."""

import dataclasses
import itertools
import json
import random

import pytest
import torch
from helpers import MLPBlock, MLPStack, assert_bitwise, held_after_forward
from torch import nn

import remat
from remat.models import GPT, Block, GPTConfig, synthetic_batch
from remat.planning.basics.blockpolicy import (
    BlockPolicy,
    OpDecision,
    apply_block_policies,
    remove_block_policies,
    resolve_op,
)
from remat.planning.choices.fronts import (
    block_front,
    evaluate,
    fronts,
    needed_ops,
    offload_twins,
    policy_for,
    thin_front,
)
from remat.planning.measure.opgraph import profile_ops
from remat.planning.measure.overheads import Overheads, measure_overheads
from remat.tools.bench import WideBlock

# Fixed machinery costs and CPU-like roofline times keep every front here independent of the machine's timing.
CPU_LIKE = {"throughput": 20e9, "bandwidth": 5e9}
FIXED = Overheads(region=2e-5, per_saved=1e-6, policy_forward=1e-6, policy_replay=5e-7,
                  copy_per_byte=2 / CPU_LIKE["bandwidth"])


def _gpt_block():
    torch.manual_seed(0)
    cfg = GPTConfig(seq_len=32, d_model=32, n_heads=2, n_layers=2, vocab_size=64, dropout=0.1)
    return Block(cfg), (2, 32, 32)


def _mlp_block():
    torch.manual_seed(0)
    return MLPBlock(64, 256, 0.25), (8, 32, 64)


class _Tiny(nn.Module):
    """Twelve keepable ops (the dropout mask's draw among them) and a residual: small enough to try every
    subset.  Three of them (the product, the square and their sum) are saved by nothing: kept, they spare
    their kernels in the replay all the same."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        h = self.a(self.ln(x))
        h = torch.tanh(h) * torch.sigmoid(h) + h.square()
        return x + self.drop(self.b(h.relu().exp().cos()))


class _InPlace(nn.Module):
    """A linear whose output a ReLU overwrites in place: that output must never be kept."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.act = nn.ReLU(inplace=True)
        self.b = nn.Linear(32, 16)

    def forward(self, x):
        return x + self.b(self.act(self.a(x)).sin())


def _graph(block, shape, **kwargs):
    holder = nn.Sequential(block)
    x = torch.randn(shape, requires_grad=True)
    options = {"timing": "estimate", "overheads": FIXED, **CPU_LIKE, **kwargs}
    return profile_ops(holder, x, modules=["0"], **options).blocks["0"]


def _input(shape):
    torch.manual_seed(1)
    return torch.randn(shape, requires_grad=True)


def _grads(module, block, shape):
    x = _input(shape)
    torch.manual_seed(7)  # the dropout masks
    y = module(x)
    loss = (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum()
    return torch.autograd.grad(loss, [x, *block.parameters()])


def _names(graph, point):
    return {(graph.nodes[i].op, graph.nodes[i].call) for i in point.kept}


BLOCKS = {"gpt": _gpt_block, "mlp": _mlp_block}


@pytest.mark.parametrize("build", BLOCKS.values(), ids=BLOCKS.keys())
def test_front_is_monotone_and_ends_at_checkpoint_all_and_keep_all(build):
    block, shape = build()
    graph = _graph(block, shape)
    front = block_front(graph)
    assert len(front) >= 3
    assert all(a.kept_bytes < b.kept_bytes and a.extra_time > b.extra_time for a, b in itertools.pairwise(front))
    first, last = front[0], front[-1]
    assert first == evaluate(graph, "checkpoint") and first.kept_bytes == graph.input_bytes
    assert last.mode == "keep" and last.kept_bytes == graph.keep_all_bytes and last.extra_time == 0
    # The ends, measured: plain autograd keeps exactly what the pack hook saw, checkpointing nothing but inputs.
    assert held_after_forward(block, block, shape) == graph.keep_all_bytes - graph.input_saved_bytes
    assert held_after_forward(remat.checkpoint_wrapper(block), block, shape) == 0
    assert all(p.mode == "selective" for p in front[1:-1])


@pytest.mark.parametrize("seed", range(5))
def test_front_is_the_optimum_over_every_subset(seed):
    torch.manual_seed(seed)
    graph = _graph(_Tiny(), (4, 8))
    assert len(graph.keepable) == 12
    rng = random.Random(seed)
    if seed:  # arbitrary op times and machinery costs: the solver must be exact for any of them
        graph.nodes = [dataclasses.replace(n, kernel_time=rng.uniform(0, 1e-3), wall_time=rng.uniform(1e-3, 2e-3))
                       for n in graph.nodes]
        graph.overheads = Overheads(*(rng.uniform(0, 1e-4) for _ in range(4)), copy_per_byte=rng.uniform(0, 1e-9))
    front = block_front(graph)
    candidates = [evaluate(graph, "keep"), evaluate(graph, "checkpoint")]
    for k in range(1, len(graph.keepable) + 1):
        candidates += [evaluate(graph, "selective", kept) for kept in itertools.combinations(graph.keepable, k)]
    tolerance = 1e-12
    for c in candidates:  # nothing beats the front
        assert any(p.kept_bytes <= c.kept_bytes and p.extra_time <= c.extra_time + tolerance for p in front), c
    for p in front:  # every front point is reachable and no candidate strictly beats it
        assert p in candidates
        assert not any(c.kept_bytes <= p.kept_bytes and c.extra_time < p.extra_time - tolerance for c in candidates)
    levels = sorted({c.kept_bytes for c in candidates})
    for budget in levels:  # the cheapest plan under every budget is on the front
        best = min(c.extra_time for c in candidates if c.kept_bytes <= budget)
        on_front = min(p.extra_time for p in front if p.kept_bytes <= budget)
        assert on_front == pytest.approx(best, rel=tolerance, abs=tolerance)


@pytest.mark.parametrize("build", BLOCKS.values(), ids=BLOCKS.keys())
def test_installed_points_match_autograd_bitwise_and_keep_the_predicted_bytes(build):
    block, shape = build()
    graph = _graph(block, shape)
    reference = _grads(block, block, shape)
    rng = random.Random(0)
    points = thin_front(block_front(graph), 6)
    points += [evaluate(graph, "selective", rng.sample(graph.keepable, k)) for k in (1, 2, len(graph.keepable))]
    for point in points:
        policy = policy_for(graph, point)
        loaded = BlockPolicy.from_dict(json.loads(json.dumps(policy.to_dict())))
        assert loaded == policy and loaded.kept == policy.kept
        assert loaded.kept_bytes == point.kept_bytes - point.input_bytes or point.mode == "keep"
        wrapped = loaded.wrap(block)
        assert_bitwise(_grads(wrapped, block, shape), reference)
        assert held_after_forward(wrapped, block, shape) == point.kept_bytes - point.input_bytes, point


def test_dropout_draws_are_keepable_by_value_and_the_recomputation_stops_at_the_last_saved_tensor():
    block, shape = _gpt_block()
    graph = _graph(block, shape)
    random_ops = [n for n in graph.nodes if n.random]
    assert [n.op for n in random_ops] == ["aten.bernoulli_.float"] * 3
    # The masks' storages are written in place after they are made: keeping them would change the kept value.
    masks = [graph.nodes[n.needs[0]] for n in random_ops]
    assert all(m.op == "aten.empty_like.default" and m.mutated and m.index not in graph.keepable for m in masks)
    # The draws are keepable, by value: a copy of the mask as bernoulli_ wrote it, as large as the mask.
    for draw, mask in zip(random_ops, masks):
        assert draw.kind == "alias" and draw.index in graph.keepable
        assert draw.out_bytes == graph.copied_bytes(draw.index) == mask.out_bytes
        # Keeping one saves its kernel and pays two copies of its bytes, forward's and recomputation's.
        saved = evaluate(graph, "selective").extra_time - evaluate(graph, "selective", [draw.index]).extra_time
        copies = 2 * draw.out_bytes * graph.overheads.copy_per_byte
        assert saved == pytest.approx(draw.kernel_time - copies, rel=1e-9, abs=1e-15)
    # The last saved tensor is the final dropout's mask: its multiply and the residual add never rerun.
    assert [n.op for n in graph.nodes[graph.stop:]] == ["aten.mul.Tensor", "aten.add.Tensor"]
    everything = evaluate(graph, "selective", graph.keepable)
    assert everything.recomputed_ops == sum(1 for n in graph.nodes[:graph.stop] if n.index not in graph.keepable)
    # A replay that skipped unneeded ops would still have to run every random op that is not kept.
    assert {n.index for n in random_ops} <= needed_ops(graph, [])
    assert random_ops[1].index not in needed_ops(graph, [random_ops[1].index])
    assert "random: served" in str(graph)


def test_outputs_overwritten_in_place_are_never_kept_and_the_rest_installs_exactly():
    torch.manual_seed(0)
    block, shape = _InPlace(), (4, 16)
    graph = _graph(block, shape)
    first_linear = next(n for n in graph.nodes if n.op == "aten.addmm.default")
    assert first_linear.mutated and first_linear.index not in graph.keepable
    point = evaluate(graph, "selective", graph.keepable)
    wrapped = policy_for(graph, point).wrap(block)
    assert_bitwise(_grads(wrapped, block, shape), _grads(block, block, shape))
    assert held_after_forward(wrapped, block, shape) == point.kept_bytes - point.input_bytes


def test_attention_core_is_dropped_before_the_linear_outputs():
    # Korthikanti et al.'s selective recomputation, found by the solver: on an accelerator-like roofline
    # (FLOPs at 100 TFLOP/s, bytes at 2 TB/s) the scores, softmax and dropout are large and cheap.
    cfg = GPTConfig(seq_len=2048, d_model=2048, n_heads=16, n_layers=2, vocab_size=128)
    with torch.device("meta"):
        model = GPT(cfg)
        tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))
    graph = profile_ops(model, tokens, overheads=FIXED).blocks["blocks.0"]
    assert graph.estimated
    front = block_front(graph)
    core = {("aten.bmm.default", 0), ("aten.add.Tensor", 0), ("aten._safe_softmax.default", 0), ("aten.mul.Tensor", 0)}
    linear = {("aten.addmm.default", i) for i in range(4)}
    linears_first = min(p.kept_bytes for p in front if linear <= _names(graph, p) and not core & _names(graph, p))
    core_first = min(p.kept_bytes for p in front if core & _names(graph, p))
    assert linears_first < core_first
    assert linears_first < 0.3 * graph.keep_all_bytes  # the attention core is most of the block's memory


def test_identical_blocks_share_one_graph_and_one_front():
    torch.manual_seed(0)
    model = MLPStack(depth=200, width=8, hidden=16)
    prof = profile_ops(model, torch.randn(4, 8, requires_grad=True), timing="estimate", overheads=FIXED)
    assert len(prof.blocks) == 200 and len(prof.distinct) == 1
    per_block = fronts(prof)
    assert len({id(front) for front in per_block.values()}) == 1
    hidden = [16, 32, 16, 64]
    chain = nn.Sequential(nn.Sequential(*[WideBlock(8, h) for h in hidden]))
    prof = profile_ops(chain, torch.randn(4, 8, requires_grad=True), timing="estimate", overheads=FIXED)
    assert len(prof.distinct) == 3 and prof.blocks["0.0"] is prof.blocks["0.2"]


def test_whole_model_plan_applies_removes_and_matches_autograd_bitwise():
    torch.manual_seed(0)
    cfg = GPTConfig(seq_len=32, d_model=32, n_heads=2, n_layers=3, vocab_size=64, dropout=0.1)
    model = GPT(cfg)
    tokens, targets = synthetic_batch(cfg, 2)
    keys = list(model.state_dict())
    params = list(model.parameters())

    def grads():
        torch.manual_seed(3)
        return torch.autograd.grad(model.loss(tokens, targets), params)

    reference = grads()
    prof = profile_ops(model, tokens, timing="estimate", overheads=FIXED, **CPU_LIKE)
    front = fronts(prof)["blocks.0"]
    chosen = {"blocks.0": front[0], "blocks.1": front[len(front) // 3], "blocks.2": front[2 * len(front) // 3]}
    policies = {name: policy_for(prof.blocks[name], point) for name, point in chosen.items()}
    assert [p.mode for p in policies.values()] == ["checkpoint", "selective", "selective"]
    apply_block_policies(model, policies)
    apply_block_policies(model, policies)  # re-applying replaces, never nests
    wrapped = [m for m in model.modules() if isinstance(m, remat.ActivationWrapper)]
    assert len(wrapped) == sum(p.mode != "keep" for p in policies.values())
    assert not any(isinstance(m._checkpoint_wrapped_module, remat.ActivationWrapper) for m in wrapped)
    assert list(model.state_dict()) == keys
    assert_bitwise(grads(), reference)
    remove_block_policies(model, list(policies))
    assert not any(isinstance(m, remat.ActivationWrapper) for m in model.modules())
    assert str(policies["blocks.1"]).startswith("selective: keeps") and "keep " in str(policies["blocks.1"])


def test_meta_profile_records_the_same_graph_as_the_real_one():
    cfg = GPTConfig(seq_len=32, d_model=32, n_heads=2, n_layers=2, vocab_size=64, dropout=0.1)
    torch.manual_seed(0)
    real = profile_ops(GPT(cfg), synthetic_batch(cfg, 2)[0], timing="estimate", overheads=FIXED)
    with torch.device("meta"):
        model = GPT(cfg)
        tokens = torch.zeros(2, cfg.seq_len, dtype=torch.long)
    meta = profile_ops(model, tokens, overheads=FIXED)
    a, b = real.blocks["blocks.0"], meta.blocks["blocks.0"]
    fields = ("op", "call", "kind", "random", "shapes", "out_bytes", "saved_bytes", "needs", "writes", "mutated")
    assert [[getattr(n, f) for f in fields] for n in a.nodes] == [[getattr(n, f) for f in fields] for n in b.nodes]
    assert (a.stop, a.keep_all_bytes, a.keepable) == (b.stop, b.keep_all_bytes, b.keepable)
    assert [p.kept_bytes for p in block_front(a)] == [p.kept_bytes for p in block_front(b)]


def test_measured_profile_leaves_rng_and_gradients_alone():
    block, shape = _mlp_block()
    x = _input(shape)
    state = torch.get_rng_state()
    graph = profile_ops(nn.Sequential(block), x, modules=["0"], repeats=1).blocks["0"]
    assert torch.equal(torch.get_rng_state(), state)
    assert all(p.grad is None for p in block.parameters())
    assert not graph.estimated and graph.forward_time > 0
    assert all(n.kernel_time >= 0 and n.wall_time >= n.kernel_time for n in graph.nodes)
    overheads = measure_overheads()
    assert all(value >= 0 for value in dataclasses.astuple(overheads))
    assert "recomputation runs" in str(graph) and "kept" in block_front(graph)[1].describe(graph)


def test_thin_front_keeps_both_ends():
    block, shape = _gpt_block()
    front = block_front(_graph(block, shape))
    thin = thin_front(front, 5)
    assert len(thin) <= 5 and thin[0] == front[0] and thin[-1] == front[-1]
    assert thin_front(front, len(front) + 3) == front
    with pytest.raises(ValueError, match="both ends"):
        thin_front(front, 1)


def test_bad_input_gets_clear_errors():
    with pytest.raises(ValueError, match="no operator named"):
        resolve_op("aten.not_an_op.default")
    with pytest.raises(ValueError, match="no operator named"):
        resolve_op("addmm")
    with pytest.raises(ValueError, match="unknown block policy mode"):
        BlockPolicy("sometimes")
    with pytest.raises(ValueError, match="keeps no op outputs"):
        BlockPolicy("checkpoint", [OpDecision("aten.addmm.default", 0, 4, "keep")])
    with pytest.raises(ValueError, match="one of \\['keep', 'offload', 'recompute'\\]"):
        BlockPolicy("selective", [OpDecision("aten.addmm.default", 0, 4, "maybe")])
    with pytest.raises(ValueError, match="not a block policy"):
        BlockPolicy.from_dict({"ops": []})
    block, shape = _mlp_block()
    graph = _graph(block, shape)
    alias = next(n.index for n in graph.nodes if n.kind == "alias")
    with pytest.raises(ValueError, match="cannot be kept"):
        evaluate(graph, "selective", [alias])
    with pytest.raises(ValueError, match="mode must be"):
        evaluate(graph, "offload")
    model = MLPStack(depth=2)
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="timing must be"):
        profile_ops(model, x, timing="guess")
    with pytest.raises(ValueError, match="no module named"):
        profile_ops(model, x, modules=["blocks.9"])
    with pytest.raises(ValueError, match="disjoint"):
        profile_ops(model, x, modules=["blocks", "blocks.0"])
    with pytest.raises(ValueError, match="no repeated blocks"):
        profile_ops(nn.Linear(16, 16), x)
    with pytest.raises(ValueError, match="no module named"):
        apply_block_policies(model, {"blocks.7": BlockPolicy("checkpoint")})
    apply_block_policies(model, {"blocks.0": BlockPolicy("checkpoint")})
    with pytest.raises(ValueError, match="remove them first"):
        profile_ops(model, x)


class _Failing(nn.Module):
    def forward(self, x):
        return x.sin() + torch.ones(3)  # shapes do not broadcast


def test_an_error_in_the_forward_leaves_no_hook_behind():
    model = nn.Sequential(_Failing(), _Failing())
    with pytest.raises(RuntimeError, match="size of tensor"):
        profile_ops(model, torch.randn(2, 4, requires_grad=True), timing="estimate", overheads=FIXED)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def _hugging_face(kind):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        return transformers.LlamaForCausalLM(cfg).train()
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.1,
                                  embd_pdrop=0.1, attn_pdrop=0.1)
    return transformers.GPT2LMHeadModel(cfg).train()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hugging_face_blocks_with_keyword_inputs_install_exactly(kind):
    model = _hugging_face(kind)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    # A padding mask: every transformers version hands it to the blocks as a keyword input (without one, GPT-2
    # in transformers 4.x gives its blocks the hidden states alone).
    mask = torch.ones_like(tokens)
    mask[1, 24:] = 0
    params = list(model.parameters())

    def grads():
        torch.manual_seed(3)
        # No KV cache: a cache written in forward would make the recomputation run other ops.
        return torch.autograd.grad(model(input_ids=tokens, attention_mask=mask, labels=tokens, use_cache=False).loss,
                                   params)

    reference = grads()
    prof = profile_ops(model, input_ids=tokens, attention_mask=mask, use_cache=False, timing="estimate",
                       overheads=FIXED, **CPU_LIKE)
    assert len(prof.blocks) == 2 and len(prof.distinct) == 1
    graph = prof.distinct[0]
    assert graph.input_bytes > 2 * 32 * 64 * 4  # the hidden states and the keyword inputs (masks, rotary tables)
    front = block_front(graph)
    for point in (front[0], front[len(front) // 2], front[-1]):
        apply_block_policies(model, {name: policy_for(graph, point) for name in prof.blocks})
        assert_bitwise(grads(), reference)
    remove_block_policies(model, list(prof.blocks))


def _on_an_accelerator(graph, link):
    """``graph`` priced as on an accelerator whose host link moves ``link`` bytes per second."""
    graph = dataclasses.replace(graph, overheads=dataclasses.replace(graph.overheads, link_bytes_per_s=link))
    graph.asynchronous = True
    return graph


def test_offload_twins_need_a_host_link_and_are_faster_at_equal_kept_bytes():
    block, shape = _gpt_block()
    cpu = _graph(block, shape)
    assert not offload_twins(cpu, block_front(cpu))  # the CPU: nowhere cheaper to put bytes
    with pytest.raises(ValueError, match="measured host link"):
        evaluate(cpu, "selective", [], [cpu.keepable[0]])
    most = {}
    for link in (1e8, 1e10):
        graph = _on_an_accelerator(cpu, link)
        front = block_front(graph)
        assert front == block_front(cpu) or all(not p.offloaded for p in front)  # the front itself: no offload
        twins = offload_twins(graph, front)
        assert twins, link
        for point in twins:
            # Same bytes kept as the point without offload, less time: each output moved spares its kernel.
            plain = evaluate(graph, "selective", point.kept)
            assert point.kept_bytes == plain.kept_bytes and point.extra_time < plain.extra_time
            assert point.offloaded_bytes == sum(graph.nodes[i].out_bytes for i in point.offloaded)
            # What comes back for the recomputation is held there.
            assert point.recompute_peak >= point.offloaded_bytes
            # The copies cost what the block's forward and its recomputation leave unhidden: at least what a
            # forward cannot hide at all.
            one_way = point.offloaded_bytes / link
            served = sorted((*point.kept, *point.offloaded))
            rerun = evaluate(graph, "selective", served).extra_time
            assert point.copy_time >= max(0, one_way - graph.forward_time) - 1e-12
            assert point.extra_time == pytest.approx(rerun + point.copy_time)
        most[link] = max(p.offloaded_bytes for p in twins)
    assert most[1e10] >= most[1e8]  # a faster link hides more


def test_a_copy_waits_for_its_op_in_forward_and_must_arrive_before_the_rerun_reaches_it():
    block, shape = _gpt_block()
    cpu = _graph(block, shape)
    nodes = cpu.nodes
    last = max(cpu.keepable)  # made late in forward, needed late in the rerun
    first = min(cpu.keepable)
    total = sum(n.kernel_time for n in nodes)
    made = sum(n.kernel_time for n in nodes[: last + 1]) * cpu.forward_time / total
    for link in (1e7, 1e9, 1e12):
        graph = _on_an_accelerator(cpu, link)
        one_way = nodes[last].out_bytes / link
        reached = sum(n.kernel_time for n in nodes[:last])  # nothing else served: the rerun runs every op before
        point = evaluate(graph, "selective", [], [last])
        expected = max(0.0, made + one_way - graph.forward_time) + max(0.0, one_way - reached)
        assert point.copy_time == pytest.approx(expected, rel=1e-9, abs=1e-15)
        # an output made first has the whole forward to leave in, and is needed first in the rerun
        early = evaluate(graph, "selective", [], [first])
        early_way = nodes[first].out_bytes / link
        reached_first = sum(n.kernel_time for n in nodes[:first])
        made_first = sum(n.kernel_time for n in nodes[: first + 1]) * cpu.forward_time / total
        assert early.copy_time == pytest.approx(max(0.0, made_first + early_way - graph.forward_time)
                                                + max(0.0, early_way - reached_first), rel=1e-9, abs=1e-15)
    assert evaluate(_on_an_accelerator(cpu, 1e7), "selective", [], [last]).copy_time > 0


def test_an_offloading_point_installs_and_gives_plain_gradients():
    from fake_device import FakeDevice

    from remat.policies.hostcopy import use_device_model

    block, shape = _gpt_block()
    graph = _on_an_accelerator(_graph(block, shape), 1e10)
    point = max(offload_twins(graph, block_front(graph)), key=lambda p: p.offloaded_bytes)
    policy = policy_for(graph, point)
    loaded = BlockPolicy.from_dict(json.loads(json.dumps(policy.to_dict())))
    assert loaded == policy and loaded.offloaded_bytes == point.offloaded_bytes
    assert {(d.op, d.call) for d in loaded.decisions if d.decision == "offload"} == {
        (graph.nodes[i].op, graph.nodes[i].call) for i in point.offloaded}
    reference = _grads(block, block, shape)
    fake = FakeDevice()
    with use_device_model("cpu", fake):
        got = _grads(loaded.wrap(block), block, shape)
    assert_bitwise(got, reference)
    # Each offloaded op's outputs (a layer norm's mean and rstd too) went out once, and came back once.
    out = sum(c.nbytes for c in fake.copies if c.to_host)
    assert out == sum(graph.nodes[i].out_bytes for i in point.offloaded)
    assert sum(c.nbytes for c in fake.copies if not c.to_host) == out


def test_the_cpu_has_no_host_link_to_offload_over():
    assert measure_overheads(rounds=1, ops=4, device="cpu").link_bytes_per_s == 0.0
