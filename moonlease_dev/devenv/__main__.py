import sys

from moonlease_dev.devenv import main

sys.exit(main(sys.argv[1:]))
