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
        "output.export=false",  # saving the model costs half a second; a test of the export turns it on
        f"output.dir={out_dir}",
        *extra,
    ]


def tiny_config(out_dir, *extra: str):
    """The shipped ``tiny-cpu`` config with ``tiny_overrides(out_dir, *extra)``: what ``memfit train tiny-cpu`` runs."""
    from memfit.config.loader import load_config
    from memfit.config.shipped import shipped_configs

    return load_config(shipped_configs()["tiny-cpu"], tiny_overrides(out_dir, *extra))


def fitted(cfg):
    """A ``Trainer`` of ``cfg`` after its ``fit()``, and what ``fit()`` returned (the trainer closed)."""
    from memfit.train.loop import Trainer

    trainer = Trainer(cfg)
    try:
        return trainer, trainer.fit()
    finally:
        trainer.close()


def wide_tiny_config(layers: int = 6):
    """The tiny preset made wide (hidden 256, MLP 512) with a small vocabulary (2,048): its saved activations
    pass activation offloading's size floor at B=2, T=256, and its full fine-tune peaks in the optimizer
    step with every gradient alive, as real models' do, while a step still takes a fraction of a second."""
    import copy

    from memfit.models.presets import preset_config

    cfg = copy.deepcopy(preset_config("tiny"))
    cfg.num_hidden_layers, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = (
        layers,
        2048,
        256,
        512,
        64,
    )
    return cfg
