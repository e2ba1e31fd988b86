"""One rank of a torchrun job: train, then leave with ``os._exit``.

A rank leaves with ``os._exit`` while its trainer is still referenced, after its work is written
(metrics closed, checkpoints and export renamed into place, process group destroyed). Letting the
interpreter free DDP's reducer instead can deadlock: the reducer's gloo process group joins its
worker thread, which waits for the GIL to release a tensor of the last all-gather (seen with torch
2.13, gloo, DDP/ZeRO-1: a rank hung at exit forever).
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import NoReturn

import torch.distributed as dist

from memfit.config.schema import RunConfig
from memfit.errors import RankFailedExit, UserError, print_user_error
from memfit.train.loop import Trainer

# what gloo and the c10d store say when the other end of a connection has gone away (gloo raises a
# plain RuntimeError; nccl raises DistBackendError)
PEER_LOST = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Socket Timeout",
    "Connection refused",
    "Failed to recv",
    "Timed out waiting",
)


def peer_lost(e: BaseException) -> bool:
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and any(p in str(e) for p in PEER_LOST))


def _leave(code: int) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _close_quietly(trainer) -> None:
    """Stop the metrics endpoint and leave the process group; an error doing so changes nothing now."""
    if trainer is not None:
        try:
            trainer.close()
        except BaseException:  # noqa: BLE001 — already on the way out with the first error
            pass


def run_rank(cfg: RunConfig) -> NoReturn:
    """Train as this rank and exit: 0, a user error's code (printed), 4 when peers were lost, 1 on a bug."""
    trainer = None
    try:
        trainer = Trainer(cfg)
        trainer.fit()
        trainer.close()
    except UserError as e:
        _close_quietly(trainer)
        print_user_error(e)
        _leave(e.exit_code)
    except BaseException as e:
        if not peer_lost(e):  # a bug: keep the traceback
            _close_quietly(trainer)
            traceback.print_exc()
            _leave(1)
        # no teardown: destroying a process group whose peer is gone can block, and os._exit follows
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        err = RankFailedExit(
            f"rank {os.environ.get('RANK', '?')} lost contact with its peers ({first[:200]}); "
            "another rank has died or stopped: see its node's output"
        )
        print_user_error(err)
        _leave(err.exit_code)
    _leave(0)
