"""``python -m remat``: the ``remat`` command (:mod:`remat.tools.cli`)."""

import sys

from .tools.cli import main

sys.exit(main())
