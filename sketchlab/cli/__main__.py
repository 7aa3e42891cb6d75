"""``python -m sketchlab.cli``: the same as the ``sketchlab`` console script."""

import sys

from . import main

sys.exit(main())
