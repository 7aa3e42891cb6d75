"""``python -m sketchlab``: the same as the ``sketchlab`` console script (and ``python -m sketchlab.cli``)."""

import sys

from .cli import main

sys.exit(main())
