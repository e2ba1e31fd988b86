"""The seconds-long run the trainer, CLI and distributed tests share; where the repository's files are."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"


def tiny_overrides(out_dir, *extra: str) -> list[str]:
    """Overrides for a seconds-long run of the tiny preset on two Shakespeare plays."""
    return [
        "model.source=random:tiny",
        "data.source=shakespeare",
        "data.seq_len=64",
        "data.max_documents=2",
        "strategy.precision=fp32",
        "optimizer.lr=1e-3",
        "optimizer.warmup_steps=2",
        "train.device=cpu",
        "train.max_steps=6",
        "train.micro_batch_size=4",
        "train.eval_every=3",
        "train.eval_batches=2",
        f"output.dir={out_dir}",
        *extra,
    ]
