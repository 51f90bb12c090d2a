"""remat: activation checkpointing (rematerialization) for PyTorch.

A drop-in replacement for ``torch.utils.checkpoint``::

    import remat
    y = remat.checkpoint(block, x)          # non-reentrant, no warning
    y = remat.checkpoint_sequential(model, 4, x)

Each public name is imported on first use, so that ``import remat`` itself, and the ``remat`` command's
start and ``--help``, do not wait for torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_SOURCES = {
    "SAC_IGNORED_OPS": "policies.decisions",
    "ActivationWrapper": "api.modules",
    "CheckpointPolicy": "policies.decisions",
    "OffloadStats": "policies.offload",
    "SelectiveCheckpointContext": "policies.decisions",
    "create_selective_checkpoint_contexts": "policies.selective",
    "offload": "policies.offload",
    "offload_wrapper": "api.modules",
    "BlockPolicy": "planning.basics.blockpolicy",
    "broadcast_plan": "planning.solve.broadcast",
    "block_front": "planning.choices.fronts",
    "thin_front": "planning.choices.fronts",
    "policy_for": "planning.choices.fronts",
    "profile_ops": "planning.measure.opgraph",
    "plan": "planning.workflow",
    "check_plan": "planning.check",
    "policies": "policies",
    "profile": "planning.workflow",
    "save_on_cpu": "policies.offload",
    "tag": "policies.tags",
    "CheckpointImpl": "api.modules",
    "CheckpointWrapper": "api.modules",
    "InfeasibleBudget": "planning.solve.refusal",
    "UnsteadyTimings": "planning.measure.opgraph",
    "StaleTimings": "planning.measure.timecache",
    "PlanCheck": "planning.check",
    "InputShapeWarning": "planning.basics.inputs",
    "OffloadWrapper": "api.modules",
    "Plan": "planning.solve.plan",
    "PlanFileError": "planning.solve.plan",
    "Profile": "planning.workflow",
    "StepMemory": "planning.basics.memory",
    "StepCheck": "planning.check",
    "apply_activation_checkpointing": "api.modules",
    "checkpoint_wrapper": "api.modules",
    "measure_step": "planning.basics.memory",
    "fake_world": "planning.basics.fakeworld",
    "models": "models",
    "CheckpointError": "engine.checks",
    "CheckpointFunction": "engine.reentrant",
    "DefaultDeviceType": "engine.replay",
    "GraphExecGroup": "engine.nonreentrant",
    "check_backward_validity": "engine.reentrant",
    "checkpoint": "api.checkpoint",
    "checkpoint_sequential": "api.sequential",
    "chunked_lm_loss": "api.chunkedloss",
    "chunked_tolerance": "api.chunkedloss",
    "chunk_lm_head": "api.chunkedhead",
    "unchunk_lm_head": "api.chunkedhead",
    "lm_head_chunks": "api.chunkedhead",
    "shift_labels": "api.chunkedloss",
    "detach_variable": "engine.reentrant",
    "get_device_states": "engine.replay",
    "noop_context_fn": "api.checkpoint",
    "set_checkpoint_debug_enabled": "api.checkpoint",
    "set_checkpoint_early_stop": "api.checkpoint",
    "set_device_states": "engine.replay",
}
"""Each public name and the module (under ``remat``) that defines it; a subpackage names itself."""

__all__ = list(_SOURCES)


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'remat' has no attribute {name!r}")
    module = import_module(f".{source}", __name__)
    value = module if source == name else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
