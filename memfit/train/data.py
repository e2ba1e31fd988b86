"""Training data: plain text cut into fixed-length blocks, or chat/instruction JSONL with prompt masking, several
records per row (``data.packing``, each attending only to itself) or one, padded.

Every example is a row of ``seq_len + 1`` token ids and a matching row of labels (``-100`` where no
loss is taken: prompt tokens and padding). The model reads ``tokens[:, :-1]`` and is scored on
``labels[:, 1:]``. Held-out rows are chosen by a fixed permutation, independent of the run's seed.
"""

from __future__ import annotations

import array
import bisect
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from jinja2 import TemplateError

from memfit.config.loader import read_utf8
from memfit.config.schema import RECORD_SUFFIXES, TEXT_SUFFIXES, DataConfig, data_files
from memfit.errors import UserError, first_line, hub_hint
from memfit.step.loss import IGNORE_INDEX
from memfit.train.plays import NAME as PLAYS_CHAT
from memfit.train.plays import plays_chat_file, shakespeare_files
from memfit.train.records import file_records, record_messages
from memfit.train.token_cache import Record, data_key, load_records, load_stream, save_records, save_stream

SPLIT_SEED = 0


@dataclass
class TokenDataset(torch.utils.data.Dataset):
    """Rows of token ids and labels, both ``(N, seq_len + 1)`` int64; packed rows (``data.packing``) also carry
    their position ids, restarting at 0 with every record, so that each record attends only to itself."""

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None
    records: int = 0  # chat/instruction records in the rows (0 for text)
    truncated: int = 0  # records longer than a row, cut to it
    answerless: int = 0  # records whose answer is cut away entirely: they take no loss

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i) -> tuple[torch.Tensor, ...]:
        if self.positions is None:
            return self.tokens[i], self.labels[i]
        return self.tokens[i], self.labels[i], self.positions[i]

    @property
    def supervised_tokens(self) -> int:
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())

    def notes(self) -> list[str]:
        """What the run should say about these rows: how records were packed, and any cut to a row's length."""
        out, row = [], self.tokens.shape[1]
        if self.positions is not None:
            out.append(
                f"packed {self.records} records into {len(self)} rows of {row} tokens, "
                f"{self.supervised_tokens / self.tokens[:, 1:].numel():.0%} of the positions supervised "
                "(each record attends only to itself)"
            )
        if self.truncated:
            lost = f"; {self.answerless} of them keep none of their answer" if self.answerless else ""
            out.append(
                f"{self.truncated} of {self.records} records are longer than data.seq_len + 1 = {row} tokens: each is "
                f"cut to that length and what is cut takes no loss{lost} (raise data.seq_len to keep them whole)"
            )
        return out

    def check_supervised(self, train: TokenDataset) -> None:
        """Refuse chat rows on which no token takes a loss: a run on them would log a loss of 0 and learn nothing.
        ``train`` is the training split of these rows."""
        if not self.records or train.supervised_tokens:
            return
        row = self.tokens.shape[1]
        if self.answerless == self.records:
            why = f"every answer lies past data.seq_len + 1 = {row} tokens and is cut away; raise data.seq_len"
        elif self.supervised_tokens:
            why = "the held-out rows have them all; give more records"
        else:
            why = "their answers render to no token; give answers"
        raise UserError(
            f"data.source: the {len(train)} training rows of its {self.records} records hold no token that takes a "
            f"loss: {why}"
        )

    def rows(self, index) -> TokenDataset:
        """The rows at ``index`` (a slice or an index tensor), their positions with them."""
        positions = None if self.positions is None else self.positions[index]
        return TokenDataset(self.tokens[index], self.labels[index], positions)

    def folded(self, vocab_size: int) -> TokenDataset:
        """Token ids (and labels) folded into ``[0, vocab_size)`` by ``id mod vocab_size``.

        For random-weight presets only: their text means nothing to the model, while every tensor
        keeps its exact shape, so memory and speed are those of real training at that vocabulary.
        """
        labels = torch.where(self.labels == IGNORE_INDEX, self.labels, self.labels % vocab_size)
        return replace(self, tokens=self.tokens % vocab_size, labels=labels)


def text_files(source: str) -> list[Path]:
    if source == "shakespeare":
        return shakespeare_files()
    path = Path(source)
    if path.is_dir():
        files = data_files(path, TEXT_SUFFIXES)
        if not files:
            raise UserError(f"data.source: directory '{source}' holds no .txt files (compressed or not){_held(path)}")
        return files
    if path.is_file():
        return [path]
    what = "is not a regular file" if path.exists() else f"does not exist{hub_hint(source, _DATASETS_SAVE)}"
    raise UserError(
        f"data.source: '{source}' {what}; give 'shakespeare', a .txt file, a directory or a .jsonl (or .json) file"
    )


def _held(directory: Path, shown: int = 6) -> str:
    """`` (it holds: a, b/, ...)``: what a data directory holds instead, by name, a folder with a slash."""
    names = sorted(f.name + ("/" if f.is_dir() else "") for f in directory.iterdir())
    if not names:
        return " (it is empty)"
    return f" (it holds: {', '.join(names[:shown])}{', ...' if len(names) > shown else ''})"


_DATASETS_SAVE = "datasets.load_dataset('{0}', split='train').to_json('records.jsonl')"


def pack_text(files: list[Path], tokenizer, seq_len: int) -> TokenDataset:
    """Tokenize each file, join them with EOS, and cut the stream into non-overlapping rows (the stream kept in the
    data cache)."""
    key = data_key("text", files, tokenizer)
    stream = load_stream(key)
    if stream is None:
        stream = []
        for f in files:
            fix = "give UTF-8 text (iconv -f latin1 -t utf-8 converts Latin-1)"
            stream.extend(
                tokenizer(read_utf8(f, "data.source", fix, compressed=True), add_special_tokens=False)["input_ids"]
            )
            stream.append(tokenizer.eos_token_id)
        save_stream(key, stream)
    row = seq_len + 1
    n = len(stream) // row
    if len(stream) == len(files):  # an EOS after each file, and nothing else
        what = f"'{files[0]}' is" if len(files) == 1 else f"the {len(files)} .txt files in '{files[0].parent}' are"
        raise UserError(f"data.source: {what} empty (no text to tokenize); give a file with text in it")
    if n < 2:
        raise UserError(
            f"data.source: only {len(stream)} tokens, fewer than two rows of data.seq_len+1 = {row}; "
            "give more text or lower data.seq_len"
        )
    tokens = torch.tensor(stream[: n * row], dtype=torch.long).view(n, row)  # (N, T+1)
    return TokenDataset(tokens, tokens.clone())


def _scored(messages: list[dict], loss_on: str) -> list[int]:
    """The indices of the assistant messages that take the loss: every one after the first message, or the last."""
    last = len(messages) - 1
    earlier = [k for k in range(1, last) if messages[k]["role"] == "assistant"] if loss_on == "assistant" else []
    return [*earlier, last]


def _renders(tokenizer, messages: list[dict], where: str, loss_on: str) -> list[str]:
    """The texts a conversation is labelled from: the whole conversation, then for each scored answer the
    conversation before it with the generation prompt and (but for the last) the conversation up to its end.

    Raises:
        UserError: the chat template refuses the conversation (``raise_exception`` in it, e.g. roles that do not
            alternate).
    """

    def render(part: list[dict], prompt: bool = False) -> str:
        try:
            return tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=prompt)
        except TemplateError as e:
            raise UserError(f"{where}: the model's chat template refuses this conversation ({first_line(e)})") from None

    texts = [render(messages)]
    for k in _scored(messages, loss_on):
        texts.append(render(messages[:k], prompt=True))
        if k != len(messages) - 1:
            texts.append(render(messages[: k + 1]))
    return texts


TOKENIZE_BATCH = 1024
"""Texts per call of the tokenizer: a fast tokenizer encodes a batch on all CPUs (shakespeare-chat's records in 9.5 s,
against 18.3 s a record at a time, on 2 CPUs), and the batch bounds what one call holds."""


def _tokenized(tokenizer, texts: list[str]) -> list[list[int]]:
    """The ids of each rendered text, as ``apply_chat_template(..., tokenize=True)`` gives them."""
    out: list[list[int]] = []
    for i in range(0, len(texts), TOKENIZE_BATCH):
        out += tokenizer(texts[i : i + TOKENIZE_BATCH], add_special_tokens=False)["input_ids"]
    return out


def _labelled(ids: Iterator[list[int]], messages: list[dict], where: str, loss_on: str) -> Record:
    """A conversation's token ids, and labels that score the assistant messages (``loss_on``: every one, or the
    last) and nothing else; ``ids`` yields the tokens of its ``_renders`` in order.

    Each answer is found as the tokens between the conversation before it, rendered with the generation prompt, and
    the conversation up to its end; both must be the opening tokens of the whole conversation's rendering.

    Raises:
        UserError: the chat template renders a prefix of the conversation differently inside it.
    """
    full = next(ids)
    labels = [IGNORE_INDEX] * len(full)
    last = len(messages) - 1
    for k in _scored(messages, loss_on):
        prompt = next(ids)
        upto = full if k == last else next(ids)
        if full[: len(upto)] != upto or upto[: len(prompt)] != prompt:
            which = "the prompt" if k == last else f"the conversation up to message {k + 1}"
            fix = "" if k == last else "; data.loss_on=last scores the final answer only"
            raise UserError(f"{where}: the chat template renders {which} differently inside the conversation{fix}")
        labels[len(prompt) : len(upto)] = full[len(prompt) : len(upto)]
    return full, labels


def chat_records(paths: list[Path], tokenizer, max_records: int | None, loss_on: str = "assistant") -> list[Record]:
    """Every record of JSON lines files (or JSON arrays of records; gzip, bzip2 or xz compressed or not) or Parquet
    files, in order, rendered with the tokenizer's chat template; the loss on the assistant messages ``loss_on``
    names.

    Raises:
        UserError: ``file:line: reason`` for the first malformed record.
    """
    shown = f"'{paths[0]}'" if len(paths) == 1 else f"'{paths[0].parent}' ({len(paths)} files)"
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError(f"data.source: {shown} is chat data but the model's tokenizer has no chat template")
    key = data_key("chat", paths, tokenizer, loss_on=loss_on, max_records=max_records)
    kept = load_records(key)
    if kept is not None:
        return kept
    conversations = []
    for path in paths:
        if max_records is not None and len(conversations) >= max_records:
            break
        for where, record in file_records(path):
            if max_records is not None and len(conversations) >= max_records:
                break
            conversations.append((where, record_messages(record, where)))
    if len(conversations) < 2:
        raise UserError(f"data.source: {shown} has {len(conversations)} record(s); need at least 2 (train and eval)")
    texts = [t for where, messages in conversations for t in _renders(tokenizer, messages, where, loss_on)]
    ids = iter(_tokenized(tokenizer, texts))
    records = [_labelled(ids, messages, where, loss_on) for where, messages in conversations]
    save_records(key, records)
    return records


def _rows_tensor(values: array.array, row: int) -> torch.Tensor:
    """(N, row) int64 from N x row ids laid out flat (several times faster than ``torch.tensor`` of lists)."""
    return torch.frombuffer(values, dtype=torch.long).view(-1, row).clone()


def _cut_counts(records: list[Record], row: int) -> tuple[int, int]:
    """(records longer than a row, those of them left with no label to score once cut to it)."""
    cut = [lab for ids, lab in records if len(ids) > row]
    return len(cut), sum(all(x == IGNORE_INDEX for x in lab[1:row]) for lab in cut)


def padded_rows(records: list[Record], row: int, pad_id: int) -> TokenDataset:
    """One record per row of ``row`` tokens, cut to it where longer, padded (no loss) where shorter."""
    tokens, labels = array.array("q"), array.array("q")
    for ids, lab in records:
        pad = max(0, row - len(ids))
        tokens.extend(ids[:row])
        tokens.extend([pad_id] * pad)
        labels.extend(lab[:row])
        labels.extend([IGNORE_INDEX] * pad)
    tokens, labels = _rows_tensor(tokens, row), _rows_tensor(labels, row)
    return TokenDataset(tokens, labels, None, len(records), *_cut_counts(records, row))


def packed_rows(records: list[Record], row: int, pad_id: int) -> TokenDataset:
    """Several records per row of ``row`` tokens, best fit decreasing: longest first, each into the row it leaves
    the least room in (a new row where none has room). A record is never split across rows; one longer than a
    row has a row of its own, cut to it. Position ids restart at 0 with each record (and with the padding after
    the last), and each record's first label is IGNORE_INDEX (it would be predicted from the record before), so
    each record is scored exactly as in a row of its own."""
    order = sorted(range(len(records)), key=lambda i: -len(records[i][0]))  # stable: ties keep the file's order
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, row), sorted
    for i in order:
        n = min(len(records[i][0]), row)
        j = bisect.bisect_left(room, (n, -1))
        if j == len(room):
            rows.append([i])
            free, r = row - n, len(rows) - 1
        else:
            (free, r) = room.pop(j)
            rows[r].append(i)
            free -= n
        if free > 0:
            bisect.insort(room, (free, r))
    if len(rows) < 2:
        raise UserError(
            f"data.source: its {len(records)} records pack into {len(rows)} row of {row} tokens; need at least 2 "
            "(train and eval): give more records, lower data.seq_len or set data.packing=false"
        )
    tokens, labels, positions = array.array("q"), array.array("q"), array.array("q")
    for members in rows:
        used = 0
        for i in members:
            ids = records[i][0][:row]
            tokens.extend(ids)
            labels.append(IGNORE_INDEX)
            labels.extend(records[i][1][1 : len(ids)])
            positions.extend(range(len(ids)))
            used += len(ids)
        tokens.extend([pad_id] * (row - used))
        labels.extend([IGNORE_INDEX] * (row - used))
        positions.extend(range(row - used))
    tokens, labels, positions = (_rows_tensor(a, row) for a in (tokens, labels, positions))
    return TokenDataset(tokens, labels, positions, len(records), *_cut_counts(records, row))


def source_files(cfg: DataConfig) -> list[Path]:
    """The files ``data.source`` names (``data.max_documents`` of them for text), none read yet.

    Raises:
        UserError: where the source does not exist, holds nothing to read, or is a datasets Arrow dataset.
    """
    arrow = Path(cfg.source)
    splits = arrow.is_dir() and (arrow / "dataset_dict.json").is_file()  # a DatasetDict: a directory per split
    if arrow.suffix == ".arrow" or splits or (arrow.is_dir() and any(arrow.glob("*.arrow"))):
        load = "load_from_disk" if arrow.is_dir() else "Dataset.from_file"
        split = "['train']" if splits else ""
        raise UserError(
            f"data.source: '{cfg.source}' is an Arrow dataset (datasets' save_to_disk); memfit reads JSON lines: "
            f"datasets.{load}('{cfg.source}'){split}.to_json('records.jsonl') writes its records"
        )
    if cfg.is_chat():
        path = plays_chat_file() if cfg.source == PLAYS_CHAT else Path(cfg.source)
        if path.is_dir():
            files = data_files(path, RECORD_SUFFIXES)
            if not files:
                raise UserError(
                    f"data.source: directory '{cfg.source}' holds no .jsonl, .json or .parquet files of records"
                    f"{_held(path)}"
                )
            return files
        if not path.is_file():
            what = "is not a regular file" if path.exists() else f"does not exist{hub_hint(cfg.source, _DATASETS_SAVE)}"
            raise UserError(
                f"data.source: '{cfg.source}' {what}; give a .jsonl, .json or .parquet file of records (or a directory)"
            )
        return [path]
    return text_files(cfg.source)[: cfg.max_documents]


def load_dataset(cfg: DataConfig, tokenizer) -> TokenDataset:
    """All rows of ``data.source`` (before the train/eval split)."""
    files = source_files(cfg)
    if cfg.is_chat():
        records = chat_records(files, tokenizer, cfg.max_documents, cfg.loss_on)
        rows = packed_rows if cfg.packs() else padded_rows
        return rows(records, cfg.seq_len + 1, tokenizer.pad_token_id)
    return pack_text(files, tokenizer, cfg.seq_len)


def split(ds: TokenDataset, eval_fraction: float) -> tuple[TokenDataset, TokenDataset]:
    """Hold out ``eval_fraction`` of rows (at least one) by a fixed permutation."""
    n = len(ds)
    n_eval = max(1, round(n * eval_fraction))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED))
    ev, tr = perm[:n_eval].sort().values, perm[n_eval:].sort().values
    return ds.rows(tr), ds.rows(ev)


def check_enough_rows(n: int, batch_size: int, world_size: int, accum: int) -> None:
    """Refuse a global batch larger than the ``n`` training rows (the trainer asks before it writes anything)."""
    if n < batch_size * world_size * accum:
        raise UserError(
            f"a global batch of {batch_size * world_size * accum} sequences (train.micro_batch_size {batch_size} x "
            f"{world_size} rank(s) x {accum} accumulation steps) is larger than the {n} training rows; "
            "lower it or give more data"
        )


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
        check_enough_rows(n, batch_size, world_size, accum)
        per_pass = batch_size * world_size
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


def eval_batches(ds: TokenDataset, batch_size: int, max_batches: int) -> list[tuple[torch.Tensor, ...]]:
    """The fixed held-out batches, in order: (tokens, labels), with the positions of packed rows."""
    out = []
    for start in range(0, len(ds), batch_size):
        if len(out) >= max_batches:
            break
        out.append(ds[start : start + batch_size])  # every tensor of the rows, sliced
    return out
