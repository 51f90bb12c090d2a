"""The chunked output layer and loss as a plan option (remat.planning.solve.head), on tiny Hugging Face causal LMs.

Bytes only (MemTracker on the CPU): a budget that only the chunked head reaches is planned instead of refused,
the plan's predicted peak is within 3% of the measured one, and the plan saves, loads, applies and removes the
chunking with its blocks' wrappers.
"""

import copy
from dataclasses import replace

import pytest
import torch

import remat
from remat.planning.basics.memory import measure_step
from remat.planning.solve.head import head_chunk_count, plan_with_head

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 2000, 2, 128


def llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                   use_cache=False)
    return transformers.LlamaForCausalLM(cfg).train()


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, use_cache=False,
                                  bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg).train()


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def profiled(request):
    torch.manual_seed(0)
    model = {"llama": llama, "gpt2": gpt2}[request.param]()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return model, ids, remat.profile(model, input_ids=ids, labels=ids, repeats=1)


def measured_peak(model, ids):
    return measure_step(lambda: model(input_ids=ids, labels=ids).loss.backward(), model).peak_above_params


def test_a_budget_only_the_chunked_head_reaches_is_planned(profiled):
    model, ids, prof = profiled
    assert prof.head is not None and prof.head.chunks == head_chunk_count(BATCH * SEQ, 32)
    without = replace(prof, head=None)
    with pytest.raises(remat.InfeasibleBudget) as refused:
        without.plan(0.3)
    plan = prof.plan(0.3)
    assert plan.head_chunks == prof.head.chunks and plan.predicted_peak <= plan.budget < refused.value.smallest
    assert "output layer and loss in" in str(plan)
    planned = plan.apply(copy.deepcopy(model))
    measured = measured_peak(planned, ids)
    assert abs(measured - (plan.predicted_peak - plan.param_bytes)) <= 0.03 * measured
    # the lowest plan falls well below the lowest without the chunked head
    with pytest.raises(remat.InfeasibleBudget) as lowest:
        prof.plan(0.01)
    assert lowest.value.smallest * 2 < refused.value.smallest


def test_plans_that_fit_without_it_keep_the_head_as_is(profiled):
    model, ids, prof = profiled
    plan = prof.plan(1.0)
    assert plan.head_chunks == 0 and set(plan.decisions.values()) == {"keep"}
    assert remat.lm_head_chunks(plan.apply(copy.deepcopy(model))) is None


def test_plan_saves_loads_applies_and_removes_the_chunking(profiled, tmp_path):
    model, ids, prof = profiled
    plan = prof.plan(0.3)
    plan.save(tmp_path / "plan.json")
    loaded = remat.Plan.load(tmp_path / "plan.json")
    assert loaded.head_chunks == plan.head_chunks
    planned = loaded.apply(copy.deepcopy(model))
    assert remat.lm_head_chunks(planned) == plan.head_chunks
    loaded.remove(planned)
    assert remat.lm_head_chunks(planned) is None
    assert planned(input_ids=ids, labels=ids).logits is not None
    assert prof.to_dict()["head"]["chunks"] == plan.head_chunks


def test_planned_model_trains_within_the_chunked_tolerance(profiled):
    model, ids, prof = profiled
    plan = prof.plan(0.3)
    planned, plain = plan.apply(copy.deepcopy(model)), copy.deepcopy(model)
    for copy_ in (planned, plain):
        opt = torch.optim.AdamW(copy_.parameters(), lr=1e-2)
        copy_.grads = []
        for _ in range(2):
            loss = copy_(input_ids=ids, labels=ids).loss
            loss.backward()
            copy_.grads.append([loss.detach()] + [p.grad.clone() for p in copy_.parameters()])
            opt.step()
            opt.zero_grad(set_to_none=True)
    for step_planned, step_plain in zip(planned.grads, plain.grads):
        for a, b in zip(step_planned, step_plain):
            assert ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() <= 1e-5


def test_no_head_option_with_a_loss_fn_or_without_labels():
    torch.manual_seed(0)
    model = llama()
    ids = torch.randint(0, VOCAB, (1, 16))
    assert remat.profile(model, input_ids=ids, labels=ids, loss_fn=lambda out: out.loss, repeats=1).head is None
    chunked = remat.chunk_lm_head(llama(), 2)  # chunked by hand already: profiled as it is
    assert remat.profile(chunked, input_ids=ids, labels=ids, repeats=1).head is None


def test_refusal_states_the_lowest_peak_with_the_chunked_head(profiled):
    _, _, prof = profiled
    with pytest.raises(remat.InfeasibleBudget) as refused:
        plan_with_head(prof, prof.head, 0.01)
    assert refused.value.smallest < prof.head.profile.peak_bytes
    assert "the smallest peak any plan reaches" in str(refused.value)


def test_check_plan_holds_within_the_chunked_tolerance(profiled):
    model, ids, prof = profiled
    plan = prof.plan(0.3)
    assert plan.head_chunks > 1
    result = remat.check_plan(model, plan, input_ids=ids, labels=ids, steps=2)
    assert result.holds, result.verdict()
    assert "chunks add in another order" in result.verdict()


def test_alternatives_include_the_chunked_head(profiled):
    _, _, prof = profiled
    plans = prof.alternatives(0.3, count=3)
    first = prof.plan(0.3)
    assert plans[0].decisions == first.decisions and plans[0].head_chunks == first.head_chunks > 0
    assert [p.predicted_extra_time for p in plans] == sorted(p.predicted_extra_time for p in plans)
    assert all(p.predicted_peak <= p.budget for p in plans)
