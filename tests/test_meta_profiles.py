"""A profile on the meta device keeps the bytes a profile of the same step on the CPU keeps, to the byte.

Every segment's peak and every block's bytes are compared: on models users write (an MLP mixing activations,
Dropout and LayerNorm; a CNN with batch norm and in-place activations; residual blocks) and on Hugging Face
language models with eager attention and with SDPA (whose math path the meta device would otherwise take,
keeping the attention weights the CPU's fused kernel never makes); on BERT, whose unpadded mask the meta device
assumes, and on Swin, whose attention mask requires grad and whose layer norms backward through transposed
gradients.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import remat

_ROW_BYTES = ("act_bytes", "own_bytes", "held_bytes", "recompute_bytes", "input_bytes", "output_bytes",
              "matmul_bytes", "forward_start", "forward_peak", "save_peak")


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Tanh(), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 256),
                         nn.SiLU(), nn.LayerNorm(256), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Hardswish(inplace=True),
                         nn.Flatten(), nn.Linear(8 * 16 * 16, 10))


class _Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.silu(self.up(self.norm(x)), inplace=True))


def _residual() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), *(_Residual(64) for _ in range(3)), nn.Linear(64, 4))


def _profiles(build, make_inputs, loss_fn=None):
    torch.manual_seed(0)
    on_cpu = remat.profile(build(), *make_inputs("cpu"), loss_fn=loss_fn, repeats=1, ops=False)
    with torch.device("meta"):
        model = build()
    on_meta = remat.profile(model, *make_inputs("meta"), loss_fn=loss_fn, device="meta", ops=False)
    return on_cpu, on_meta


def _assert_same_bytes(on_cpu, on_meta):
    assert [(s.label, s.peak, s.start) for s in on_meta.segments] == [(s.label, s.peak, s.start)
                                                                      for s in on_cpu.segments]
    for cpu_row, meta_row in zip(on_cpu.rows, on_meta.rows, strict=True):
        assert [getattr(meta_row, f) for f in _ROW_BYTES] == [getattr(cpu_row, f) for f in _ROW_BYTES], cpu_row.name
    assert on_meta.peak_bytes == on_cpu.peak_bytes and on_meta.grad_bytes == on_cpu.grad_bytes


@pytest.mark.parametrize("build, shape", [(_mlp, (512, 64)), (_cnn, (4, 3, 16, 16)), (_residual, (256, 32))],
                         ids=["mlp", "cnn", "residual"])
def test_meta_profiles_of_models_users_write_are_exact(build, shape):
    def inputs(device):
        return (torch.randn(shape, device=device),)

    _assert_same_bytes(*_profiles(build, inputs, loss_fn=lambda out: out.float().pow(2).mean()))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_meta_profiles_of_hugging_face_models_are_exact(family, attn):
    transformers = pytest.importorskip("transformers")
    if family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn,
                                       use_cache=False)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                      attn_implementation=attn, use_cache=False)
        cls = transformers.GPT2LMHeadModel

    def build():
        return cls(cfg).train()

    ids = {"cpu": torch.randint(0, 256, (2, 128)), "meta": torch.empty(2, 128, dtype=torch.long, device="meta")}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the meta device's answered data checks, listed in the notes
        on_cpu = remat.profile(build(), input_ids=ids["cpu"], labels=ids["cpu"], repeats=1, ops=False)
        with torch.device("meta"):
            model = build()
        on_meta = remat.profile(model, input_ids=ids["meta"], labels=ids["meta"], device="meta", ops=False)
    _assert_same_bytes(on_cpu, on_meta)


def _hf_profiles(build, make_inputs):
    """``build()``'s profiles on the CPU and on meta, each called with ``make_inputs(device)``'s keywords."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the meta device's answered data checks, listed in the notes
        on_cpu = remat.profile(build(), repeats=1, ops=False, **make_inputs("cpu"))
        with torch.device("meta"):
            model = build()
        on_meta = remat.profile(model, device="meta", ops=False, **make_inputs("meta"))
    return on_cpu, on_meta


def test_meta_profile_of_bert_with_its_unpadded_mask_is_exact():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=128, attn_implementation="eager")
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(1))

    def inputs(device):
        # the meta device takes masks as unpadded (listed in the notes): on padded data the CPU also builds
        # a 4-D float mask that meta does not, batch * seq * seq * 4 bytes
        return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids, device=device),
                "labels": ids.to(device)}

    on_cpu, on_meta = _hf_profiles(lambda: transformers.BertForMaskedLM(cfg).train(), inputs)
    _assert_same_bytes(on_cpu, on_meta)
    assert any("masking_utils.py" in note for note in on_meta.notes)


def test_meta_profile_of_swin_is_exact():
    transformers = pytest.importorskip("transformers")
    # the last stage is one window: no shift, and its layer norms backward through transposed gradients
    cfg = transformers.SwinConfig(image_size=64, patch_size=4, window_size=4, embed_dim=32, depths=[2, 2, 2],
                                  num_heads=[2, 4, 8], num_labels=10)
    images = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(4))
    labels = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(5))

    def inputs(device):
        return {"pixel_values": images.to(device), "labels": labels.to(device)}

    _assert_same_bytes(*_hf_profiles(lambda: transformers.SwinForImageClassification(cfg).train(), inputs))


def test_attention_on_meta_takes_the_kernel_the_cpu_takes():
    from remat.planning.basics.metadata import MetaKernels

    q = torch.empty(2, 4, 16, 8, device="meta", requires_grad=True)
    kv = torch.empty(2, 2, 16, 8, device="meta", requires_grad=True)
    with MetaKernels():
        fused = nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        # dropout in training: the CPU's flash kernel does not take it, and neither does the meta device
        math = nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
        # a mask that requires grad (Swin's position bias): the flash kernel gives it no gradient
        bias = torch.empty(1, 4, 16, 16, device="meta", requires_grad=True)
        biased = nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=bias)
    assert fused.grad_fn.name() == "ScaledDotProductFlashAttentionForCpuBackward0"
    assert math.grad_fn.name() != fused.grad_fn.name()
    assert biased.grad_fn.name() != fused.grad_fn.name()


def test_a_meta_profile_is_priced_from_flops_and_bytes_alone_whatever_this_machines_overheads(monkeypatch):
    """A meta profile plans for another machine: the checkpoint machinery's costs measured on this one (which
    would price a selective point, or save_matmuls, above checkpointing the whole block) do not enter it."""
    import remat.planning.measure.opgraph as opgraph
    from remat.models import GPT, GPTConfig
    from remat.planning.choices.chain import chain_options
    from remat.planning.measure.overheads import Overheads

    cfg = GPTConfig(n_layers=2, d_model=128, n_heads=4, seq_len=128, vocab_size=256)

    def prices():
        with torch.device("meta"):
            model, tokens = GPT(cfg), torch.randint(0, 256, (2, 128))
        prof = remat.profile(model, tokens, loss_fn=lambda logits: logits.float().sum(), device="meta")
        return [(o.name, o.kept, o.extra_time) for choices in chain_options(prof) for o in choices]

    first = prices()
    monkeypatch.setattr(opgraph, "cached_overheads", lambda *args: Overheads(1e-3, 1e-3, 1e-3, 1e-3, 1e-9))
    assert prices() == first
    first_block = {name: extra for name, _, extra in first[:3]}  # keep, checkpoint, save_matmuls of blocks.0
    assert 0 < first_block["save_matmuls"] < first_block["checkpoint"]
