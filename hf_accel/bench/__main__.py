"""`python -m hf_accel.bench ...`: the stand-alone entry point (also what the startup child processes run)."""

import sys

from hf_accel.bench.cli import main

sys.exit(main())
