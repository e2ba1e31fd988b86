"""Training data: plain text cut into fixed-length blocks, or chat/instruction JSONL with prompt masking, several
records per row (``data.packing``, each attending only to itself) or one, padded.

Every example is a row of ``seq_len + 1`` token ids and a matching row of labels (``-100`` where no
loss is taken: prompt tokens and padding). The model reads ``tokens[:, :-1]`` and is scored on
``labels[:, 1:]``. Held-out rows are chosen by a fixed permutation, independent of the run's seed.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from jinja2 import TemplateError, TemplateSyntaxError

from memfit.config.loader import TOO_DEEP, read_utf8
from memfit.config.schema import RECORD_SUFFIXES, TEXT_SUFFIXES, DataConfig, data_files
from memfit.errors import UserError, first_line, hub_hint, not_a_file
from memfit.step.loss import IGNORE_INDEX
from memfit.train.plays import NAME as PLAYS_CHAT
from memfit.train.plays import plays_chat_file, shakespeare_files
from memfit.train.records import check_tool_calls_rendered, file_records, record_content
from memfit.train.token_cache import (
    Record,
    TokenRecords,
    data_key,
    load_records,
    load_stream,
    save_records,
    save_stream,
)

SPLIT_SEED = 0


@dataclass
class TokenDataset(torch.utils.data.Dataset):
    """Rows of token ids and labels, both ``(N, seq_len + 1)``, kept as int32 and given as int64; packed rows
    (``data.packing``) also carry their position ids, restarting at 0 with every record, so that each record attends
    only to itself."""

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None
    records: int = 0  # chat/instruction records in the rows (0 for text)
    truncated: int = 0  # records longer than a row, cut to it
    answerless: int = 0  # records whose answer is cut away entirely: they take no loss

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i) -> tuple[torch.Tensor, ...]:
        """The rows at ``i`` as the model takes them (int64); they are kept as int32, half the host memory."""
        if self.positions is None:
            return self.tokens[i].long(), self.labels[i].long()
        return self.tokens[i].long(), self.labels[i].long(), self.positions[i].long()

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
    raise UserError(
        f"data.source: '{source}' {_not_a_file(source)}; give 'shakespeare', a .txt file, a directory or a .jsonl "
        "(or .json) file"
    )


def _held(directory: Path, shown: int = 6) -> str:
    """`` (it holds: a, b/, ...)``: what a data directory holds instead, by name, a folder with a slash."""
    names = sorted(f.name + ("/" if f.is_dir() else "") for f in directory.iterdir())
    if not names:
        return " (it is empty)"
    return f" (it holds: {', '.join(names[:shown])}{', ...' if len(names) > shown else ''})"


_DATASETS_SAVE = "datasets.load_dataset('{0}', split='train').to_json('records.jsonl')"


def _not_a_file(source: str) -> str:
    """Why ``source`` is no data file: ``does not exist`` (with a Hub name's hint) or ``is not a regular file``."""
    return not_a_file(source) + ("" if Path(source).exists() else hub_hint(source, _DATASETS_SAVE))


TEXT_PIECE = 1 << 20
"""Characters of a text file tokenized per piece: one call on a whole file held its ids, attention mask and offsets
as Python objects (a 50 MB file peaked at 7.6 GiB of RSS)."""
_SEAM = 512  # characters each side of a cut that its check tokenizes


def _ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _cuts(tokenizer, text: str) -> list[int]:
    """Where ``text`` is cut into pieces of about ``TEXT_PIECE`` characters: after a newline, and only where the
    tokens of the text around the cut are those of its two sides tokenized apart (a tokenizer's pre-tokens never
    span such a cut, so the pieces' tokens are the whole text's; one that adds a prefix space to each call, or a
    run of whitespace across the cut, fails the check and the cut is not made)."""
    cuts, pos = [0], TEXT_PIECE
    while pos < len(text):
        nl = text.find("\n", pos)
        if nl < 0:
            break
        cuts.append(nl + 1)
        pos = nl + 1 + TEXT_PIECE
    kept = []
    for i in range(1, len(cuts), 64):
        batch = cuts[i : i + 64]
        seams = [(text[max(0, c - _SEAM) : c], text[c : c + _SEAM]) for c in batch]
        joined = _ids(tokenizer, [left + right for left, right in seams])
        apart = _ids(tokenizer, [side for seam in seams for side in seam])
        kept += [c for k, c in enumerate(batch) if joined[k] == apart[2 * k] + apart[2 * k + 1]]
    return [0, *kept, len(text)]


def text_ids(tokenizer, text: str) -> Iterator[np.ndarray]:
    """The token ids of ``text`` (int32), as ``tokenizer(text, add_special_tokens=False)`` gives them, in pieces
    tokenized a batch at a time (see ``_cuts``)."""
    cuts = _cuts(tokenizer, text)
    pieces = [text[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]
    for i in range(0, len(pieces), 8):
        for ids in _ids(tokenizer, pieces[i : i + 8]):
            yield np.array(ids, dtype=np.int32)


def pack_text(files: list[Path], tokenizer, seq_len: int) -> TokenDataset:
    """Tokenize each file, join them with EOS, and cut the stream into non-overlapping rows (the stream kept in the
    data cache)."""
    key = data_key("text", files, tokenizer)
    stream = load_stream(key)
    if stream is None:
        parts = []
        for f in files:
            fix = "give UTF-8 text (iconv -f latin1 -t utf-8 converts Latin-1)"
            parts += [*text_ids(tokenizer, read_utf8(f, "data.source", fix, compressed=True))]
            parts.append(np.array([tokenizer.eos_token_id], dtype=np.int32))
        stream = np.concatenate(parts)
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
    tokens = torch.from_numpy(stream[: n * row].copy()).view(n, row)  # (N, T+1)
    return TokenDataset(tokens, tokens.clone())


def _scored(messages: list[dict], loss_on: str) -> list[int]:
    """The indices of the assistant messages that take the loss: every one after the first message, or the last."""
    last = len(messages) - 1
    earlier = [k for k in range(1, last) if messages[k]["role"] == "assistant"] if loss_on == "assistant" else []
    return [*earlier, last]


def _renders(tokenizer, messages: list[dict] | str, where: str, loss_on: str) -> list[str]:
    """The texts a conversation is labelled from: the whole conversation, then for each scored answer the
    conversation before it with the generation prompt and (but for the last) the conversation up to its end. A
    document (a ``{"text"}`` record) is its text alone, no template.

    Raises:
        UserError: the chat template refuses the conversation (``raise_exception`` in it, e.g. roles that do not
            alternate), or is no template (not Jinja, or nested past the parser's recursion): the model's, said so.
    """

    def render(part: list[dict], prompt: bool = False) -> str:
        try:
            return tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=prompt)
        except (TemplateSyntaxError, RecursionError) as e:
            why = f"line {e.lineno}: {e.message}" if isinstance(e, TemplateSyntaxError) else TOO_DEEP
            raise UserError(
                f"model.source: the model's chat template is not a usable Jinja template ({why}); fix it "
                "(chat_template.jinja, or chat_template in tokenizer_config.json) or give a model with a working one"
            ) from None
        except TemplateError as e:
            raise UserError(f"{where}: the model's chat template refuses this conversation ({first_line(e)})") from None

    if isinstance(messages, str):
        return [messages]
    texts = [render(messages)]
    check_tool_calls_rendered(messages, texts[0], where, render)
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


def _labelled(
    ids: Iterator[list[int]], messages: list[dict] | str, where: str, loss_on: str, eos: int | None
) -> Record:
    """A conversation's token ids, and labels that score the assistant messages (``loss_on``: every one, or the
    last) and nothing else; ``ids`` yields the tokens of its ``_renders`` in order. A document is its tokens and
    ``eos`` (as text sources join files), every one scored.

    Each answer is found as the tokens between the conversation before it, rendered with the generation prompt, and
    the conversation up to its end; both must be the opening tokens of the whole conversation's rendering.

    Raises:
        UserError: the chat template renders a prefix of the conversation differently inside it.
    """
    full = next(ids)
    if isinstance(messages, str):
        full = full if eos is None else [*full, eos]
        return full, list(full)
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


def _labelled_chunk(tokenizer, conversations: list[tuple[str, list[dict] | str]], loss_on: str) -> TokenRecords:
    texts = [t for where, messages in conversations for t in _renders(tokenizer, messages, where, loss_on)]
    ids = iter(_tokenized(tokenizer, texts))
    eos = tokenizer.eos_token_id
    return TokenRecords.of([_labelled(ids, messages, where, loss_on, eos) for where, messages in conversations])


def chat_records(paths: list[Path], tokenizer, max_records: int | None, loss_on: str = "assistant") -> TokenRecords:
    """Every record of JSON lines files (or JSON arrays of records; gzip, bzip2 or xz compressed or not) or Parquet
    files, in order, rendered with the tokenizer's chat template; the loss on the assistant messages ``loss_on``
    names. Records are read, rendered and tokenized ``TOKENIZE_BATCH`` at a time, so that only the token ids of
    the ones before are held (5 bytes a token), not their text, messages and Python lists.

    Raises:
        UserError: ``file:line: reason`` for the first malformed record.
    """
    shown = f"'{paths[0]}'" if len(paths) == 1 else f"'{paths[0].parent}' ({len(paths)} files)"
    key = data_key("chat", paths, tokenizer, loss_on=loss_on, max_records=max_records)
    kept = load_records(key)
    if kept is not None:
        return kept
    parts, chunk, n = [], [], 0
    enough = (lambda: False) if max_records is None else (lambda: n >= max_records)
    for path in paths:
        if enough():
            break
        for where, record in file_records(path):
            if enough():
                break
            content = record_content(record, where)
            if not isinstance(content, str) and getattr(tokenizer, "chat_template", None) is None:
                raise UserError(
                    f"{where}: a chat record, but the model's tokenizer has no chat template to render it with; give "
                    'a model whose tokenizer has one (an instruct checkpoint) or documents ({"text": ...} records)'
                )
            chunk.append((where, content))
            n += 1
            if len(chunk) == TOKENIZE_BATCH:
                parts.append(_labelled_chunk(tokenizer, chunk, loss_on))
                chunk = []
    if n < 2:
        raise UserError(f"data.source: {shown} has {n} record(s); need at least 2 (train and eval)")
    parts.append(_labelled_chunk(tokenizer, chunk, loss_on))
    records = TokenRecords.joined(parts)
    save_records(key, records)
    return records


ROWS_CHUNK = 1 << 20
"""Tokens placed into rows per pass: bounds the index arrays a pass builds (about 40 bytes a token)."""


def _rows(records: TokenRecords, row: int, pad_id: int, row_of: np.ndarray, col_of: np.ndarray, packed: bool):
    """A TokenDataset of ``row_of.max() + 1`` rows: record ``i`` (cut to ``row``) at row ``row_of[i]`` from column
    ``col_of[i]``; padding (no loss) elsewhere. ``packed``: position ids restart at 0 with each record and with the
    padding after the last, and each record's first label is IGNORE_INDEX."""
    n_rows = int(row_of.max()) + 1
    kept = np.minimum(records.lengths, row)
    tokens = np.full((n_rows, row), pad_id, dtype=np.int32)
    labels = np.full((n_rows, row), IGNORE_INDEX, dtype=np.int32)
    positions = None
    if packed:
        used = np.bincount(row_of, weights=kept, minlength=n_rows).astype(np.int64)
        positions = np.empty((n_rows, row), dtype=np.int32)  # the padding's, counting from the last record's end
        np.subtract(np.arange(row)[None, :], used[:, None], out=positions, casting="unsafe")
    ends = np.cumsum(kept)
    a = 0
    while a < len(records):
        b = max(a + 1, int(np.searchsorted(ends, ends[a] - kept[a] + ROWS_CHUNK, side="right")))
        lengths = kept[a:b]
        first = np.repeat(np.cumsum(lengths) - lengths, lengths)
        within = np.arange(len(first)) - first
        src = np.repeat(records.starts[a:b], lengths) + within
        r, c = np.repeat(row_of[a:b], lengths), np.repeat(col_of[a:b], lengths) + within
        tokens[r, c] = records.ids[src]
        labels[r, c] = records.labels(src)
        if packed:
            positions[r, c] = within
            labels[r[within == 0], c[within == 0]] = IGNORE_INDEX
        a = b
    cut, answerless = _cut_counts(records, row)
    out = (torch.from_numpy(x) for x in (tokens, labels))
    return TokenDataset(*out, None if positions is None else torch.from_numpy(positions), len(records), cut, answerless)


def _cut_counts(records: TokenRecords, row: int) -> tuple[int, int]:
    """(records longer than a row, those of them left with no label to score once cut to it)."""
    cut = np.flatnonzero(records.lengths > row)
    return len(cut), sum(not records.scored[records.starts[i] + 1 : records.starts[i] + row].any() for i in cut)


def padded_rows(records: TokenRecords, row: int, pad_id: int) -> TokenDataset:
    """One record per row of ``row`` tokens, cut to it where longer, padded (no loss) where shorter."""
    return _rows(records, row, pad_id, np.arange(len(records)), np.zeros(len(records), np.int64), packed=False)


def packed_rows(records: TokenRecords, row: int, pad_id: int) -> TokenDataset:
    """Several records per row of ``row`` tokens, best fit decreasing: longest first, each into the row it leaves
    the least room in (a new row where none has room). A record is never split across rows; one longer than a
    row has a row of its own, cut to it. Position ids restart at 0 with each record (and with the padding after
    the last), and each record's first label is IGNORE_INDEX (it would be predicted from the record before), so
    each record is scored exactly as in a row of its own."""
    lengths = records.lengths.tolist()
    order = sorted(range(len(records)), key=lambda i: -lengths[i])  # stable: ties keep the file's order
    row_of, col_of = np.zeros(len(records), np.int64), np.zeros(len(records), np.int64)
    room: list[tuple[int, int]] = []  # (free tokens, row), sorted
    n_rows = 0
    for i in order:
        n = min(lengths[i], row)
        j = bisect.bisect_left(room, (n, -1))
        if j == len(room):
            free, r = row, n_rows
            n_rows += 1
        else:
            free, r = room.pop(j)
        row_of[i], col_of[i] = r, row - free
        free -= n
        if free > 0:
            bisect.insort(room, (free, r))
    if n_rows < 2:
        raise UserError(
            f"data.source: its {len(records)} records pack into {n_rows} row of {row} tokens; need at least 2 "
            "(train and eval): give more records, lower data.seq_len or set data.packing=false"
        )
    return _rows(records, row, pad_id, row_of, col_of, packed=True)


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
            raise UserError(
                f"data.source: '{cfg.source}' {_not_a_file(cfg.source)}; give a .jsonl, .json or .parquet file of "
                "records (or a directory)"
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
