"""The chunked output layer and loss as a plan option (remat.planning.solve.head), on tiny Hugging Face causal LMs.

Bytes only (MemTracker on the CPU): a budget that only the chunked head reaches is planned instead of refused,
the plan's predicted peak is within 3% of the measured one, and the plan saves, loads, applies and removes the
chunking with its blocks' wrappers.
"""

import copy
import warnings
from dataclasses import replace

import pytest
import torch

import remat
from remat.planning.basics.memory import measure_step
from remat.planning.solve.head import NOT_ON_META, head_chunk_count, plan_with_head

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


def test_the_head_is_priced_as_what_its_forward_and_backward_add_to_the_unchunked_heads(monkeypatch):
    """A scripted clock: the chunked head's forward and backward take 3.5 s, the unchunked head's 3 s (its
    forward alone 1.5 s): the option adds 0.5 s, not its whole forward; where it is the faster, nothing."""
    from remat.planning.solve import head as head_module

    ran = {"chunked": False, "backward": False}
    real_loss, real_backward = head_module.chunked_lm_loss, torch.Tensor.backward

    def chunked_loss(*args, **kwargs):
        ran["chunked"] = True
        return real_loss(*args, **kwargs)

    def backward(self, *args, **kwargs):
        ran["backward"] = True
        return real_backward(self, *args, **kwargs)

    seconds = {(False, False): 1.0, (True, False): 1.5, (False, True): 3.0, (True, True): 3.5}

    class ScriptedClock:
        def __init__(self, device):
            pass

        def time(self, fn):
            ran.update(chunked=False, backward=False)
            result = fn()
            return result, seconds[ran["chunked"], ran["backward"]], 0.0

    monkeypatch.setattr(head_module, "chunked_lm_loss", chunked_loss)
    monkeypatch.setattr(torch.Tensor, "backward", backward)
    monkeypatch.setattr(head_module, "Clock", ScriptedClock)
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, 16))
    assert remat.profile(llama(), input_ids=ids, labels=ids, repeats=2).head.extra_time == pytest.approx(0.5)
    seconds[True, True] = 2.5  # the chunked head the faster: priced as free, never as a saving
    assert remat.profile(llama(), input_ids=ids, labels=ids, repeats=2, fresh_timings=True).head.extra_time == 0.0


def test_the_front_has_the_chunked_heads_plans(profiled):
    _, _, prof = profiled
    plan = prof.plan(0.3)
    front = prof.front()  # at the rules' peaks, those with the chunked head among them
    assert plan.head_chunks and any(point.head_chunks == plan.head_chunks for point in front.plans)
    assert min(p.peak for p in front.plans) < min(p.peak for p in replace(prof, head=None).front().plans)
    assert f"plan, head in {plan.head_chunks}" in str(front)
    asked = prof.front(budgets=(0.3,)).plans  # the plan the planner picks is on the front (or beaten there)
    assert any(p.peak <= plan.predicted_peak and p.extra_time <= plan.predicted_extra_time for p in asked)


def test_price_includes_the_chunked_head_on_request(profiled):
    _, _, prof = profiled
    plan = prof.plan(0.3, allow=("checkpoint",))
    assert plan.head_chunks
    priced = prof.price({name: d for name, d in plan.decisions.items() if d != "keep"}, head=True)
    assert priced.head_chunks == plan.head_chunks and priced.predicted_peak == plan.predicted_peak
    assert priced.predicted_extra_time == pytest.approx(plan.predicted_extra_time)
    assert priced.baseline_peak == prof.peak_bytes
    plain = prof.price({name: d for name, d in plan.decisions.items() if d != "keep"})
    assert plain.head_chunks == 0 and plain.predicted_peak > priced.predicted_peak
    with pytest.raises(ValueError, match="this profile has no chunked head to price") as refused:
        replace(prof, head=None).price({}, head=True)
    assert "\n" not in str(refused.value)


def test_alternatives_are_distinct_plans(profiled):
    _, _, prof = profiled
    plans = prof.alternatives(0.3, count=8)
    choices = [(p.head_chunks, p.predicted_peak, round(p.predicted_extra_time, 12),
                sorted((d, str(p.policies.get(n))) for n, d in p.decisions.items())) for p in plans]
    assert all(a != b for i, a in enumerate(choices) for b in choices[i + 1:])


def test_a_meta_profile_says_the_chunked_head_was_not_considered_and_why():
    with torch.device("meta"):
        model = llama()
    ids = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the meta device's answered data checks, listed in the notes
        prof = remat.profile(model, input_ids=ids, labels=ids, device="meta", ops=False)
    assert prof.head is None and NOT_ON_META in prof.notes
    with pytest.raises(remat.InfeasibleBudget) as refused:
        prof.plan(0.3)  # on the CPU, only the chunked head reaches it
    message = str(refused.value)
    assert "\n" not in message and message.endswith(
        "On the meta device, the output layer and loss in chunks (remat.chunk_lm_head) were not considered: their "
        "time cannot be measured without data; profile on real tensors (a smaller batch will do) to plan with them.")
    ids = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with_loss_fn = remat.profile(model, input_ids=ids, labels=ids, device="meta", ops=False,
                                     loss_fn=lambda out: out.loss)
    assert NOT_ON_META not in with_loss_fn.notes  # no chunked head would apply: nothing to tell


def test_the_chunked_heads_price_is_kept_with_the_machines_timings(tmp_path, monkeypatch):
    """Profiled again, the chunked head is priced from the timings file (so the plan's choice of it does not follow
    the load from one process to the next); ``fresh_timings=True`` measures it again."""
    import json

    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model, ids = llama(), torch.randint(0, VOCAB, (BATCH, SEQ))
    remat.profile(model, input_ids=ids, labels=ids, repeats=1)
    timings = tmp_path / "timings.json"
    entries = json.loads(timings.read_text())
    heads = [key for key in entries if key.startswith("head|")]
    assert len(heads) == 1, list(entries)
    entries[heads[0]]["seconds"] = 0.125  # what a loaded machine might have measured
    timings.write_text(json.dumps(entries))
    assert remat.profile(model, input_ids=ids, labels=ids, repeats=1).head.extra_time == 0.125
    assert remat.profile(model, input_ids=ids, labels=ids, repeats=1, fresh_timings=True).head.extra_time != 0.125
