"""``python -m service [options]``: the same as ``kjit serve [options]``."""

import sys

from .server import main

sys.exit(main(prog="python -m service"))
