"""What a checkpointed region keeps, offloads or recomputes, op by op.

The ready-made policies live here as ``remat.policies.save_matmuls`` and friends (:mod:`.rules`); the
selective engine that applies any policy in eager mode is :mod:`.selective`, with the tapes that let a region
run without it after its first call (:mod:`.tape`, switched by :func:`tapes`), the programs their reruns
run (:mod:`.program`, compiled into fused kernels by :func:`fused_reruns`), its lowering under
``torch.compile`` :mod:`.compiled`, and the saved-tensor hooks that move activations to host memory
:mod:`.offload`.
"""

from .fused import fused_reruns
from .rules import *  # noqa: F403 - the ready-made policies are this package's surface
from .rules import __all__ as _rules
from .tape import tapes

__all__ = [*_rules, "fused_reruns", "tapes"]
