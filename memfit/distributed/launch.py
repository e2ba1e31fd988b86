"""``memfit train CONFIG --nproc-per-node N [--nnodes M --node-rank R --rdzv-endpoint HOST:PORT --numa-binding node]``.

The launcher is PyTorch's own ``torch.distributed.run`` (torchrun), called in this process with the
worker ``python -m memfit.train CONFIG overrides``: one node uses ``--standalone``; several nodes
meet through a c10d rendezvous at ``--rdzv-endpoint`` (start the same command on every node with its
own ``--node-rank``). The config is loaded and checked here first, so a typo fails once, before any
rank starts. No restarts: when a rank dies torchrun stops the others on its node, ranks on other
nodes see their collectives fail (within ``distributed.timeout_s`` at the latest), and this
launcher prints one line naming the rank and how it ended. ``--numa-binding`` is torchrun's own (each rank
bound to the CPUs and memory of its GPU's NUMA node, ``torch.numa.binding``), passed on where the installed torch
has it and refused in one line where it does not or where the run has no GPU.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from memfit.cache import cache_dir
from memfit.config.schema import RunConfig, grad_accum_steps
from memfit.distributed.deepspeed_engine import require_deepspeed, resolve_ds_path
from memfit.errors import (
    EXIT_OUT_OF_MEMORY,
    EXIT_RANK_FAILED,
    EXIT_RESTART,
    EXIT_USER_ERROR,
    RankFailedExit,
    UserError,
)


@dataclass(frozen=True)
class LaunchSpec:
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    numa_binding: str | None = None  # torchrun --numa-binding: node | socket | exclusive | core-complex

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def check_counts(nproc_per_node: int | None, nnodes: int, node_rank: int) -> None:
    """Refuse process and node counts that cannot be (``nproc_per_node`` None: one process, no torchrun)."""
    if nproc_per_node is not None and nproc_per_node < 1:
        raise UserError(f"--nproc-per-node must be >= 1 (got {nproc_per_node})")
    if nnodes < 1:
        raise UserError(f"--nnodes must be >= 1 (got {nnodes})")
    if not 0 <= node_rank < nnodes:
        raise UserError(f"--node-rank must be in 0..{nnodes - 1} (got {node_rank})")


def check_launch(spec: LaunchSpec, cfg: RunConfig) -> None:
    """Everything that can be checked before starting ranks.

    Raises:
        UserError: bad counts, several nodes without an endpoint, a global batch that does not divide,
            or engine deepspeed without DeepSpeed installed.
    """
    check_counts(spec.nproc_per_node, spec.nnodes, spec.node_rank)
    if spec.nnodes > 1 and not spec.rdzv_endpoint:
        raise UserError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node, e.g. node 0's address)")
    if spec.rdzv_endpoint:
        host, _, port = spec.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise UserError(f"--rdzv-endpoint must be HOST:PORT with a port in 1..65535 (got '{spec.rdzv_endpoint}')")
    grad_accum_steps(cfg, spec.world_size)
    if spec.numa_binding is not None:
        check_numa_binding(spec.numa_binding, cfg.train.device)
    if cfg.distributed.engine == "deepspeed":
        require_deepspeed()
        resolve_ds_path(cfg.distributed.deepspeed_config)


def torchrun_numa_modes() -> tuple[str, ...] | None:
    """The modes this torch's torchrun takes for ``--numa-binding`` (``torch.numa.binding``), None where it has no
    such option."""
    from torch.distributed.run import get_args_parser

    for action in get_args_parser()._actions:
        if "--numa-binding" in action.option_strings:
            return tuple(action.choices or ())
    return None


def check_numa_binding(mode: str, device: str, modes: tuple[str, ...] | None = None) -> None:
    """Refuse a NUMA binding torchrun cannot apply here.

    Raises:
        UserError: a CPU run (torchrun binds each rank to the CPUs near its GPU), a torch whose torchrun lacks the
            option, or a mode it does not know.
    """
    import torch

    if device == "cpu" or (device == "auto" and not _cuda_available()):
        raise UserError(
            "--numa-binding binds each rank to the CPUs near its GPU; this run has no GPU (train.device "
            f"{device}): bind by hand with numactl, or drop it"
        )
    modes = torchrun_numa_modes() if modes is None else modes
    if not modes:
        raise UserError(
            f"--numa-binding: this torch's ({torch.__version__}) torchrun has no --numa-binding; bind by hand with "
            "`numactl --cpunodebind=N --membind=N`, or use a torch whose torchrun has it"
        )
    if mode not in modes:
        raise UserError(f"--numa-binding must be {' | '.join(modes)} (got '{mode}')")


def torchrun_args(spec: LaunchSpec, cfg: RunConfig, config_path: Path, overrides: list[str]) -> list[str]:
    """torchrun's command line for this run (without the program name)."""
    args = [
        "--nproc-per-node",
        str(spec.nproc_per_node),
        "--nnodes",
        str(spec.nnodes),
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.5",
    ]
    if spec.numa_binding is not None:
        args += ["--numa-binding", spec.numa_binding]
    if spec.nnodes == 1 and not spec.rdzv_endpoint:
        args.append("--standalone")
    else:
        run_id = "memfit-" + hashlib.sha1(str(Path(cfg.output.dir).resolve()).encode()).hexdigest()[:12]
        args += [
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            spec.rdzv_endpoint,
            "--rdzv-id",
            run_id,
            "--node-rank",
            str(spec.node_rank),
        ]
    return args + ["-m", "memfit.train", str(config_path), *overrides]


def worker_env(cfg: RunConfig) -> None:
    """Environment the ranks inherit: DeepSpeed's CPU accelerator and its extension build cache."""

    cpu = cfg.train.device == "cpu" or (cfg.train.device == "auto" and not _cuda_available())
    if cpu:  # DeepSpeed's accelerator (transformers imports DeepSpeed when it is installed, too)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if cfg.distributed.engine == "deepspeed":
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cache_dir() / "torch_extensions"))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def describe_failure(rank: int, exitcode: int, pid: int) -> str:
    how = f"exited with code {exitcode}"
    if exitcode < 0:
        try:
            how = f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-exitcode}"
    return f"rank {rank} (pid {pid}) {how}"


def launch(spec: LaunchSpec, cfg: RunConfig, config_path: Path, overrides: list[str]) -> int:
    """Run the ranks through torchrun; returns the exit code for ``memfit train``.

    Raises:
        RankFailedExit: a rank died (signal or crash); the message names it.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    worker_env(cfg)  # first: checking DeepSpeed imports it, which on a CPU warns unless told the accelerator
    check_launch(spec, cfg)
    if "LOGLEVEL" not in os.environ:  # memfit reports failures itself, in one line; LOGLEVEL=INFO shows torchrun's
        # torch's elastic loggers carry levels of their own (set when their modules are imported): each is quieted
        names = [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]
        for name in ("torch.distributed.run", "torch.distributed.elastic", *names):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    args = get_args_parser().parse_args(torchrun_args(spec, cfg, config_path, overrides))
    try:
        run(args)
    except SignalException as e:  # SIGTERM / SIGINT to the launcher: torchrun has passed it on to the ranks and
        # waited for them; each wrote its final checkpoint and rank 0 said so in one line, as one process does
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        failures = sorted(e.failures.items())
        codes = {f.exitcode for _, f in failures}
        if codes <= {EXIT_USER_ERROR, EXIT_OUT_OF_MEMORY, EXIT_RANK_FAILED, EXIT_RESTART}:
            return max(codes)  # the ranks printed their own one-line error (4: they lost a peer elsewhere; 5: restart)
        first_rank, first = min(failures, key=lambda kv: kv[1].timestamp)
        others = [describe_failure(r, f.exitcode, f.pid) for r, f in failures if r != first_rank]
        raise RankFailedExit(
            f"{describe_failure(first_rank, first.exitcode, first.pid)}; the other ranks were stopped"
            + (f" ({'; '.join(others)})" if others else "")
            + f"; {cfg.output.dir} keeps its last complete checkpoint: continue with train.resume=true"
        ) from None
    except RendezvousError as e:  # one line, not a torchrun traceback
        raise RankFailedExit(
            f"rendezvous at {spec.rdzv_endpoint} failed ({type(e).__name__}: {e}); check that every "
            "node runs the same command and can reach the endpoint"
        ) from None
    return 0
