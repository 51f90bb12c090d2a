"""What a checkpointed region keeps, offloads or recomputes, op by op.

The ready-made policies live here as ``remat.policies.save_matmuls`` and friends (:mod:`.rules`); the
selective engine that applies any policy in eager mode is :mod:`.selective` (every call records and serves its
own kept outputs), its lowering under ``torch.compile`` :mod:`.compiled`, and the saved-tensor hooks that move
activations to host memory :mod:`.offload`.
"""

from .rules import *  # noqa: F403 - the ready-made policies are this package's surface
from .rules import __all__ as __all__
