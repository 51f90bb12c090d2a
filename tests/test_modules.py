"""Module wrappers: equal gradients, unchanged names, no double checkpoint."""

import copy

import pytest
import torch
from helpers import assert_bitwise, backward_grads
from torch import nn

import remat
from remat.api.modules import CheckpointImpl, checkpoint_wrapper
from remat.models import GPT, Block, GPTConfig, synthetic_batch
from remat.planning.basics.blockpolicy import BlockPolicy, OpDecision

CFG = GPTConfig(n_layers=3, d_model=32, n_heads=2, seq_len=16, vocab_size=64)


def _pair():
    torch.manual_seed(0)
    plain = GPT(CFG)
    wrapped = GPT(CFG)
    wrapped.load_state_dict(plain.state_dict())
    return plain, wrapped


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_apply_activation_checkpointing_gives_equal_gradients(use_reentrant):
    plain, wrapped = _pair()
    names = remat.apply_activation_checkpointing(
        wrapped, check_fn=lambda m: isinstance(m, Block), use_reentrant=use_reentrant
    )
    assert names == ["blocks.0", "blocks.1", "blocks.2"]
    tokens, targets = synthetic_batch(CFG, 2, torch.Generator().manual_seed(1))
    expected = backward_grads(lambda: plain.loss(tokens, targets), list(plain.parameters()), seed=3)
    got = backward_grads(lambda: wrapped.loss(tokens, targets), list(wrapped.parameters()), seed=3)
    assert torch.equal(expected[0], got[0])
    assert_bitwise(expected[1], got[1])


def test_what_wrapping_changes_in_names_is_what_the_readme_says():
    plain, wrapped = _pair()
    remat.apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, Block))
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    # As in PyTorch, only the wrapper's own names hide the extra level.
    block_names = [n for n, _ in wrapped.blocks[0].named_parameters()]
    assert block_names == [n for n, _ in plain.blocks[0].named_parameters()]
    # From the root, the wrapper level shows, and only that.
    root_names = [n for n, _ in wrapped.named_parameters()]
    assert "blocks.0._checkpoint_wrapped_module.attn.qkv.weight" in root_names
    assert [n.replace("_checkpoint_wrapped_module.", "") for n in root_names] == [
        n for n, _ in plain.named_parameters()]
    # round trip both ways
    fresh = GPT(CFG)
    fresh.load_state_dict(wrapped.state_dict())
    remat.apply_activation_checkpointing(fresh, check_fn=lambda m: isinstance(m, Block))
    fresh.load_state_dict(plain.state_dict())
    for a, b in zip(fresh.state_dict().values(), plain.state_dict().values()):
        assert torch.equal(a, b)


def test_wrapping_twice_never_checkpoints_twice():
    _, model = _pair()
    first = remat.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    second = remat.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    assert first and second == []
    with pytest.raises(ValueError, match="already wrapped"):
        remat.checkpoint_wrapper(model.blocks[0])


def test_every_n_and_attribute_passthrough():
    _, model = _pair()
    is_block = lambda m: isinstance(m, Block)  # noqa: E731
    assert remat.apply_activation_checkpointing(model, check_fn=is_block, every_n=2) == ["blocks.0", "blocks.2"]
    assert isinstance(model.blocks[0], remat.CheckpointWrapper)
    assert model.blocks[0].ln1 is model.blocks[0]._checkpoint_wrapped_module.ln1
    assert not isinstance(model.blocks[1], remat.CheckpointWrapper)


def test_reentrant_wrapper_folds_keyword_arguments():
    lin = torch.nn.Linear(4, 4)

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x, *, scale):
            return self.lin(x) * scale

    x = torch.randn(2, 4, requires_grad=True)
    wrapper = remat.checkpoint_wrapper(Scaled(), remat.CheckpointImpl.REENTRANT)
    wrapper(x, scale=3.0).sum().backward()
    expected = torch.autograd.grad((lin(x) * 3.0).sum(), x)[0]
    assert torch.equal(x.grad, expected)


def test_mismatch_in_a_wrapped_block_names_its_path():
    _, model = _pair()
    remat.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    block = model.blocks[1]._checkpoint_wrapped_module
    original = block.forward
    calls = []

    def drifting(x):
        calls.append(1)
        return original(x if len(calls) == 1 else x[:, :-1])

    block.forward = drifting
    tokens, targets = synthetic_batch(CFG, 2)
    loss = model.loss(tokens, targets)
    with pytest.raises(remat.CheckpointError, match="at 'blocks.1'"):
        loss.backward()


class _ConvBN(nn.Module):
    """Conv, BatchNorm (running statistics and a batch counter) and an in-place ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        return x + self.act(self.bn(self.conv(x)))


def _bn_step(model, backwards=1):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 5, requires_grad=True)
    loss = model(x).square().sum()
    for i in range(backwards):
        loss.backward(retain_graph=i + 1 < backwards)
    return [b.clone() for b in model.buffers()], [p.grad for p in model.parameters()]


@pytest.mark.parametrize("how", ["non-reentrant", "reentrant", "selective"])
@pytest.mark.parametrize("backwards", [1, 2])
def test_recomputation_updates_batchnorm_statistics_once(how, backwards):
    torch.manual_seed(0)
    plain = nn.Sequential(_ConvBN(), _ConvBN()).train()
    wrapped = copy.deepcopy(plain)
    for i in range(2):
        if how == "selective":
            # keep the convolution, recompute the normalization: its recomputation must not count twice
            policy = BlockPolicy(
                "selective", [OpDecision("aten.convolution.default", 0, 0, "keep")])
            wrapped[i] = policy.wrap(wrapped[i])
        else:
            impl = CheckpointImpl.REENTRANT if how == "reentrant" else CheckpointImpl.NO_REENTRANT
            wrapped[i] = checkpoint_wrapper(wrapped[i], checkpoint_impl=impl)
    if how == "reentrant" and backwards > 1:
        pytest.skip("the reentrant variant supports a single backward")
    want_buffers, want_grads = _bn_step(plain, backwards)
    got_buffers, got_grads = _bn_step(wrapped, backwards)
    assert_bitwise(got_buffers, want_buffers)
    assert_bitwise(got_grads, want_grads)
    assert int(plain[0].bn.num_batches_tracked) == 1
