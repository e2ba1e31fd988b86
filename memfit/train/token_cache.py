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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from memfit.cache import cache_root, code_and_versions, digest, file_digest, read_entry, write_entry
from memfit.step.loss import IGNORE_INDEX

Record = tuple[list[int], list[int]]
"""One chat/instruction record: its token ids and labels (IGNORE_INDEX where no loss is taken), of equal length."""


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


def save_stream(key: str | None, stream: list[int]) -> None:
    if key is not None:
        write_entry(data_root(), key, {"stream": _encoded(np.asarray(stream, dtype=np.int32))})


def load_stream(key: str | None) -> list[int] | None:
    """The token stream of a text source's entry ``key``, or None."""
    return _load(key, lambda entry: _decoded(entry["stream"], np.int32).tolist())


def save_records(key: str | None, records: list[Record]) -> None:
    if key is None:
        return
    ids = np.fromiter((i for r, _ in records for i in r), dtype=np.int32)
    scored = np.fromiter((x != IGNORE_INDEX for _, lab in records for x in lab), dtype=np.uint8)
    lengths = np.fromiter((len(r) for r, _ in records), dtype=np.int64)
    write_entry(data_root(), key, {"lengths": _encoded(lengths), "ids": _encoded(ids), "scored": _encoded(scored)})


def _records(entry: dict) -> list[Record]:
    lengths = _decoded(entry["lengths"], np.int64)
    ids = _decoded(entry["ids"], np.int32)
    scored = _decoded(entry["scored"], np.uint8)
    if len(ids) != len(scored) or int(lengths.sum()) != len(ids) or (lengths < 0).any():
        raise ValueError("lengths, ids and scores disagree")
    labels = np.where(scored.astype(bool), ids, IGNORE_INDEX).tolist()
    flat, ends = ids.tolist(), np.cumsum(lengths).tolist()
    starts = [0, *ends[:-1]]
    return [(flat[a:b], labels[a:b]) for a, b in zip(starts, ends)]


def load_records(key: str | None) -> list[Record] | None:
    """The chat records of entry ``key``, or None."""
    return _load(key, _records)
