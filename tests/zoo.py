"""Real model code for the tests: tiny configs, random weights, no downloads.

torchvision's PyPI wheel is built against the CUDA torch, so its compiled operators (nms, roi_align, ...)
cannot load beside the CPU build of torch 2.13 used here, and its import then fails while registering fake
kernels for them. The model definitions are pure Python and need none of those operators, so the tests skip
that one registration module. Import torchvision and timm (which imports torchvision) through this module.
"""

import sys
import types


def import_vision():
    """(torchvision, timm), importable beside a CPU-only torch build."""
    name = "torchvision._meta_registrations"
    sys.modules.setdefault(name, types.ModuleType(name))
    import timm
    import torchvision

    return torchvision, timm
