"""``python -m memfit.train CONFIG [key=value ...]``: the entry point torchrun starts on every rank
(``torchrun --nproc-per-node 2 -m memfit.train CONFIG ...`` works as well as ``memfit train --nproc-per-node 2``)."""

import sys

from memfit.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
