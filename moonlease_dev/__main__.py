"""`python -m moonlease_dev ...`: the `moonlease` command line with the development commands,
whether or not this package's entry point is installed (a worktree on PYTHONPATH)."""

import sys

from moonlease.cli import main
from moonlease_dev.cli import register

sys.exit(main(sys.argv[1:], plugins=[register]))
