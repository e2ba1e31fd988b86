"""Chat records as token ids and labels, kept between runs in ``$MEMFIT_CACHE/data`` (``MEMFIT_DATA_CACHE=DIR``,
``off`` or ``on``, read as the other caches' variables).

Rendering and tokenizing every record is most of a chat run's start (shakespeare-chat's 29,710 records: 9.5 s on
2 CPUs, a 1M-record set minutes), paid again by every start: a resume, each rung of the out-of-memory ladder, each
``memfit bench`` cell. An entry is named by the data file's bytes, the tokenizer (its vocabulary, merges, special
tokens and chat template), ``data.loss_on``, ``data.max_documents`` and memfit's code and libraries, so any change
to one of them tokenizes again. It holds the ids as int32 and a byte per token that says whether it is scored:
about 5 bytes a token before gzip.
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import numpy as np

from memfit.cache import cache_root, code_and_versions, digest, read_entry, write_entry
from memfit.step.loss import IGNORE_INDEX

Record = tuple[list[int], list[int]]
"""One chat/instruction record: its token ids and labels (IGNORE_INDEX where no loss is taken), of equal length."""

WHAT = "tokenized records"


def records_root() -> Path | None:
    return cache_root("MEMFIT_DATA_CACHE", "data")


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def records_key(path: Path, tokenizer, max_records: int | None, loss_on: str) -> str | None:
    """The entry name of ``path``'s records under ``tokenizer``, or None where the tokenizer cannot be described
    (a slow, Python-only tokenizer has no serialised form: its records are not kept)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    return digest(
        {
            "data": _file_sha256(path),
            "tokenizer": hashlib.sha256(backend.to_str().encode()).hexdigest(),
            "template": tokenizer.chat_template,
            "special": tokenizer.special_tokens_map,
            "loss_on": loss_on,
            "max_records": max_records,
            "code": code_and_versions(),
        }
    )


def _encoded(values: np.ndarray) -> str:
    return base64.b64encode(values.tobytes()).decode()


def _decoded(text: str, dtype) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text, validate=True), dtype=dtype)


def save_records(key: str | None, records: list[Record]) -> None:
    if key is None:
        return
    ids = np.fromiter((i for r, _ in records for i in r), dtype=np.int32)
    scored = np.fromiter((x != IGNORE_INDEX for _, lab in records for x in lab), dtype=np.uint8)
    lengths = np.fromiter((len(r) for r, _ in records), dtype=np.int64)
    write_entry(records_root(), key, {"lengths": _encoded(lengths), "ids": _encoded(ids), "scored": _encoded(scored)})


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
    """The records of entry ``key``, or None (not kept, the cache off, or damaged: said and removed)."""
    if key is None:
        return None
    return read_entry(records_root(), key, WHAT, _records)
