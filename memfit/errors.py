"""User-facing errors: one line naming the culprit, the value and the fix, then a non-zero exit.

A ``UserError`` is something the person running memfit can fix (a typo'd key, a missing file, a
configuration the device cannot run). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

EXIT_USER_ERROR = 2


class UserError(Exception):
    """An error the user can fix; the CLI prints ``memfit: error: <message>`` and exits 2."""

    exit_code = EXIT_USER_ERROR


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or ``""`` when none is close."""
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


EXIT_OUT_OF_MEMORY = 3


class OutOfMemoryExit(UserError):
    """The run ran out of memory; the run directory is left as it was (exit code 3)."""

    exit_code = EXIT_OUT_OF_MEMORY


EXIT_RANK_FAILED = 4


class RankFailedExit(UserError):
    """A rank of a multi-process run died or lost its peers; the others were stopped (exit code 4)."""

    exit_code = EXIT_RANK_FAILED


EXIT_RESTART = 5


class RestartExit(UserError):
    """``train.restart_on`` held at a step's end: the checkpoint is written and the process ends (exit code 5) for
    the ``memfit train`` supervisor to resume the run in a fresh one. The trainer has said why."""

    exit_code = EXIT_RESTART
    echo = False


class Interrupted(UserError):
    """SIGTERM or SIGINT stopped a run at a step boundary; exit 128 + the signal's number, as a shell reports it."""

    def __init__(self, received, message: str, echo: bool = True):
        super().__init__(message)
        self.exit_code = 128 + int(received)
        self.echo = echo


class ReportedByRankZero(UserError):
    """An error rank 0 found and printed; the other ranks exit with it silently."""

    echo = False


_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_FILE_SUFFIXES = {".json", ".jsonl", ".txt", ".gz", ".bz2", ".xz", ".zst", ".parquet", ".csv", ".yaml", ".gguf"}


def hub_hint(source: str, fetch: str) -> str:
    """`` (a Hugging Face Hub name? ...)`` where ``source`` reads as ``owner/name`` and no ``owner`` is here: memfit
    reads local files only; ``fetch`` is the command that brings it here (``{0}`` stands for the name). Else ``''``."""
    path = Path(source)
    if not _HUB_NAME.fullmatch(source) or path.suffix in _FILE_SUFFIXES or path.parent.exists():  # a path here
        return ""
    return f" (a Hugging Face Hub name? memfit downloads nothing: {fetch.format(source)} saves it here)"


def not_a_file(path: str | Path) -> str:
    """Why ``path``, which is not a regular file, cannot be read as one: ``does not exist``, ``is a directory`` or
    ``is not a regular file`` (a device, a FIFO: /dev/null was said not to exist)."""
    p = Path(path)
    if p.is_dir():
        return "is a directory"
    return "is not a regular file" if p.exists() else "does not exist"


def print_user_error(e: UserError) -> None:
    """``memfit: error: <message>`` on stderr, with ``[rank R]`` for ranks other than 0; nothing for an
    error rank 0 already printed."""
    if getattr(e, "echo", True):
        rank = os.environ.get("RANK")
        where = f"[rank {rank}] " if rank not in (None, "0") else ""
        print(f"memfit: error: {where}{one_line(str(e))}", file=sys.stderr, flush=True)


MAX_MESSAGE_CHARS = 2000


def one_line(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``message`` on one line, cut to ``limit`` characters (a value echoed back can be huge: a YAML alias
    bomb expands to hundreds of MB)."""
    message = " ".join(message.split("\n"))
    if len(message) <= limit:
        return message
    return f"{message[:limit]}... ({len(message) - limit} more characters cut)"


def first_line(e: Exception, limit: int = 300) -> str:
    """The first line of an exception's message (its type's name when it has none), cut to ``limit``: what a
    one-line error quotes of a library's multi-line complaint."""
    text = str(e).strip()
    return text.splitlines()[0][:limit] if text else type(e).__name__


def check_output(path: Path, fix: str = "choose another path") -> None:
    """Refuse a file the user asked for that could not be written, before any work is spent on it.

    Raises:
        UserError: ``path`` is a directory, or its directory does not exist or cannot be written in.
    """
    if not path.name or path.is_dir():
        raise UserError(f"cannot write '{path}': it is a directory; {fix}")
    if not path.parent.is_dir():
        raise UserError(f"cannot write '{path}': its directory '{path.parent}' does not exist; {fix}")
    try:  # a nameless file made and closed at once: what root may write is not what os.access says
        tempfile.TemporaryFile(dir=path.parent).close()
    except OSError as e:
        raise UserError(f"cannot write '{path}': its directory refuses files ({e.strerror}); {fix}") from None


def write_output(path: Path, text: str, fix: str = "choose another path") -> None:
    """Write a file the user asked for (a page, a config) whole or not at all: through a hidden temporary file
    beside it, renamed into place.

    Raises:
        UserError: it is a directory, or its directory does not exist or cannot be written (nothing is left behind).
    """
    check_output(path, fix)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write '{path}' ({e.strerror}); {fix}") from None
