"""Hugging Face models as users build them (stock configs: use_cache on, no labels, the meta device),
profiled, planned, applied and trained with remat's planner."""

import copy
import pickle
import warnings

import pytest
import torch
from helpers import assert_bitwise

import remat
from remat.planning.solve.plan import describe_model
from remat.planning.workflow import SummedLossWarning

transformers = pytest.importorskip("transformers")


def _llama(attn="eager"):
    """A Llama from a config left at its defaults where it matters: use_cache=True."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   attn_implementation=attn)
    return transformers.LlamaForCausalLM(cfg).train()


def _gpt2(attn="eager"):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                  bos_token_id=0, eos_token_id=0, attn_implementation=attn)
    return transformers.GPT2LMHeadModel(cfg).train()


def _tokens():
    return torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))


def _by_category(caught):
    return [w for w in caught if issubclass(w.category, SummedLossWarning)], \
        [w for w in caught if "use_cache" in str(w.message)]


def test_a_stock_config_is_profiled_with_the_cache_off_warned_once_and_left_as_it_was():
    model = _llama()
    assert model.config.use_cache is True
    ids = _tokens()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof = remat.profile(model, input_ids=ids, labels=ids, repeats=1)
    summed, cache = _by_category(caught)
    assert not summed and len(cache) == 1
    assert "use_cache=True is incompatible with checkpointing in training; profiling LlamaForCausalLM with " \
           "use_cache=False" in str(cache[0].message)
    assert model.config.use_cache is True
    assert [r.name for r in prof.rows] == ["model.layers.0", "model.layers.1"] and prof.ops is not None
    plan = prof.plan("100%")
    assert plan.meta["model"].endswith("LlamaForCausalLM")


def _checkpoint_every_layer(model):
    names = [f"model.layers.{i}" for i in range(len(model.model.layers))]
    return remat.Plan(decisions=dict.fromkeys(names, "checkpoint"), predicted_peak=0, predicted_extra_time=0.0,
                      budget=0, baseline_peak=0, param_bytes=0, meta=describe_model(model, names))


def _grads(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, **kwargs)
    out.loss.backward()
    return out, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("asked", [{}, {"use_cache": True}], ids=["config", "use_cache=True"])
def test_a_plan_on_a_caching_model_trains_with_gradients_equal_to_plain_training(asked):
    """A checkpointed layer rerun with a growing KV cache would see longer keys (remat raises on it): applied
    plans run training forwards with the cache off, as transformers does; evaluation keeps it."""
    model = _llama()
    plain = copy.deepcopy(model)
    plan = _checkpoint_every_layer(model)
    with pytest.warns(UserWarning, match="has use_cache=True, which is incompatible with checkpointing in training"):
        plan.apply(model)
    ids = _tokens()
    _, expected = _grads(plain, ids)
    out, got = _grads(model, ids, **asked)
    assert_bitwise(expected, got)
    assert out.past_key_values is None and model.config.use_cache is True
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):  # a copy switches its own config
        out, got = _grads(copied, ids, **asked)
        assert_bitwise(expected, got)
        assert out.past_key_values is None and copied.config.use_cache is True
    replaced = model.config = model.model.config = copy.deepcopy(model.config)  # a config replaced after apply
    out, got = _grads(model, ids, **asked)
    assert_bitwise(expected, got)
    assert out.past_key_values is None and replaced.use_cache is True
    model.eval()
    with torch.no_grad():
        assert model(input_ids=ids).past_key_values is not None  # evaluation keeps its cache
    plan.remove(model)
    model.train()
    assert model(input_ids=ids).past_key_values is not None  # undone with the plan


def test_a_model_without_labels_is_profiled_on_the_sum_of_its_logits_with_one_warning():
    model = _gpt2()
    model.config.use_cache = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remat.profile(model, input_ids=_tokens(), repeats=1, ops=False)
    summed, _ = _by_category(caught)
    assert len(summed) == 1 and summed[0].message.labels_missing
    assert str(summed[0].message).startswith("remat.profile: GPT2LMHeadModel returned no loss (no labels were given)")
    assert "pass labels= (e.g. labels=input_ids) or loss_fn=" in str(summed[0].message)


def _on_meta(build, attn):
    with torch.device("meta"):
        model = build(attn)
        ids = torch.randint(0, 128, (2, 32))
    return model, ids


@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_the_meta_device_profiles_hugging_face_models(build, attn):
    model, ids = _on_meta(build, attn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the stock config's use_cache, warned about above
        prof = remat.profile(model, input_ids=ids, labels=ids, device="meta")
    assert prof.estimated_time and len(prof.rows) == 2 and prof.ops is not None
    assert any("transformers/masking_utils.py:" in note and "taken as true" in note for note in prof.notes)
    assert prof.plan("100%").decisions


@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_data_checks_answered_on_meta_take_the_path_real_data_takes(build):
    """The bytes each block keeps on the meta device are those of a real step (eager attention: the same
    kernels on both devices)."""
    model, ids = _on_meta(build, "eager")
    real = build("eager")
    real_ids = _tokens()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        on_meta = remat.profile(model, input_ids=ids, labels=ids, device="meta", ops=False)
        measured = remat.profile(real, input_ids=real_ids, labels=real_ids, repeats=1, ops=False)
    assert [r.act_bytes for r in on_meta.rows] == [r.act_bytes for r in measured.rows]
