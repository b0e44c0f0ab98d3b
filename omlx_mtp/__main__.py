"""``python -m omlx_mtp``: the ``omlx-mtp`` command."""

import sys

from omlx_mtp.tools.cli import main

sys.exit(main())
