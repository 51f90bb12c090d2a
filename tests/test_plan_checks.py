"""A plan knows its model: Plan.apply (and Plan.load(...).apply) checks the model before wrapping anything.

The plans here are plain data made with describe_model, as a profile makes them, so no step is measured.
"""

import warnings

import pytest
import torch

import remat
from remat.planning.solve.plan import describe_model

transformers = pytest.importorskip("transformers")


def _llama(layers=4, hidden=64):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=128,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, attn_implementation="eager", use_cache=False)
    return transformers.LlamaForCausalLM(cfg).train()


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=4, n_head=4, n_positions=128,
                                  bos_token_id=0, eos_token_id=0, use_cache=False)
    return transformers.GPT2LMHeadModel(cfg)


def _plan_for(model, decision="checkpoint"):
    names = [f"model.layers.{i}" for i in range(len(model.model.layers))]
    decisions = {name: decision if i % 2 == 0 else "keep" for i, name in enumerate(names)}
    return remat.Plan(decisions=decisions, predicted_peak=0, predicted_extra_time=0.0, budget=0, baseline_peak=0,
                      param_bytes=0, meta=describe_model(model, names))


def _wrapped(model):
    return [name for name, m in model.named_modules() if isinstance(m, remat.ActivationWrapper)]


@pytest.fixture(params=["made", "loaded"])
def llama_plan(request, tmp_path):
    """A plan for the 4-layer Llama, as made and as read back from JSON."""
    plan = _plan_for(_llama())
    if request.param == "loaded":
        plan.save(tmp_path / "plan.json")
        plan = remat.Plan.load(tmp_path / "plan.json")
    return plan


def test_a_plan_records_the_model_class_its_blocks_and_their_parameter_shapes():
    meta = _plan_for(_llama()).meta
    assert meta["model"] == "transformers.models.llama.modeling_llama.LlamaForCausalLM"
    assert meta["candidates"] == [f"model.layers.{i}" for i in range(4)]
    block = meta["blocks"]["model.layers.0"]
    assert block["class"].endswith(".LlamaDecoderLayer")
    assert block["params"]["self_attn.q_proj.weight"] == "64x64" and block["params"]["mlp.up_proj.weight"] == "128x64"


def test_another_model_class_is_refused_before_anything_is_wrapped(llama_plan):
    gpt2 = _gpt2()
    with pytest.raises(ValueError, match=r"^remat\.Plan\.apply: this plan was made for a LlamaForCausalLM and the "
                                         r"model is a GPT2LMHeadModel; plan this model"):
        llama_plan.apply(gpt2)
    assert not _wrapped(gpt2)


def test_a_model_with_fewer_blocks_is_refused_and_left_unwrapped(llama_plan):
    two = _llama(layers=2)
    with pytest.raises(ValueError, match=r"LlamaDecoderLayer block `model\.layers\.2` is not in this LlamaForCausalLM "
                                         r"\(it has 2 LlamaDecoderLayer blocks, the plan 4\)"):
        llama_plan.apply(two)
    assert not _wrapped(two)


def test_a_wider_model_is_refused_naming_the_first_parameter_that_differs(llama_plan):
    wide = _llama(hidden=128)
    with pytest.raises(ValueError, match=r"block `model\.layers\.0` has other parameters than in the plan "
                                         r"\(self_attn\.q_proj\.weight: 128x128 here, 64x64 in the plan\)"):
        llama_plan.apply(wide)
    assert not _wrapped(wide)


def test_a_block_of_another_class_is_refused(llama_plan):
    model = _llama()
    model.model.layers[1] = torch.nn.Linear(64, 64)
    with pytest.raises(ValueError, match=r"block `model\.layers\.1` is a Linear here and a LlamaDecoderLayer in the"):
        llama_plan.apply(model)
    assert not _wrapped(model)


def test_a_model_with_more_blocks_is_planned_as_far_as_the_plan_goes_with_a_warning(llama_plan):
    eight = _llama(layers=8)
    with pytest.warns(UserWarning, match=r"the plan covers 4 blocks and leaves out 4 like them \(model\.layers\.4, "
                                         r"model\.layers\.5, model\.layers\.6, model\.layers\.7\), which stay "
                                         r"unwrapped"):
        llama_plan.apply(eight)
    assert _wrapped(eight) == ["model.layers.0", "model.layers.2"]


def test_the_model_it_was_made_for_applies_silently_and_again_after_wrapping(llama_plan):
    model = _llama()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        llama_plan.apply(model)
        llama_plan.apply(model)  # the wrapped blocks are checked through their wrappers
    assert _wrapped(model) == ["model.layers.0", "model.layers.2"]
    llama_plan.remove(model)
    assert not _wrapped(model)


def test_blocks_left_out_on_purpose_when_profiling_are_not_warned_about():
    model = _llama()
    plan = _plan_for(model)
    plan.decisions = {"model.layers.0": "checkpoint"}  # as if profiled with modules=["model.layers.0"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan.apply(model)
    assert _wrapped(model) == ["model.layers.0"]


def test_a_plan_without_meta_still_checks_every_name_before_wrapping():
    plan = _plan_for(_llama())
    plan.meta = {}
    two = _llama(layers=2)
    with pytest.raises(ValueError, match=r"the plan's block `model\.layers\.2` is not in this LlamaForCausalLM"):
        plan.apply(two)
    assert not _wrapped(two)
