"""``python -m torch_sac``: see :mod:`torch_sac.cli`."""

import sys

from .cli import main

sys.exit(main())
