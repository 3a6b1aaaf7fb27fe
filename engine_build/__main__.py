"""``python -m engine_build`` for hosts where the console script is not on PATH."""

import sys

from engine_build.cli import main

sys.exit(main())
