"""``python -m host_tuning`` for hosts where the console script is not on PATH."""

import sys

from host_tuning.cli import main

sys.exit(main())
