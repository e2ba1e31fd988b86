"""``memfit train [CONFIG] [key=value ...]``: one process, a torchrun launch (``--nproc-per-node``), or one
rank that torchrun started."""

from __future__ import annotations

from memfit.config.loader import config_help, dump_config, load_config
from memfit.config.shipped import resolve_config_path, split_train_args
from memfit.distributed.launch import LaunchSpec, launch
from memfit.distributed.runtime import launched_ranks
from memfit.train.loop import Trainer
from memfit.train.rank import run_rank


def run(ns) -> int:
    if ns.help_config:
        print(config_help())
        return 0
    config_arg, overrides = split_train_args(ns.args)
    config_path = resolve_config_path(config_arg)
    cfg = load_config(config_path, overrides)
    if ns.print_config:
        print(dump_config(cfg), end="")
        return 0
    if ns.nproc_per_node is not None or ns.nnodes > 1:
        spec = LaunchSpec(ns.nproc_per_node or 1, ns.nnodes, ns.node_rank, ns.rdzv_endpoint)
        return launch(spec, cfg, config_path, overrides)
    if launched_ranks() > 1:  # a rank started by torchrun
        run_rank(cfg)
    trainer = Trainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return 0
