"""Tokenized training data kept between runs in ``$MEMFIT_CACHE/data`` (``MEMFIT_DATA_CACHE=DIR``, ``off`` or
``on``, read as the other caches' variables): a text source's token stream, and chat records' ids and labels.

Tokenizing is most of a run's start (the default job's 42 plays: 5.3 s on 2 CPUs; shakespeare-chat's 29,710
records: 9.5 s; a 1M-record set minutes), paid again by every start: a resume, each rung of the out-of-memory ladder,
each ``memfit bench`` cell. An entry is named by the data files' bytes, the tokenizer (its vocabulary, merges,
special tokens and chat template), the settings that shape the records (``data.loss_on``, ``data.max_documents``)
and memfit's code and libraries, so any change to one of them tokenizes again. Ids are kept as int32, and a chat
record's labels as a byte per token that says whether it is scored: 4-5 bytes a token before gzip.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from memfit.cache import cache_root, code_and_versions, digest, file_digest, read_entry, write_entry
from memfit.step.loss import IGNORE_INDEX

Record = tuple[list[int], list[int]]
"""One chat/instruction record: its token ids and labels (IGNORE_INDEX where no loss is taken), of equal length."""


@dataclass(eq=False)
class TokenRecords:
    """Chat/instruction records, tokenized and laid out flat: record ``i`` is ``ids[starts[i]:starts[i + 1]]``, and
    its labels are those ids where ``scored`` (IGNORE_INDEX elsewhere). 5 bytes a token and 8 a record, as the data
    cache keeps them: lists of Python ints took over 70 (a 104 MB JSON lines file peaked at 4.4 GiB of RSS)."""

    ids: np.ndarray  # int32
    scored: np.ndarray  # bool, one per id
    starts: np.ndarray  # int64, len(self) + 1, from 0 to len(ids)

    @classmethod
    def of(cls, records: Iterable[Record]) -> TokenRecords:
        """From ``(ids, labels)`` pairs; a label is either IGNORE_INDEX or its id."""
        records = list(records)
        lengths = np.fromiter((len(ids) for ids, _ in records), np.int64, len(records))
        total = int(lengths.sum())
        ids = np.fromiter(chain.from_iterable(ids for ids, _ in records), np.int32, total)
        scored = np.fromiter((x != IGNORE_INDEX for _, lab in records for x in lab), bool, total)
        return cls(ids, scored, _starts(lengths))

    @classmethod
    def joined(cls, parts: list[TokenRecords]) -> TokenRecords:
        lengths = np.concatenate([np.zeros(0, np.int64), *(p.lengths for p in parts)])
        ids = np.concatenate([np.zeros(0, np.int32), *(p.ids for p in parts)])
        return cls(ids, np.concatenate([np.zeros(0, bool), *(p.scored for p in parts)]), _starts(lengths))

    def __len__(self) -> int:
        return len(self.starts) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)

    def labels(self, at: np.ndarray | slice = slice(None)) -> np.ndarray:
        """The labels of the flat positions ``at`` (int32)."""
        return np.where(self.scored[at], self.ids[at], np.int32(IGNORE_INDEX))

    def __getitem__(self, i: int) -> Record:
        span = slice(int(self.starts[i]), int(self.starts[i + 1]))
        return self.ids[span].tolist(), self.labels(span).tolist()

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenRecords) and all(
            np.array_equal(getattr(self, f), getattr(other, f)) for f in ("ids", "scored", "starts")
        )


def _starts(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths, dtype=np.int64)])


def data_root() -> Path | None:
    return cache_root("MEMFIT_DATA_CACHE", "data")


def data_key(kind: str, files: list[Path], tokenizer, **settings: Any) -> str | None:
    """The entry name of ``files`` tokenized by ``tokenizer`` as ``kind`` (``text`` or ``chat``) under ``settings``,
    or None where the tokenizer cannot be described (a slow, Python-only tokenizer has no serialised form: its data
    is not kept)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or data_root() is None:
        return None
    data = [file_digest(f) for f in files]
    if None in data:  # unreadable: reading it says so
        return None
    return digest(
        {
            "kind": kind,
            "data": data,
            "tokenizer": hashlib.sha256(backend.to_str().encode()).hexdigest(),
            "template": tokenizer.chat_template,
            "special": tokenizer.special_tokens_map,
            "settings": settings,
            "code": code_and_versions(),
        }
    )


def _encoded(values: np.ndarray) -> str:
    return base64.b64encode(values.tobytes()).decode()


def _decoded(text: str, dtype) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text, validate=True), dtype=dtype)


def _load(key: str | None, parse: Callable[[dict], Any]) -> Any | None:
    """Entry ``key`` as ``parse`` makes it, or None (not kept, the cache off, or damaged: said and removed)."""
    return None if key is None else read_entry(data_root(), key, "tokenized data", parse)


def save_stream(key: str | None, stream: np.ndarray) -> None:
    if key is not None:
        write_entry(data_root(), key, {"stream": _encoded(stream.astype(np.int32, copy=False))})


def load_stream(key: str | None) -> np.ndarray | None:
    """The token stream (int32) of a text source's entry ``key``, or None."""
    return _load(key, lambda entry: _decoded(entry["stream"], np.int32))


def save_records(key: str | None, records: TokenRecords) -> None:
    if key is not None:
        entry = {"lengths": records.lengths, "ids": records.ids, "scored": records.scored.astype(np.uint8)}
        write_entry(data_root(), key, {name: _encoded(values) for name, values in entry.items()})


def _records(entry: dict) -> TokenRecords:
    lengths = _decoded(entry["lengths"], np.int64)
    ids = _decoded(entry["ids"], np.int32)
    scored = _decoded(entry["scored"], np.uint8)
    if len(ids) != len(scored) or int(lengths.sum()) != len(ids) or (lengths < 0).any():
        raise ValueError("lengths, ids and scores disagree")
    return TokenRecords(ids, scored.astype(bool), _starts(lengths))


def load_records(key: str | None) -> TokenRecords | None:
    """The chat records of entry ``key``, or None."""
    return _load(key, _records)
