"""``python -m fivefold.train`` (e.g. under torchrun) is ``fivefold train``."""

import sys

from fivefold.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
