"""Real model code for the tests: tiny configs, random weights, no downloads.

torchvision's PyPI wheel is built against the CUDA torch, so its compiled operators (nms, roi_align, ...)
cannot load beside the CPU build of torch 2.13 used here, and its import then fails while registering fake
kernels for them. The model definitions are pure Python and need none of those operators, so the tests skip
that one registration module (conftest.py does it before any test imports transformers, timm or torchvision,
all of which import torchvision when it is installed).
"""

import sys
import types


def skip_torchvision_fake_kernels() -> None:
    name = "torchvision._meta_registrations"
    sys.modules.setdefault(name, types.ModuleType(name))


def import_vision():
    """(torchvision, timm), importable beside a CPU-only torch build."""
    skip_torchvision_fake_kernels()
    import timm
    import torchvision

    return torchvision, timm
