"""Hugging Face models built from configs (no download) train with remat's checkpointing."""

import importlib

import pytest
import torch
from helpers import assert_bitwise

import remat

transformers = pytest.importorskip("transformers")

from remat.integrations.transformers import enable  # noqa: E402


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=64,
                                  resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
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


def test_every_n_layers_only_checkpoints_some_layers():
    model = enable(_llama().train(), every_n_layers=2)
    flags = [layer.gradient_checkpointing for layer in model.model.layers]
    assert flags == [True, False, True]


@pytest.mark.parametrize("switch", ["gradient_checkpointing_enable", "activation_checkpointing_enable"])
def test_transformers_own_switch_called_later_keeps_remat(switch, monkeypatch):
    """What users write after enable(): the model's own switch, with kwargs; it must not put torch's back."""
    engine = importlib.import_module("remat.api.checkpoint")
    regions = []
    run = engine.run_nonreentrant
    monkeypatch.setattr(engine, "run_nonreentrant", lambda *a, **k: regions.append(1) or run(*a, **k))
    torch.manual_seed(0)
    plain = _gpt2().train()
    model = _gpt2().train()
    model.load_state_dict(plain.state_dict())
    enable(model, policy=remat.policies.save_matmuls)
    if switch == "gradient_checkpointing_enable":
        with pytest.warns(FutureWarning):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                              every_n_layers=2, offload=True)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    expected_loss, expected = _step(plain, tokens, seed=5)
    got_loss, got = _step(model, tokens, seed=5)
    assert len(regions) == (3 if switch == "gradient_checkpointing_enable" else 2)  # every_n_layers=2: layers 0, 2
    assert torch.equal(expected_loss, got_loss)
    assert_bitwise(expected, got)
