"""A tiny Hugging Face Llama (random weights from a config, no download) trained under remat as users train it.

The loop steers the first layer's attention output with a forward hook on ``self_attn.o_proj`` (added at step
2, removed at step 4), puts attention dropout on a schedule, and evaluates under no_grad after every step; each
step's loss, gradients and evaluation logits must be bitwise those of the same model trained without
checkpointing.  remat runs the layers through transformers' own switch (:func:`remat.integrations.transformers.
enable`, and the model's ``gradient_checkpointing_enable`` called again as ``Trainer`` does), through module
wrappers, and through a plan.
"""

from __future__ import annotations

import importlib
import types

import pytest
import torch
from loops import MODES, Case, Mode, check, grid, keep_rules, offload_rules, policy_fn, unwrap

import remat

transformers = pytest.importorskip("transformers")

from remat.integrations.transformers import enable  # noqa: E402

# An evaluation under no_grad runs the reentrant variant with no input needing grad: it warns, as torch does.
pytestmark = pytest.mark.filterwarnings("ignore:remat. none of the inputs:UserWarning")

STEPS = 5
VOCAB = 64


class Llama(Case):
    def build(self):
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                       attn_implementation="eager", use_cache=False)
        model = transformers.LlamaForCausalLM(cfg).train()
        model.steering = []  # hook handles: each deep copy holds its own
        return model

    def regions(self, model) -> list[str]:
        return [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]

    @staticmethod
    def tokens(step: int, micro: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(100 * step + micro))

    def loss(self, model, step: int, micro: int) -> torch.Tensor:
        ids = self.tokens(step, micro)
        return model(input_ids=ids, labels=ids).loss

    def example(self):
        ids = self.tokens(0, 0)
        return (), {"input_ids": ids, "labels": ids}, None  # the output's .loss is the loss

    def before(self, model, step: int) -> None:
        layers = [unwrap(layer) for layer in model.model.layers]
        if step == 2:
            steer = torch.linspace(-0.5, 0.5, model.config.hidden_size)
            model.steering.append(layers[0].self_attn.o_proj.register_forward_hook(
                lambda module, args, out: out + steer))
        elif step == 4:
            for handle in model.steering:
                handle.remove()
            model.steering.clear()
        for layer in layers:
            layer.self_attn.attention_dropout = (0.0, 0.1, 0.1, 0.0, 0.2)[step]

    def after(self, model, step: int) -> list[torch.Tensor]:
        model.eval()
        try:
            with torch.no_grad():
                return [model(input_ids=self.tokens(step, 7)).logits]
        finally:
            model.train()


def _enable(policy=None, again=None, **kwargs):
    def install(model, case):
        enable(model, policy=policy, **kwargs)
        if again is not None:  # the model's own switch, called again as Trainer calls it: remat must stay
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=again)
    return install


HF_MODES = [
    Mode("enable", _enable()),
    Mode("enable_save_matmuls", _enable(remat.policies.save_matmuls)),
    Mode("enable_rules", _enable(keep_rules)),
    Mode("enable_policy_fn", _enable(policy_fn)),
    Mode("enable_offload", _enable(offload_rules)),
    Mode("enable_every_2nd", _enable(keep_rules, every_n_layers=2)),
    Mode("switch_again", _enable(keep_rules, again={"use_reentrant": False})),
    Mode("switch_again_reentrant", _enable(again={"use_reentrant": True}), reentrant=True),
    *[mode for mode in MODES if not mode.calls],  # wrappers around the layers, block policies, a plan
]


@pytest.fixture
def counted_regions(monkeypatch):
    """Counts the regions remat's engines run: proof that remat, not torch, checkpointed the layers."""
    front = importlib.import_module("remat.api.checkpoint")
    count = [0]

    def counting(original):
        def run(*args, **kwargs):
            count[0] += 1
            return original(*args, **kwargs)
        return run

    monkeypatch.setattr(front, "run_nonreentrant", counting(front.run_nonreentrant))
    reentrant = types.SimpleNamespace(apply=counting(front.CheckpointFunction.apply))
    monkeypatch.setattr(front, "CheckpointFunction", reentrant)
    return count


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize(("case", "mode", "optimizer"), grid(["llama"], HF_MODES))
def test_llama_trains_as_without_checkpointing(case, mode, optimizer, counted_regions):
    check(Llama(), mode, optimizer, steps=STEPS)
    assert counted_regions[0] > 0
