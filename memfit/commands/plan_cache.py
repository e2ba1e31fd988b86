"""Answers of ``memfit plan`` kept on disk, so that the same question asked again is answered at once, without
importing torch, transformers or the planner.

A question is the command line (every flag, parsed), the working directory, this machine's memory where
``--host-mem`` is not given, how the output is shown (a terminal's width, the colour variables) and
``memfit.cache.code_and_versions`` (memfit's source bytes, the torch / transformers / peft / torchao versions).
Its answer is what the search printed on stdout and stderr, its exit status, the files ``--write-config`` and
``--write-deepspeed`` wrote, and the digest of every input file the plan read (``--config``, ``--deepspeed``, the
model's ``config.json``): a changed input file is a new question. Only a plan that searched is kept; a
``--device cpu`` plan never is (it reads the memory available now and this process's own resident size).

Entries live under ``$MEMFIT_PLAN_CACHE`` (default ``<memfit cache>/plans``; ``off`` turns it off) and are written
and read as ``memfit.cache`` writes them: atomically, a damaged one said in one line and searched again.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from memfit.cache import cache_root, code_and_versions, digest, file_digest, read_entry, write_entry
from memfit.errors import UserError, print_user_error
from memfit.units import this_machine_memory

FORMAT = 1
SHOWN_BY = ("TERM", "COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")
"""Environment variables that change how rich shows the tables."""


@dataclass
class Answered:
    """What a plan that searched tells its cache: the input files it read (a path, or None where none)."""

    inputs: list[str] | None = None


@dataclass
class Tee:
    """A text stream that writes to ``stream`` and keeps a copy, and is a terminal where ``stream`` is one (so rich
    shows the same output as without it)."""

    stream: TextIO
    kept: list[str] = field(default_factory=list)

    def write(self, text: str) -> int:
        self.kept.append(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", "utf-8")


def plans_root() -> Path | None:
    return cache_root("MEMFIT_PLAN_CACHE", "plans")


def question(ns) -> str | None:
    """The cache name of the plan ``ns`` asks for, or None where it is never cached (``--device cpu``)."""
    if ns.device == "cpu":
        return None
    tty = sys.stdout.isatty()
    return digest(
        {
            "format": FORMAT,
            "flags": {k: v for k, v in sorted(vars(ns).items()) if k not in ("command", "verb")},
            "cwd": os.getcwd(),
            "host_memory": None if ns.host_mem else this_machine_memory(),
            "shown": {
                "tty": tty,
                "width": shutil.get_terminal_size().columns if tty else None,
                **{v: os.environ.get(v) for v in SHOWN_BY},
            },
            "python": sys.version,
            "code": code_and_versions(),
        }
    )


def _answer(entry: Any) -> dict[str, Any]:
    """A kept answer as read (``cache.read_entry``'s parse); ValueError where it is not one."""
    strings = ("stdout", "stderr", "written_at")
    if not (
        isinstance(entry, dict)
        and all(isinstance(entry.get(k), str) for k in strings)
        and isinstance(entry.get("rc"), int)
        and isinstance(entry.get("seconds"), (int, float))
        and isinstance(entry.get("inputs"), dict)
        and isinstance(entry.get("files"), dict)
        and all(isinstance(v, str) for v in entry["files"].values())
    ):
        raise ValueError("not a plan answer")
    return entry


def lookup(key: str) -> dict[str, Any] | None:
    """The kept answer of ``key``, or None: not kept, an input file changed since, or a damaged entry."""
    entry = read_entry(plans_root(), key, "plan", _answer)
    if entry is None:
        return None
    if any(file_digest(path) != was for path, was in entry["inputs"].items()):
        return None
    return entry


def replay(entry: dict[str, Any]) -> int | None:
    """Print a kept answer and write its files again; None (nothing printed) where a file cannot be written, so
    that the plan runs and says why."""
    for path, text in entry["files"].items():
        tmp = Path(f"{path}.tmp-{os.getpid()}")
        try:
            tmp.write_text(text)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            return None
    sys.stdout.write(entry["stdout"])
    sys.stdout.flush()
    print(  # before the kept lines: a kept "nothing fits" stays the last line, as the search printed it
        f"memfit: answered from the plan cache (searched {entry['written_at']} in {entry['seconds']:.1f} s); "
        "MEMFIT_PLAN_CACHE=off searches again",
        file=sys.stderr,
    )
    sys.stderr.write(entry["stderr"])
    return entry["rc"]


def answer(ns) -> int:
    """``memfit plan``: the kept answer where the same question was asked before, else the search (kept)."""
    key = question(ns)
    entry = lookup(key) if key is not None else None
    if entry is not None:
        rc = replay(entry)
        if rc is not None:
            return rc
    from memfit.commands import plan  # the planner, torch and transformers: only when there is no answer

    out, err, answered = Tee(sys.stdout), Tee(sys.stderr), Answered()
    t0 = time.perf_counter()
    sys.stdout, sys.stderr = out, err
    try:
        try:
            rc = plan.run(ns, answered)
        except UserError as e:
            print_user_error(e)
            rc = e.exit_code
    finally:
        sys.stdout, sys.stderr = out.stream, err.stream
    if key is not None and answered.inputs is not None:
        files = {}
        for path in (*((ns.write_config, ns.write_deepspeed) if rc == 0 else ()), ns.html):
            if path and Path(path).is_file():
                files[str(Path(path).resolve())] = Path(path).read_text()
        entry = {
            "stdout": "".join(out.kept),
            "stderr": "".join(err.kept),
            "rc": rc,
            "inputs": {p: file_digest(p) for p in answered.inputs},
            "files": files,
            "written_at": time.strftime("%Y-%m-%d %H:%M:%S"),
            "seconds": time.perf_counter() - t0,
        }
        write_entry(plans_root(), key, entry)
    return rc
