"""The user's line: where a warning from remat points, past remat's own frames.

A warning raised deep in a profile or a planned model's forward names, by default, the line that called
``warnings.warn``: a line of remat's source, or of torch.nn's module machinery, which tells a user nothing.
:func:`user_stacklevel` finds the first frame outside remat, torch.nn and contextlib (a ``with`` block's
entry) and gives the ``stacklevel`` that names it.

Example:
    >>> warnings.warn(UnsteadyTimings("..."), stacklevel=user_stacklevel())
"""

from __future__ import annotations

import contextlib
import os
import sys

from torch import nn

__all__ = ["user_stacklevel"]

_INSIDE = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
           os.path.dirname(nn.Module.__call__.__code__.co_filename),
           os.path.abspath(contextlib.__file__))
"""remat's folder, torch.nn's modules' and contextlib: frames a warning about the user's call skips."""


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the calling function that names the user's line.

    Example:
        >>> def profile_step():
        ...     warnings.warn("the loss is summed", stacklevel=user_stacklevel())
    """
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(_INSIDE):
        frame, level = frame.f_back, level + 1
    return level
