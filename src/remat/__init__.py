"""remat: activation checkpointing (rematerialization) for PyTorch.

A drop-in replacement for ``torch.utils.checkpoint``::

    import remat
    y = remat.checkpoint(block, x)          # non-reentrant, no warning
    y = remat.checkpoint_sequential(model, 4, x)
"""

from . import models, policies
from .api.checkpoint import checkpoint, noop_context_fn, set_checkpoint_debug_enabled, set_checkpoint_early_stop
from .api.modules import (
    ActivationWrapper,
    CheckpointImpl,
    CheckpointWrapper,
    OffloadWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)
from .api.sequential import checkpoint_sequential
from .engine.checks import CheckpointError
from .engine.nonreentrant import GraphExecGroup
from .engine.reentrant import CheckpointFunction, check_backward_validity, detach_variable
from .engine.replay import DefaultDeviceType, get_device_states, set_device_states
from .planning.blockpolicy import BlockPolicy
from .planning.broadcast import broadcast_plan
from .planning.fronts import block_front
from .planning.memory import StepMemory, measure_step
from .planning.opgraph import profile_ops
from .planning.plan import Plan
from .planning.solver import InfeasibleBudget
from .planning.workflow import Profile, plan, profile
from .policies.decisions import SAC_IGNORED_OPS, CheckpointPolicy, SelectiveCheckpointContext
from .policies.offload import OffloadStats, offload, save_on_cpu
from .policies.selective import create_selective_checkpoint_contexts
from .policies.tags import tag

__version__ = "0.1.0"

__all__ = [
    "SAC_IGNORED_OPS",
    "ActivationWrapper",
    "CheckpointPolicy",
    "OffloadStats",
    "SelectiveCheckpointContext",
    "create_selective_checkpoint_contexts",
    "offload",
    "offload_wrapper",
    "BlockPolicy",
    "block_front",
    "broadcast_plan",
    "profile_ops",
    "plan",
    "policies",
    "profile",
    "save_on_cpu",
    "tag",
    "CheckpointImpl",
    "CheckpointWrapper",
    "InfeasibleBudget",
    "OffloadWrapper",
    "Plan",
    "Profile",
    "StepMemory",
    "apply_activation_checkpointing",
    "checkpoint_wrapper",
    "measure_step",
    "models",
    "CheckpointError",
    "CheckpointFunction",
    "DefaultDeviceType",
    "GraphExecGroup",
    "check_backward_validity",
    "checkpoint",
    "checkpoint_sequential",
    "detach_variable",
    "get_device_states",
    "noop_context_fn",
    "set_checkpoint_debug_enabled",
    "set_checkpoint_early_stop",
    "set_device_states",
]
