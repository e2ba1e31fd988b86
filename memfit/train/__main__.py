"""``python -m memfit.train CONFIG [key=value ...]``: the entry point torchrun starts on every rank
(``torchrun --nproc-per-node 2 -m memfit.train CONFIG ...`` works as well as ``memfit train --nproc-per-node 2``).

A rank ends with ``os._exit`` once its work is written (metrics closed, checkpoints and export
renamed into place, the process group destroyed): tearing down DDP's reducer and gloo's worker
threads in the interpreter's own shutdown can deadlock on the GIL (seen with torch 2.13, gloo, DDP).
"""

import os
import sys

from memfit.cli import main

if __name__ == "__main__":
    code = main(["train", *sys.argv[1:]])
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
