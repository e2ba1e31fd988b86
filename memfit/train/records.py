"""Chat and instruction records as users keep them: ``{"messages": [...]}``, ShareGPT's ``{"conversations": [...]}``,
``{"prompt", "response"}``, Alpaca's ``{"instruction", "input", "output"}`` or a document's ``{"text"}``; in JSON
lines, one JSON array or Parquet (gzip, bzip2 or xz compressed or not). Each record is read into the conversation it
spells, as chat messages (a document into its text), or one line naming the file and the line (record, row) where
it is not one.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

from memfit.config.loader import TOO_DEEP, json_value, read_utf8, utf8_lines, utf8_pieces
from memfit.config.schema import data_suffix
from memfit.errors import UserError, first_line


def _text_content(content: object) -> str | None:
    """A message's content as text: a string, or OpenAI-style parts that are all ``{"type": "text", "text": ...}``
    (joined); None for anything else (an image part, a number)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content
    ):
        return "".join(part["text"] for part in content)
    return None


TURN_KEYS = ("messages", "conversations", "conversation")
"""The keys a record keeps its turns under: OpenAI's and TRL's, ShareGPT's, and LMSYS-Chat-1M's and WildChat's."""


def record_messages(record: object, where: str) -> list[dict]:
    """A record's conversation: ``{"messages": [...]}`` (content a string or text parts), ShareGPT's
    ``{"conversations": [...]}`` (or LMSYS's and WildChat's ``conversation``), ``{"prompt", "response"}`` or Alpaca's
    ``{"instruction", "input", "output"}`` (the input, where not empty, after the instruction)."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: a record must be a JSON object (got {type(record).__name__})")
    for key in TURN_KEYS:
        if key in record:
            return _turns(record[key], key, where)
    if isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
    if isinstance(record.get("instruction"), str) and isinstance(record.get("output"), str):
        extra = "" if record.get("input") is None else record["input"]  # null in a Parquet row: no input
        if not isinstance(extra, str):
            raise UserError(f"{where}: 'input' must be a string (got {extra!r:.80})")
        prompt = record["instruction"] + (f"\n\n{extra}" if extra.strip() else "")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]
    if "chosen" in record and "rejected" in record:
        raise UserError(
            f"{where}: a preference pair ('chosen' and 'rejected', for DPO or reward training), which memfit does not "
            "train; to fine-tune on the chosen answers, give them as 'response' (or 'messages')"
        )
    raise UserError(
        f"{where}: need 'messages', 'conversations' ('conversation'), string 'prompt' and 'response', string "
        f"'instruction' and 'output', or a string 'text' (keys: {', '.join(record) or 'none'})"
    )


def _tool_call_names(message: dict) -> list[str]:
    """The function names of a message's OpenAI-style ``tool_calls`` (``[{"function": {"name": ...}}]``), if any."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return []
    names = [c.get("function", {}).get("name") if isinstance(c, dict) else None for c in calls]
    return [n for n in names if isinstance(n, str) and n]


def check_tool_calls_rendered(messages: list[dict], rendered: str, where: str, render: Callable) -> None:
    """Refuse a conversation whose tool calls the chat template leaves out (SmolLM2's renders ``content`` only): the
    answer that calls a tool would be trained as what its content says, often nothing. ``rendered`` is the whole
    conversation's rendering, ``render`` renders another; a template leaves the calls out where the conversation
    without them renders alike (one that refuses it reads them).

    Raises:
        UserError: naming the record, the first message that calls a tool and its call.
    """
    calling = [k for k, m in enumerate(messages) if _tool_call_names(m)]
    if not calling:
        return
    try:
        alike = render([{key: v for key, v in m.items() if key != "tool_calls"} for m in messages]) == rendered
    except UserError:
        alike = False
    if alike:
        k = calling[0]
        raise UserError(
            f"{where}: message {k + 1} calls {_tool_call_names(messages[k])[0]}, but the model's chat template leaves "
            "its tool_calls out (it would be trained as its content alone); give a model whose template renders tool "
            "calls, or write the call into 'content'"
        )


_CHAT_KEYS = {*TURN_KEYS, "prompt", "response", "instruction", "output"}


def record_content(record: object, where: str) -> list[dict] | str:
    """A record's conversation (``record_messages``), or the text of a ``{"text": ...}`` record with none of the
    chat keys: a document (``datasets``' text datasets written as JSON lines, as for continued pre-training),
    trained on whole."""
    if isinstance(record, dict) and isinstance(record.get("text"), str) and not _CHAT_KEYS & record.keys():
        return record["text"]
    return record_messages(record, where)


_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}
"""ShareGPT's speakers (``from``) and the chat roles they are (FastChat's and Axolotl's reading; LLaMA-Factory's
``function_call``, an answer whose text is the call, and ``observation``, the tool's result)."""


ROLE_ALIASES = {"human": "user", "gpt": "assistant"}
"""ShareGPT's two speakers where a ``role`` names them (``{"role": "human", "content": ...}``, as datasets converted
half-way keep them): the roles chat templates know."""


def _turns(turns: object, key: str, where: str) -> list[dict]:
    """A record's ``messages`` or ``conversations`` as chat messages: each turn either OpenAI-style (``role``, and
    ``content`` a string or text parts; ShareGPT's ``human`` and ``gpt`` read as ``user`` and ``assistant``, other
    roles reach the template as they are) or ShareGPT-style (``from`` one of ``_SHAREGPT_ROLES``, ``value`` a string),
    under either key: datasets on the Hub keep ``conversations`` of roles and contents as often as of speakers."""
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{where}: '{key}' must be a non-empty list")
    out = [_sharegpt_turn(t, key, where) if _is_sharegpt(t) else _message(t, key, where) for t in turns]
    if out[-1]["role"] != "assistant":
        last = turns[-1]
        said = f"from '{last['from']}'" if _is_sharegpt(last) else f"role '{last['role']}'"
        raise UserError(
            f"{where}: the last of '{key}' must be the assistant's answer (role 'assistant', or from 'gpt' or "
            f"'function_call') (got {said})"
        )
    return out


def _is_sharegpt(turn: object) -> bool:
    """A turn of ShareGPT's shape: ``from``, and no ``role`` (or a null one: a Parquet file's rows share one schema,
    which holds every key any turn has)."""
    return isinstance(turn, dict) and "from" in turn and turn.get("role") is None


def _message(m: object, key: str, where: str) -> dict:
    text = _text_content(m.get("content")) if isinstance(m, dict) else None
    if text is None and isinstance(m, dict) and m.get("content") is None and _tool_call_names(m):
        text = ""  # OpenAI's assistant turn that only calls tools: its content is null
    if not (isinstance(m, dict) and isinstance(m.get("role"), str) and text is not None):
        raise UserError(
            f"{where}: each of '{key}' needs a string 'role' and a 'content' of text (a string, or parts of type "
            f"'text'), or ShareGPT's 'from' and 'value' (got {m!r:.80})"
        )
    return {**m, "role": ROLE_ALIASES.get(m["role"], m["role"]), "content": text}


def _sharegpt_turn(t: dict, key: str, where: str) -> dict:
    role = _SHAREGPT_ROLES.get(t["from"]) if isinstance(t["from"], str) else None
    if role is None or not isinstance(t.get("value"), str):
        raise UserError(
            f"{where}: each of '{key}' needs 'from' ({' | '.join(_SHAREGPT_ROLES)}) and a string 'value' "
            f"(got {t!r:.80})"
        )
    return {"role": role, "content": t["value"]}


ONE_VALUE_READ = 64 << 20
"""The largest file read whole to tell whether a first line that is not JSON opens one JSON object spread over its
lines (a pretty-printed record); a larger one is said as its first bad line, not read whole for the message."""


def _json_lines(numbered: Iterator[tuple[int, str]], path: Path) -> Iterator[tuple[str, object]]:
    """``(where, record)`` for each value of numbered JSON lines.

    Raises:
        UserError: ``file:line`` of the first line that is not JSON (or, for the first, that the whole file is one
            JSON object across its lines).
    """
    first = True
    for lineno, line in numbered:
        if not line.strip():
            continue
        try:
            value = json_value(line)
        except json.JSONDecodeError as e:
            if first and path.stat().st_size <= ONE_VALUE_READ and _is_one_json_value(_whole(path)):
                raise UserError(
                    f"{path}: holds one JSON object across its lines; give one record per line (JSON lines) or a "
                    "JSON array of records"
                ) from None
            raise UserError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        first = False
        yield f"{path}:{lineno}", value


_FIX = "save the chat records as UTF-8 JSON lines"


def _whole(path: Path) -> str:
    return read_utf8(path, "data.source", _FIX, compressed=True)


JSON_PIECE = 1 << 20
"""Bytes of a JSON array's text read at a time: a minified array is one line, read in pieces of about this size."""


def _json_array(path: Path, text: str, pieces: Iterator[str]) -> Iterator[tuple[str, object]]:
    """``(where, record)`` for each value of the JSON array that ``text`` opens and ``pieces`` (the rest of the file)
    go on with, each decoded once the text read reaches its end: the array is never held whole.

    Raises:
        UserError: ``file:line`` of the first text that is not JSON (a value not whole within ``ONE_VALUE_READ``
            characters is said as the decoder finds it there).
    """
    decode = json.JSONDecoder().raw_decode
    buf, pos, line, column, more = text, 0, 1, 0, True  # buf[0] is at ``line``, after ``column`` of its characters

    def read() -> bool:
        """Drop what is decoded and add at least as much text as is left (a piece at least); False at the end."""
        nonlocal buf, pos, line, column, more
        newline = buf.rfind("\n", 0, pos)
        line, column = line + buf.count("\n", 0, pos), pos - newline - 1 if newline >= 0 else column + pos
        added, want = [], max(len(buf) - pos, 1)
        while more and sum(map(len, added)) < want:
            piece = next(pieces, None)
            more = piece is not None
            added += [piece] if more else []
        buf, pos = buf[pos:] + "".join(added), 0
        return bool(added)

    def error(message: str, at: int) -> UserError:
        newline = buf.rfind("\n", 0, at)
        where = f"{line + buf.count(chr(10), 0, at)}: not valid JSON ({message} at column "
        return UserError(f"{path}:{where}{at - newline if newline >= 0 else column + at + 1})")

    def next_character() -> str:
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf) or not read():
                return buf[pos : pos + 1]

    next_character()
    pos += 1  # the array's "["
    closed, count = next_character() == "]", 0
    while not closed:
        if not next_character():
            raise error("Expecting value", pos)
        while True:
            try:
                value, end = decode(buf, pos)
            except json.JSONDecodeError as e:
                if len(buf) - pos < ONE_VALUE_READ and read():
                    continue
                raise error(e.msg, e.pos) from None
            except RecursionError:
                raise error(TOO_DEEP, pos) from None
            if end < len(buf) or not read():  # at the end of what is read, a number may go on
                break
        pos, count = end, count + 1
        yield f"{path}: record {count}", value
        after = next_character()
        if after not in (",", "]"):
            raise error("Expecting ',' delimiter", pos)
        pos += 1
        closed = after == "]"
    if closed and count == 0:
        pos += 1
    if next_character():
        raise error("Extra data", pos)


def _json_file_records(path: Path) -> Iterator[tuple[str, object]]:
    """``(where, record)`` for each record of a JSON file: one JSON value per line (JSON lines), read a line at a
    time, or one JSON array of them (Alpaca's ``alpaca_data.json``, what ``datasets.load_dataset("json")`` also
    reads), read a value at a time, a minified one too: the file is never held whole.

    Raises:
        UserError: ``file:line`` (or ``file: record N``) of the first value that is not JSON.
    """
    pieces = utf8_pieces(path, "data.source", _FIX, compressed=True, longest=JSON_PIECE)
    head = ""
    for first in pieces:
        head += first
        if head.strip():
            break
    else:
        return
    if not head.lstrip().startswith("[") or (first.endswith("\n") and _lines_of_arrays(first, pieces)):
        pieces.close()  # JSON lines (the first of them an array, followed by more: records that are arrays)
        yield from _json_lines(enumerate(utf8_lines(path, "data.source", _FIX, compressed=True), 1), path)
        return
    with contextlib.closing(pieces):
        yield from _json_array(path, head, pieces)


def _lines_of_arrays(first: str, pieces: Iterator[str]) -> bool:
    """Whether a file whose first line (``first``, whole) is a JSON array by itself has more after it (JSON lines
    whose records are arrays; ``pieces`` is the rest, read only as far as its first text)."""
    try:
        json_value(first)
    except json.JSONDecodeError:
        return False
    return any(piece.strip() for piece in pieces)


PARQUET_BATCH = 1024
"""Rows of a Parquet file made Python records at a time: the file's columns are read a row group at a time, never
the whole table as Python objects."""


def _parquet_records(path: Path) -> Iterator[tuple[str, object]]:
    """``(where, record)`` for each row of a Parquet file (as the Hub keeps datasets), a dict of its columns, read a
    batch of rows at a time.

    Raises:
        UserError: pyarrow is not installed, or the file is not Parquet.
    """
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(
            f"data.source: '{path}' is Parquet, which needs pyarrow: pip install 'memfit[data]' (or pyarrow)"
        ) from None
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH)
        i = 0
        for batch in batches:
            for record in batch.to_pylist():
                i += 1
                yield f"{path}: row {i}", record
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise UserError(f"data.source: '{path}' is not a readable Parquet file ({first_line(e)})") from None


def file_records(path: Path) -> Iterator[tuple[str, object]]:
    """``(where, record)`` for each record of a data file: Parquet rows, or JSON (lines or one array)."""
    if data_suffix(path.name) == ".parquet":
        return _parquet_records(path)
    return _json_file_records(path)


def _is_one_json_value(text: str) -> bool:
    try:
        json_value(text)
    except json.JSONDecodeError:
        return False
    return True
