"""apply_activation_checkpointing(auto_wrap_policy=...): FSDP's wrap policies pick the same modules as in PyTorch."""

import functools

import pytest
import torch
from helpers import assert_bitwise, backward_grads
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_wrappers
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
)

import remat
from remat.models import GPT, MLP, Block, CausalSelfAttention, GPTConfig, synthetic_batch

CFG = GPTConfig(n_layers=3, d_model=32, n_heads=2, seq_len=16, vocab_size=64, dropout=0.1)


def _gpt():
    torch.manual_seed(0)
    return GPT(CFG)


def _blocks_or_recurse(module, recurse, nonwrapped_numel):
    return recurse or isinstance(module, Block)


POLICIES = {
    "ModuleWrapPolicy": ModuleWrapPolicy({Block}),
    "nested ModuleWrapPolicy": ModuleWrapPolicy({Block, MLP}),
    "lambda_auto_wrap_policy": functools.partial(
        lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, (MLP, CausalSelfAttention))
    ),
    "size_based_auto_wrap_policy": functools.partial(size_based_auto_wrap_policy, min_num_params=5000),
    "plain callable": _blocks_or_recurse,
    "CustomPolicy": CustomPolicy(lambda m: isinstance(m, Block)),
}


def _torch_wrapped_names(model):
    names = []
    for name, module in model.named_modules():
        if isinstance(module, torch_wrappers.CheckpointWrapper):
            names.append(name.replace(torch_wrappers._CHECKPOINT_PREFIX, ""))
    return sorted(names)


def _remat_wrapped_names(model):
    return sorted(name.replace("_checkpoint_wrapped_module.", "")
                  for name, module in model.named_modules() if isinstance(module, remat.CheckpointWrapper))


@pytest.mark.parametrize("kind", list(POLICIES))
def test_wrap_policies_pick_the_modules_pytorch_picks_and_gradients_stay_bitwise(kind):
    ours, theirs, plain = _gpt(), _gpt(), _gpt()
    returned = remat.apply_activation_checkpointing(ours, auto_wrap_policy=POLICIES[kind])
    torch_wrappers.apply_activation_checkpointing(theirs, auto_wrap_policy=POLICIES[kind])
    assert _remat_wrapped_names(ours) == _torch_wrapped_names(theirs) == sorted(returned)
    assert returned  # every policy here wraps something
    tokens, targets = synthetic_batch(CFG, 2, torch.Generator().manual_seed(1))
    expected = backward_grads(lambda: plain.loss(tokens, targets), list(plain.parameters()), seed=3)
    got = backward_grads(lambda: ours.loss(tokens, targets), list(ours.parameters()), seed=3)
    assert torch.equal(expected[0], got[0])
    assert_bitwise(expected[1], got[1])


def test_size_based_policy_asks_parents_about_what_children_left():
    # 5000 parameters: each MLP (8,352) is wrapped, and a Block (12,704) keeps only 4,352 unwrapped after its
    # MLP was: not wrapped again. PyTorch's recursion gives the same answer (checked above).
    returned = remat.apply_activation_checkpointing(_gpt(), auto_wrap_policy=POLICIES["size_based_auto_wrap_policy"])
    assert "blocks.0.mlp" in returned and "blocks.0" not in returned


def test_nested_policy_wraps_children_first_then_parents():
    model = _gpt()
    returned = remat.apply_activation_checkpointing(model, auto_wrap_policy=POLICIES["nested ModuleWrapPolicy"])
    assert returned[:2] == ["blocks.0.mlp", "blocks.0"]
    assert isinstance(model.blocks[0], remat.CheckpointWrapper)
    assert isinstance(model.blocks[0].mlp, remat.CheckpointWrapper)


def test_custom_policy_kwargs_reach_the_wrapper_and_policy_option_applies():
    model = _gpt()
    remat.apply_activation_checkpointing(
        model, auto_wrap_policy=CustomPolicy(lambda m: {"preserve_rng_state": False} if isinstance(m, Block) else False)
    )
    assert model.blocks[1].checkpoint_fn.keywords["preserve_rng_state"] is False
    selective = _gpt()
    remat.apply_activation_checkpointing(selective, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                         policy=remat.policies.save_matmuls, every_n=2)
    assert [type(b).__name__ for b in selective.blocks] == ["CheckpointWrapper", "Block", "CheckpointWrapper"]
    assert selective.blocks[0].checkpoint_fn.keywords["policy"] is remat.policies.save_matmuls


def test_auto_wrap_twice_wraps_nothing_twice():
    model = _gpt()
    first = remat.apply_activation_checkpointing(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    assert remat.apply_activation_checkpointing(model, auto_wrap_policy=ModuleWrapPolicy({Block})) == []
    assert remat.apply_activation_checkpointing(model, auto_wrap_policy=CustomPolicy(lambda m: isinstance(m, Block))) \
        == []
    assert len(first) == 3 and list(model.state_dict()) == list(_gpt().state_dict())


def test_a_policy_that_is_not_a_policy_is_refused():
    with pytest.raises(TypeError, match="auto_wrap_policy must be a callable"):
        remat.apply_activation_checkpointing(_gpt(), auto_wrap_policy={Block})
