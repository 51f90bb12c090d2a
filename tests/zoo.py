"""Real model code for the tests: tiny configs, random weights, no downloads.

torchvision's PyPI wheel is built against the CUDA torch, so its compiled operators (nms, roi_align, ...)
cannot load beside the CPU build of torch 2.13 used here, and its import then fails while registering fake
kernels for them. The model definitions are pure Python and need none of those operators, so the tests skip
that one registration module (conftest.py does it before any test imports transformers, timm or torchvision,
all of which import torchvision when it is installed).

Each builder returns a :class:`ZooCase`: a model in training mode, its example inputs as a user would pass
them (keyword arguments for Hugging Face models, whose output carries ``.loss``), a loss function where the
output has no ``.loss``, and the class of the natural repeated block that discovery should find.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def skip_torchvision_fake_kernels() -> None:
    name = "torchvision._meta_registrations"
    sys.modules.setdefault(name, types.ModuleType(name))


def import_vision():
    """(torchvision, timm), importable beside a CPU-only torch build."""
    skip_torchvision_fake_kernels()
    import timm
    import torchvision

    return torchvision, timm


def import_transformers():
    """transformers, importable beside a CPU-only torch build (its image utilities import torchvision)."""
    skip_torchvision_fake_kernels()
    import transformers

    return transformers


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


def _tokens(batch: int, seq: int, vocab: int = 128, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _causal_lm(name: str, model: nn.Module, block: str, layers: int) -> ZooCase:
    ids = _tokens(8, 128)
    return ZooCase(name, model.train(), kwargs={"input_ids": ids, "labels": ids}, block=block, blocks=layers)


def llama() -> ZooCase:
    transformers = import_transformers()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   attn_implementation="eager", use_cache=False)
    return _causal_lm("llama", transformers.LlamaForCausalLM(cfg), "LlamaDecoderLayer", 4)


def qwen2() -> ZooCase:
    transformers = import_transformers()
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   attn_implementation="eager", use_cache=False)
    return _causal_lm("qwen2", transformers.Qwen2ForCausalLM(cfg), "Qwen2DecoderLayer", 4)


def gpt2() -> ZooCase:
    transformers = import_transformers()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=4, n_head=4, n_positions=128,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager", use_cache=False)
    return _causal_lm("gpt2", transformers.GPT2LMHeadModel(cfg), "GPT2Block", 4)


def bert() -> ZooCase:
    transformers = import_transformers()
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, max_position_embeddings=128, attn_implementation="eager")
    ids = _tokens(8, 128)
    mask = torch.ones_like(ids)
    mask[:, 100:] = 0
    return ZooCase("bert", transformers.BertForMaskedLM(cfg).train(),
                   kwargs={"input_ids": ids, "attention_mask": mask, "labels": ids}, block="BertLayer", blocks=4)


def t5() -> ZooCase:
    transformers = import_transformers()
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=3, num_decoder_layers=3,
                                num_heads=4, decoder_start_token_id=0, pad_token_id=0, use_cache=False)
    return ZooCase("t5", transformers.T5ForConditionalGeneration(cfg).train(),
                   kwargs={"input_ids": _tokens(8, 96), "labels": _tokens(8, 64, seed=2)}, block="T5Block", blocks=6)


def whisper() -> ZooCase:
    transformers = import_transformers()
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


def _classify(name: str, model: nn.Module, batch: int, size: int, block: str, blocks: int) -> ZooCase:
    images = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(4))
    labels = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(5))
    return ZooCase(name, model.train(), args=(images,), loss_fn=lambda logits: F.cross_entropy(logits, labels),
                   block=block, blocks=blocks)


def vit() -> ZooCase:
    _, timm = import_vision()
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, patch_size=8, num_classes=10,
                              depth=4)
    return _classify("vit", model, 8, 64, "Block", 4)


def convnext() -> ZooCase:
    _, timm = import_vision()
    torch.manual_seed(0)
    model = timm.create_model("convnext_atto", pretrained=False, num_classes=10)
    return _classify("convnext_atto", model, 8, 128, "ConvNeXtBlock", 12)


def swin() -> ZooCase:
    _, timm = import_vision()
    from timm.models.swin_transformer import SwinTransformer

    torch.manual_seed(0)
    model = SwinTransformer(img_size=64, patch_size=4, window_size=4, embed_dim=32, depths=(2, 2, 2),
                            num_heads=(2, 4, 8), num_classes=10)
    return _classify("swin", model, 8, 64, "SwinTransformerBlock", 6)


def efficientnet() -> ZooCase:
    _, timm = import_vision()
    torch.manual_seed(0)
    model = timm.create_model("efficientnet_b0", pretrained=False, num_classes=10)
    return _classify("efficientnet_b0", model, 8, 96, "*Residual|DepthwiseSeparableConv", 16)


def resnet18() -> ZooCase:
    torchvision, _ = import_vision()
    torch.manual_seed(0)
    return _classify("resnet18", torchvision.models.resnet18(num_classes=10), 8, 112, "BasicBlock", 8)


def mobilenet() -> ZooCase:
    torchvision, _ = import_vision()
    torch.manual_seed(0)
    return _classify("mobilenet_v3_small", torchvision.models.mobilenet_v3_small(num_classes=10), 8, 96,
                     "InvertedResidual", 11)


def peak_above_params(case: ZooCase) -> int:
    """MemTracker's whole-step peak above parameters and buffers for one forward and backward of ``case``."""
    import remat

    case.model.zero_grad(set_to_none=True)
    try:
        return remat.measure_step(lambda: case.loss().backward(), case.model).peak_above_params
    finally:
        case.model.zero_grad(set_to_none=True)


BUILDERS: dict[str, Callable[[], ZooCase]] = {
    "llama": llama, "qwen2": qwen2, "gpt2": gpt2, "bert": bert, "t5": t5, "whisper": whisper,
    "vit": vit, "convnext_atto": convnext, "swin": swin, "efficientnet_b0": efficientnet,
    "resnet18": resnet18, "mobilenet_v3_small": mobilenet,
}

FAST = ("llama", "t5", "mobilenet_v3_small")  # what CI runs; REMAT_ZOO=all runs every model


def model_params() -> list:
    """One pytest parameter per zoo model, the ones outside FAST skipped unless REMAT_ZOO=all."""
    import os

    import pytest

    every = os.environ.get("REMAT_ZOO") == "all"
    skip = pytest.mark.skip(reason="whole zoo: REMAT_ZOO=all")
    return [pytest.param(name, marks=() if every or name in FAST else skip) for name in BUILDERS]
