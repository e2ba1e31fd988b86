"""Load a ``RunConfig`` from YAML plus ``section.key=value`` overrides, with typed validation.

Unknown keys get a "did you mean" error naming the key; values are coerced to the field's type and
errors name the dotted field (``train.micro_batch_size must be an integer (got 'four')``).
"""

from __future__ import annotations

import bz2
import dataclasses
import functools
import gzip
import json
import lzma
import os
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from memfit.config.schema import RunConfig, check
from memfit.config.strategy import CheckpointPolicy
from memfit.errors import UserError, did_you_mean, not_a_file


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise UserError(
                    f"{self.name}:{key_node.start_mark.line + 1}: key '{key}' is given twice in one section; keep one"
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(name: str, value: Any, tp: Any) -> Any:
    """Coerce a YAML-typed value to the annotated field type, or raise a UserError naming the field."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        try:
            return _coerce(name, value, inner)
        except UserError as e:  # "must be true or false (got 'auto')": null is the field's default, and allowed
            if " (got " not in str(e):
                raise
            head, got = str(e).split(" (got ", 1)
            raise UserError(f"{head.replace('true or false', 'true, false')} or null (got {got}") from None
    if tp is CheckpointPolicy:
        if isinstance(value, str):
            return CheckpointPolicy.parse(value, name)
        raise UserError(f"{name} must be none | full | ffn | every_k:N (got {value!r})")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"{name} must be true or false (got {value!r})")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise UserError(f"{name} must be an integer (got {value!r})")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise UserError(f"{name} must be a number (got {value!r})")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise UserError(f"{name} must be a string (got {value!r})")
    if origin is list and typing.get_args(tp) == (int,):
        if isinstance(value, int) and not isinstance(value, bool):  # one id: lora.trainable_tokens=128009
            value = [value]
        if isinstance(value, str):
            value = [int(v) if re.fullmatch(r"\s*-?\d+\s*", v) else v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return list(value)
        raise UserError(f"{name} must be a list of integers, e.g. [128000, 128009] (got {value!r})")
    if tp is list or origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise UserError(f"{name} must be a list of strings (got {value!r})")
    raise TypeError(f"unsupported config type {tp} for {name}")


def _apply_section(section_obj: Any, section: str, values: dict[str, Any], origin: str) -> None:
    types = _field_types(type(section_obj))
    if not isinstance(values, dict):
        raise UserError(f"{origin}: section '{section}' must be a mapping (got {values!r})")
    for key, value in values.items():
        if key not in types:
            raise UserError(
                f"{origin}: unknown key '{section}.{key}'{did_you_mean(str(key), types)}"
                f"; valid keys of '{section}': {', '.join(types)}"
            )
        setattr(section_obj, key, _coerce(f"{section}.{key}", value, types[key]))


def _apply(cfg: RunConfig, data: dict[str, Any], origin: str) -> None:
    sections = {f.name for f in dataclasses.fields(RunConfig)}
    for section, values in data.items():
        if section not in sections:
            raise UserError(
                f"{origin}: unknown section '{section}'{did_you_mean(str(section), sections)}"
                f"; valid sections: {', '.join(sorted(sections))}"
            )
        _apply_section(getattr(cfg, section), section, values or {}, origin)


def parse_override(text: str) -> tuple[str, str, Any]:
    """Split ``section.key=value`` into (section, key, YAML-parsed value).

    Raises:
        UserError: when the text is not of that shape.
    """
    if "=" not in text:
        raise UserError(f"override '{text}' must look like section.key=value (e.g. train.max_steps=10)")
    dotted, raw = text.split("=", 1)
    if dotted.count(".") != 1:
        raise UserError(f"override '{text}': the key must be section.key (e.g. train.max_steps), got '{dotted}'")
    section, key = dotted.split(".")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except (yaml.YAMLError, RecursionError):  # taken as the text it is, which the key's type then checks
        value = raw
    return section, key, value


HOME_PATHS = (("output", "dir"), ("data", "source"), ("model", "source"), ("distributed", "deepspeed_config"))
"""Path settings whose leading ``~`` is the user's home (it made a directory named ``~`` in the working one)."""


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Build a validated RunConfig: defaults, then the YAML file, then ``key=value`` overrides.

    Raises:
        UserError: missing/unreadable file, bad YAML, unknown key, wrong type or out-of-range value.
    """
    cfg = RunConfig()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"config file '{p}' {not_a_file(p)}; pass a YAML file (see configs/)")
        try:
            with p.open(encoding="utf-8") as fh:  # a named stream: errors carry the path
                data = yaml.load(fh, Loader=_UniqueKeyLoader) or {}
        except UnicodeDecodeError as e:
            raise UserError(f"{p}: not UTF-8 text (byte {e.start}); save the config as UTF-8 YAML") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{p}:{mark.line + 1}" if mark else str(p)
            raise UserError(f"{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
        except RecursionError:
            raise UserError(f"{p}: not valid YAML ({TOO_DEEP}); give a config of memfit's sections and keys") from None
        if not isinstance(data, dict):
            raise UserError(f"{p}: the top level must be a mapping of sections (got {type(data).__name__})")
        _apply(cfg, data, str(p))
    for text in overrides:
        section, key, value = parse_override(text)
        _apply(cfg, {section: {key: value}}, "override")
    for section, key in HOME_PATHS:  # "~/runs/x" in a YAML file is not expanded by any shell
        value = getattr(getattr(cfg, section), key)
        if isinstance(value, str) and value.startswith("~"):
            setattr(getattr(cfg, section), key, os.path.expanduser(value))
    return check(cfg)


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain data (typed values such as a ``CheckpointPolicy`` as the text a user writes)."""
    return {
        name: {f.name: _plain(getattr(section, f.name)) for f in dataclasses.fields(section)}
        for name, section in ((sec.name, getattr(cfg, sec.name)) for sec in dataclasses.fields(RunConfig))
    }


def _plain(value: Any) -> Any:
    if isinstance(value, CheckpointPolicy):
        return str(value)
    return list(value) if isinstance(value, list) else value


def dump_config(cfg: RunConfig) -> str:
    """The config as YAML text (every field, so a run directory records exactly what ran)."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def config_help() -> str:
    """One line per field: ``section.key (type, default): help``; drives ``memfit train --help-config``."""
    lines = []
    for sec in dataclasses.fields(RunConfig):
        lines.append(f"{sec.name}:")
        for f in dataclasses.fields(sec.default_factory()):
            default = _plain(f.default if f.default is not dataclasses.MISSING else f.default_factory())
            lines.append(f"  {sec.name}.{f.name} = {default!r}\n      {f.metadata.get('help', '')}")
    return "\n".join(lines)


_COMPRESSED = {b"\x1f\x8b": ("gzip", gzip), b"BZh": ("bzip2", bz2), b"\xfd7zXZ\x00": ("xz", lzma)}
"""Leading bytes of a compressed file, the format's name and the module that opens it."""
_CONTAINERS = {
    b"PAR1": "a Parquet file (memfit reads one named .parquet as chat/instruction records)",
    b"ARROW1": "an Arrow file (datasets.Dataset.from_file(path).to_json('out.jsonl') writes its rows as JSON lines)",
    b"PK\x03\x04": "a zip archive (unzip it and give the file inside)",
    b"\x28\xb5\x2f\xfd": "zstd-compressed (zstd -d decompresses it)",
}
"""Leading bytes of binary files a data source is often given as, and what they are."""


def _compression(head: bytes, path: Path, what: str, compressed: bool) -> tuple[str, Any] | None:
    """The format's name and the module that opens a file starting with ``head`` (gzip, bz2, lzma), or None for
    plain bytes.

    Raises:
        UserError: the file is compressed and ``compressed`` is false.
    """
    for magic, (name, module) in _COMPRESSED.items():
        if head.startswith(magic):
            if not compressed:
                raise UserError(f"{what}: '{path}' is {name}-compressed, not text; decompress it")
            return name, module
    return None


def _decompress_error(name: str, path: Path, what: str, error: Exception) -> UserError:
    return UserError(f"{what}: '{path}' is {name}-compressed but cannot be decompressed ({error})")


def _utf8(data: bytes, path: Path, what: str, fix: str, offset: int = 0, line: int = 1) -> str:
    """``data`` decoded, where it starts at byte ``offset`` and line ``line`` of the file (its first bytes checked
    for the binary formats data is often given as, and a UTF-8 byte order mark left out, where ``offset`` is 0).

    Raises:
        UserError: ``what: 'path' ...`` naming the format, or the first NUL or bad byte with ``fix``.
    """
    if offset == 0:
        for magic, name in _CONTAINERS.items():
            if data.startswith(magic):
                raise UserError(f"{what}: '{path}' is {name}, not text")
        if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
            raise UserError(f"{what}: '{path}' is UTF-16 text (iconv -f utf-16 -t utf-8 converts it); {fix}")
    if b"\0" in data:
        at = offset + data.index(0)
        raise UserError(f"{what}: '{path}' is binary, not text (a NUL byte at offset {at}); {fix}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        at, line = offset + e.start, line + data.count(b"\n", 0, e.start)
        raise UserError(
            f"{what}: '{path}' is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {at}, line {line}); {fix}"
        ) from None
    return text.removeprefix("\ufeff") if offset == 0 else text


TOO_DEEP = "nested too deeply to read"
"""What a JSON or YAML value nested past Python's recursion limit (a thousand or so brackets, as only a hostile or
broken file holds) is said to be: the parsers recurse once a level, and the ``RecursionError`` was a traceback."""


def json_value(text: str | bytes) -> Any:
    """``json.loads(text)``, a value nested too deeply for it raised as the ``JSONDecodeError`` every reader already
    answers with one line (``TOO_DEEP``, at line 1, column 1)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError(TOO_DEEP, "", 0) from None


def read_utf8(path: Path, what: str, fix: str, compressed: bool = False) -> str:
    """The text of a user's file (a leading UTF-8 byte order mark, as Windows tools write one, left out), or one
    line naming it when it is binary, UTF-16 or not UTF-8. ``compressed``: a gzip, bzip2 or xz file is read as
    the text it holds (told by its first bytes, whatever its name).

    Raises:
        UserError: ``what: 'path' ...`` with the first bad byte and ``fix``; or the file cannot be read.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise UserError(f"{what}: cannot read '{path}' ({e.strerror})") from None
    packed = _compression(data[:8], path, what, compressed)
    if packed is not None:
        try:
            data = packed[1].decompress(data)
        except (OSError, EOFError, ValueError, lzma.LZMAError) as e:
            raise _decompress_error(packed[0], path, what, e) from None
    return _utf8(data, path, what, fix)


def _whole_characters(raw: bytes) -> int:
    """How many of ``raw``'s bytes end at a character's end: all but a UTF-8 sequence that its end cuts."""
    for back in range(1, min(4, len(raw)) + 1):
        byte = raw[-back]
        if byte < 0x80:
            return len(raw)
        if byte >= 0xC0:  # the lead byte of a sequence of 2, 3 or 4
            return len(raw) if back >= (2 if byte < 0xE0 else 3 if byte < 0xF0 else 4) else len(raw) - back
    return len(raw)  # continuation bytes alone: not UTF-8, which decoding says


def utf8_pieces(path: Path, what: str, fix: str, compressed: bool = False, longest: int = -1) -> Iterator[str]:
    """The text of a user's file a line at a time (each with its ``\n``), read, decompressed and checked as
    ``read_utf8`` does, so that the file is never held whole (a JSON lines file of records). With ``longest`` > 0,
    a longer line comes in pieces of about that many bytes, cut between characters (a JSON array on one line).

    Raises:
        UserError: as ``read_utf8``, at the first bad piece.
    """
    try:
        fh = open(path, "rb")
    except OSError as e:
        raise UserError(f"{what}: cannot read '{path}' ({e.strerror})") from None
    with fh:
        packed = _compression(fh.read(8), path, what, compressed)
        fh.seek(0)
        stream = fh if packed is None else packed[1].open(fh)
        offset, lineno, carry, pending = 0, 1, b"", None
        try:
            for raw in iter(functools.partial(stream.readline, longest), b""):
                raw, carry = carry + raw, b""
                if not raw.endswith(b"\n"):
                    whole = _whole_characters(raw)
                    raw, carry = raw[:whole], raw[whole:]
                if pending is not None:  # a piece is read once the next is: a truncated file's cut end is never
                    yield _utf8(*pending)  # read (nor its cut character said to be not UTF-8) before the error
                pending = raw, path, what, fix, offset, lineno
                offset += len(raw)
                lineno += raw.count(b"\n")
        except (OSError, EOFError, lzma.LZMAError) as e:
            if packed is None:
                raise UserError(f"{what}: cannot read '{path}' ({getattr(e, 'strerror', None) or e})") from None
            raise _decompress_error(packed[0], path, what, e) from None
        if carry:  # the file ends inside a character
            pending = (pending[0] + carry, *pending[1:]) if pending else (carry, path, what, fix, offset, lineno)
        if pending is not None:
            yield _utf8(*pending)


def utf8_lines(path: Path, what: str, fix: str, compressed: bool = False) -> Iterator[str]:
    """The lines of a user's file (split at ``\n`` only, without it), as ``utf8_pieces`` reads them.

    Raises:
        UserError: as ``read_utf8``, at the first bad line.
    """
    pieces = utf8_pieces(path, what, fix, compressed)
    try:
        for piece in pieces:
            yield piece.removesuffix("\n")
    finally:
        pieces.close()
