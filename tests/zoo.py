"""Real model code for the tests: tiny configs, random weights, no downloads.

Every model comes from transformers, imported as installed: its language models and its ports of the
vision models (ResNet, MobileNetV2, ViT, ConvNeXt, Swin, EfficientNet).  The test environment has no
torchvision (its PyPI wheel is built against the CUDA torch and cannot import beside the CPU build used
here) and so no timm, which cannot be imported without torchvision.

Each builder returns a :class:`ZooCase`: a model in training mode, its example inputs as a user would pass
them (keyword arguments for the language models, whose output carries ``.loss``; positional images for the
vision models), a loss function where the output has no ``.loss``, and the class of the natural repeated
block that discovery should find.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ZooCase:
    """One zoo model: call ``model(*args, **kwargs)``; ``loss_fn`` is None when the output has ``.loss``."""

    name: str
    model: nn.Module
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    block: str = ""  # class name of the natural repeated block
    blocks: int = 0  # how many of them

    def loss(self) -> torch.Tensor:
        out = self.model(*self.args, **self.kwargs)
        return self.loss_fn(out) if self.loss_fn is not None else out.loss

    def step(self) -> None:
        """One forward and backward, the output alive until backward ends (the loop a profile assumes)."""
        out = self.model(*self.args, **self.kwargs)
        (self.loss_fn(out) if self.loss_fn is not None else out.loss).backward()


def _tokens(batch: int, seq: int, vocab: int = 128, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _causal_lm(name: str, model: nn.Module, block: str, layers: int) -> ZooCase:
    ids = _tokens(8, 128)
    return ZooCase(name, model.train(), kwargs={"input_ids": ids, "labels": ids}, block=block, blocks=layers)


def llama() -> ZooCase:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   attn_implementation="eager", use_cache=False)
    return _causal_lm("llama", transformers.LlamaForCausalLM(cfg), "LlamaDecoderLayer", 4)


def qwen2() -> ZooCase:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   attn_implementation="eager", use_cache=False)
    return _causal_lm("qwen2", transformers.Qwen2ForCausalLM(cfg), "Qwen2DecoderLayer", 4)


def gpt2() -> ZooCase:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=4, n_head=4, n_positions=128,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager", use_cache=False)
    return _causal_lm("gpt2", transformers.GPT2LMHeadModel(cfg), "GPT2Block", 4)


def bert() -> ZooCase:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, max_position_embeddings=128, attn_implementation="eager")
    ids = _tokens(8, 128)
    mask = torch.ones_like(ids)
    mask[:, 100:] = 0
    return ZooCase("bert", transformers.BertForMaskedLM(cfg).train(),
                   kwargs={"input_ids": ids, "attention_mask": mask, "labels": ids}, block="BertLayer", blocks=4)


def t5() -> ZooCase:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=3, num_decoder_layers=3,
                                num_heads=4, decoder_start_token_id=0, pad_token_id=0, use_cache=False)
    return ZooCase("t5", transformers.T5ForConditionalGeneration(cfg).train(),
                   kwargs={"input_ids": _tokens(8, 96), "labels": _tokens(8, 64, seed=2)}, block="T5Block", blocks=6)


def whisper() -> ZooCase:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.WhisperConfig(vocab_size=128, d_model=64, encoder_layers=3, decoder_layers=3,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                     decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=128,
                                     max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                     decoder_start_token_id=1, attn_implementation="eager", use_cache=False)
    model = transformers.WhisperForConditionalGeneration(cfg).train()
    # MemTracker hooks every parameter's gradient and cannot measure a model with frozen ones: train them all
    model.requires_grad_(True)
    features = torch.randn(8, 16, 256, generator=torch.Generator().manual_seed(3))
    labels = _tokens(8, 64, seed=2)
    return ZooCase("whisper", model,
                   kwargs={"input_features": features, "decoder_input_ids": labels, "labels": labels},
                   block="Whisper*Layer", blocks=6)


def _classify(name: str, model: nn.Module, size: int, block: str, blocks: int) -> ZooCase:
    """An image classifier called as ``model(images)``, its loss computed from the output's logits."""
    images = torch.randn(8, 3, size, size, generator=torch.Generator().manual_seed(4))
    labels = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(5))
    return ZooCase(name, model.train(), args=(images,), loss_fn=lambda out: F.cross_entropy(out.logits, labels),
                   block=block, blocks=blocks)


def _activations_in_place(model: nn.Module) -> nn.Module:
    """Run the ReLU, ReLU6 and SiLU activations in place, as torchvision and timm do (transformers doesn't)."""
    for module in model.modules():
        if isinstance(module, (nn.ReLU, nn.ReLU6, nn.SiLU)):
            module.inplace = True
    return model


def vit() -> ZooCase:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=64, patch_size=8, hidden_size=192, num_hidden_layers=4,
                                 num_attention_heads=3, intermediate_size=768, num_labels=10)
    return _classify("vit", transformers.ViTForImageClassification(cfg), 64, "ViTLayer", 4)


def convnext() -> ZooCase:
    import transformers

    torch.manual_seed(0)
    # ConvNeXt-atto: 2, 2, 6, 2 blocks of 40, 80, 160, 320 channels
    cfg = transformers.ConvNextConfig(depths=[2, 2, 6, 2], hidden_sizes=[40, 80, 160, 320], num_labels=10)
    return _classify("convnext_atto", transformers.ConvNextForImageClassification(cfg), 128, "ConvNextLayer", 12)


def swin() -> ZooCase:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.SwinConfig(image_size=64, patch_size=4, window_size=4, embed_dim=32, depths=[2, 2, 2],
                                  num_heads=[2, 4, 8], num_labels=10)
    return _classify("swin", transformers.SwinForImageClassification(cfg), 64, "SwinLayer", 6)


def efficientnet() -> ZooCase:
    import transformers

    torch.manual_seed(0)
    # B0: EfficientNetConfig's defaults are B7's
    cfg = transformers.EfficientNetConfig(width_coefficient=1.0, depth_coefficient=1.0, hidden_dim=1280,
                                          dropout_rate=0.2, image_size=224, num_labels=10)
    model = _activations_in_place(transformers.EfficientNetForImageClassification(cfg))
    return _classify("efficientnet_b0", model, 96, "EfficientNetBlock", 16)


def resnet18() -> ZooCase:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(layer_type="basic", depths=[2, 2, 2, 2], hidden_sizes=[64, 128, 256, 512],
                                    embedding_size=64, num_labels=10)
    model = _activations_in_place(transformers.ResNetForImageClassification(cfg))
    return _classify("resnet18", model, 112, "ResNetBasicLayer", 8)


def mobilenet() -> ZooCase:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MobileNetV2Config(depth_multiplier=0.5, num_labels=10)
    model = _activations_in_place(transformers.MobileNetV2ForImageClassification(cfg))
    return _classify("mobilenet_v2", model, 96, "MobileNetV2InvertedResidual", 16)


def peak_above_params(case: ZooCase) -> int:
    """MemTracker's whole-step peak above parameters and buffers for one forward and backward of ``case``."""
    import remat

    case.model.zero_grad(set_to_none=True)
    try:
        return remat.measure_step(case.step, case.model).peak_above_params
    finally:
        case.model.zero_grad(set_to_none=True)


BUILDERS: dict[str, Callable[[], ZooCase]] = {
    "llama": llama, "qwen2": qwen2, "gpt2": gpt2, "bert": bert, "t5": t5, "whisper": whisper,
    "vit": vit, "convnext_atto": convnext, "swin": swin, "efficientnet_b0": efficientnet,
    "resnet18": resnet18, "mobilenet_v2": mobilenet,
}

FAST = ("llama", "t5", "mobilenet_v2")  # what CI runs; REMAT_ZOO=all runs every model

def model_params(fast: tuple[str, ...] = FAST) -> list:
    """One pytest parameter per zoo model, the ones outside ``fast`` skipped unless REMAT_ZOO=all."""
    import os

    import pytest

    every = os.environ.get("REMAT_ZOO") == "all"
    skip = pytest.mark.skip(reason="whole zoo: REMAT_ZOO=all")
    params = []
    for name in BUILDERS:
        params.append(pytest.param(name, marks=[] if every or name in fast else [skip]))
    return params
