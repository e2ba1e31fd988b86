"""What a rank reads before it builds its model: the tokenizer, the model's config and the rows to train and
evaluate on, checked. Every rank reads them from the same inputs (``runtime.on_every_rank``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memfit.config.schema import RunConfig
from memfit.errors import UserError
from memfit.models.load import ModelSource, load_tokenizer, model_config
from memfit.train.data import TokenDataset, check_enough_rows, eval_batches, load_dataset, split

if TYPE_CHECKING:
    from memfit.models.planning import PlanningConfig


@dataclass
class TrainingInputs:
    tokenizer: Any
    model_config: PlanningConfig
    train: TokenDataset
    eval: list  # eval_batches'
    notes: list[str]


def training_inputs(cfg: RunConfig, source: ModelSource, world_size: int, accum: int) -> TrainingInputs:
    """The tokenizer, model config and rows of a run on ``world_size`` ranks accumulating ``accum`` micro-batches.

    Raises:
        UserError: a sequence longer than the model takes, a tokenizer larger than a checkpoint's embeddings,
            data without a token to score, or too few rows for one step.
    """
    d, t = cfg.data, cfg.train
    mconf = model_config(source, cfg.model)
    if d.seq_len > mconf.max_position_embeddings:
        raise UserError(
            f"data.seq_len {d.seq_len} exceeds the model's max_position_embeddings "
            f"{mconf.max_position_embeddings}; lower data.seq_len"
        )
    tokenizer = load_tokenizer(source)
    dataset = load_dataset(d, tokenizer)
    notes = list(dataset.notes())
    if len(tokenizer) > mconf.vocab_size:
        if source.kind != "preset":
            raise UserError(
                f"model.source: the tokenizer has {len(tokenizer)} tokens but the model only "
                f"{mconf.vocab_size} embeddings; use a checkpoint directory with its own tokenizer"
            )
        dataset = dataset.folded(mconf.vocab_size)  # random weights: only shapes matter
        notes.append(
            f"random weights with {mconf.vocab_size} embeddings: the {len(tokenizer)}-token "
            f"tokenizer's ids are folded into them (id mod {mconf.vocab_size})"
        )
    train_ds, eval_ds = split(dataset, d.eval_fraction)
    dataset.check_supervised(train_ds)
    check_enough_rows(len(train_ds), t.micro_batch_size, world_size, accum)  # before a file is written
    return TrainingInputs(tokenizer, mconf, train_ds, eval_batches(eval_ds, t.micro_batch_size, t.eval_batches), notes)
