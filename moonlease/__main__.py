"""`python -m moonlease`: the `moonlease` command line (`python -m moonlease operator ...` runs
the operator exactly as the image and the chart do)."""

import sys

from moonlease.cli import main

sys.exit(main())
