import sys

from moonlease.devenv import main

sys.exit(main(sys.argv[1:]))
