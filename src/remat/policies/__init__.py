"""What a checkpointed region keeps, offloads or recomputes, op by op.

The ready-made policies live here as ``remat.policies.save_matmuls`` and friends (:mod:`.rules`); the
selective engine that applies any policy in eager mode is :mod:`.selective`, its lowering under
``torch.compile`` :mod:`.compiled`, and the saved-tensor hooks that move activations to host memory
:mod:`.offload`.
"""

from .rules import (
    MATMUL_OPS,
    Policy,
    combine,
    offload_names,
    save_all_but_names,
    save_matmuls,
    save_names,
    save_nothing,
)

__all__ = [
    "MATMUL_OPS",
    "Policy",
    "combine",
    "offload_names",
    "save_all_but_names",
    "save_matmuls",
    "save_names",
    "save_nothing",
]
