"""Hugging Face models built from configs (no download) train with remat's checkpointing."""

import importlib
import inspect
import warnings

import pytest
import torch
from helpers import assert_bitwise

import remat

transformers = pytest.importorskip("transformers")

from remat.integrations.transformers import enable  # noqa: E402


# use_cache=False in both configs: checkpointing runs without a KV cache (transformers and enable() switch it off),
# and the plain reference must too; in transformers 4.5x a training step with the cache takes another attention-mask
# path whose gradients differ in the last bits.
def _llama():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   use_cache=False)
    return transformers.LlamaForCausalLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=64,
                                  resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, use_cache=False)
    return transformers.GPT2LMHeadModel(cfg)


def _step(model, tokens, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("policy", [None, remat.policies.save_matmuls], ids=["full", "save_matmuls"])
def test_tiny_model_trains_with_equal_gradients_and_less_memory(build, policy):
    torch.manual_seed(0)
    plain = build().train()
    checkpointed = build().train()
    checkpointed.load_state_dict(plain.state_dict())
    enable(checkpointed, policy=policy)
    tokens = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(1))
    expected_loss, expected = _step(plain, tokens, seed=5)
    got_loss, got = _step(checkpointed, tokens, seed=5)
    assert torch.equal(expected_loss, got_loss)
    assert_bitwise(expected, got)
    peaks = [remat.measure_step(lambda m=m: _step(m, tokens, 5), m).peak_above_params for m in (plain, checkpointed)]
    assert peaks[1] < peaks[0], peaks


@pytest.fixture
def regions(monkeypatch):
    """Regions run by remat's eager engine (proof that remat, not torch, checkpointed)."""
    engine = importlib.import_module("remat.api.checkpoint")
    count = []
    run = engine.run_nonreentrant
    monkeypatch.setattr(engine, "run_nonreentrant", lambda *a, **k: count.append(1) or run(*a, **k))
    return count


def _trains_like(model, plain, tokens):
    expected_loss, expected = _step(plain, tokens, seed=5)
    got_loss, got = _step(model, tokens, seed=5)
    assert torch.equal(expected_loss, got_loss)
    assert_bitwise(expected, got)


def _twins(build):
    torch.manual_seed(0)
    plain = build().train()
    model = build().train()
    model.load_state_dict(plain.state_dict())
    return plain, model


def test_every_n_layers_only_checkpoints_some_layers(regions):
    plain, model = _twins(_llama)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    if not hasattr(model.model.layers[0], "gradient_checkpointing"):
        # transformers < 4.52: the model's stack checks one flag for all its layers, so there is no n-th to pick
        with pytest.raises(ValueError, match="every_n_layers=2 needs layers with their own checkpointing flag"):
            enable(model, every_n_layers=2)
        assert not getattr(model.model, "gradient_checkpointing", False)  # nothing was switched on
        return
    enable(model, every_n_layers=2)
    flags = [layer.gradient_checkpointing for layer in model.model.layers]
    assert flags == [True, False, True]
    _trains_like(model, plain, tokens)
    assert len(regions) == 2


def _takes(method, kwargs) -> bool:
    parameters = inspect.signature(method).parameters.values()
    names = {p.name for p in parameters}
    return any(p.kind is p.VAR_KEYWORD for p in parameters) or set(kwargs) <= names


SWITCH_CALLS = [
    # every transformers version: what Trainer and most users write
    ("gradient_checkpointing_enable", {"gradient_checkpointing_kwargs": {"use_reentrant": False}}, 3),
    # transformers >= 5.17 (5.16 has no offload): the 5.x arguments; every_n_layers=2 runs layers 0 and 2
    ("gradient_checkpointing_enable",
     {"gradient_checkpointing_kwargs": {"use_reentrant": False}, "every_n_layers": 2, "offload": True}, 2),
    # transformers >= 5.23
    ("activation_checkpointing_enable",
     {"activation_checkpointing_kwargs": {"use_reentrant": False}, "every_n_layers": 2, "offload": True}, 2),
]


@pytest.mark.parametrize(("switch", "kwargs", "expected_regions"), SWITCH_CALLS,
                         ids=["gradient", "gradient-every_n-offload", "activation-every_n-offload"])
def test_transformers_own_switch_called_later_keeps_remat(switch, kwargs, expected_regions, regions):
    """What users write after enable(): the model's own switch, with kwargs; it must not put torch's back."""
    own = getattr(transformers.PreTrainedModel, switch, None)
    if own is None or not _takes(own, kwargs):
        pytest.skip(f"transformers {transformers.__version__} has no {switch}({', '.join(kwargs)})")
    plain, model = _twins(_gpt2)
    enable(model, policy=remat.policies.save_matmuls)
    # 5.23 renamed the switch: from then on gradient_checkpointing_enable is a deprecated alias
    deprecated = switch == "gradient_checkpointing_enable" and \
        hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        getattr(model, switch)(**kwargs)
    assert any(issubclass(w.category, FutureWarning) for w in caught) == deprecated, [str(w.message) for w in caught]
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    _trains_like(model, plain, tokens)
    assert len(regions) == expected_regions


def test_offload_does_not_need_torch_accelerator(regions, monkeypatch):
    """torch.accelerator is torch >= 2.6 and remat supports 2.5: the offload path must do without it."""
    plain, model = _twins(_llama)
    enable(model)
    switch = "activation" if hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable") else "gradient"
    monkeypatch.delattr(torch, "accelerator", raising=False)
    getattr(model, f"{switch}_checkpointing_enable")(offload=True)  # remat's switch takes offload on every version
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    _trains_like(model, plain, tokens)
    assert len(regions) == 3
