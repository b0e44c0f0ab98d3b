"""``python -m omlx_mtp``: the ``omlx-mtp`` command."""

import sys

from .tools.cli import main

sys.exit(main())
