import bz2
import copy
import gzip
import json
import lzma
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from memfit.config.loader import load_config
from memfit.config.schema import DataConfig
from memfit.errors import UserError
from memfit.models.load import ModelSource, load_tokenizer
from memfit.step.loss import IGNORE_INDEX
from memfit.train.data import EpochBatchSampler, load_dataset, shakespeare_files, split
from memfit.train.records import record_messages


@pytest.fixture(scope="module")
def tokenizer(embedded_dir):
    return load_tokenizer(ModelSource("hf", path=embedded_dir))


def test_shakespeare_ships_the_plays():
    names = {f.name for f in shakespeare_files()}
    assert "hamlet_gut.txt" in names and len(names) >= 30


def test_text_is_packed_into_full_rows(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text("To be, or not to be, that is the question. " * 40)
    ds = load_dataset(DataConfig(source=str(tmp_path / "a.txt"), seq_len=16), tokenizer)
    n_tokens = (
        len(tokenizer("To be, or not to be, that is the question. " * 40, add_special_tokens=False)["input_ids"]) + 1
    )
    assert ds.tokens.shape == (n_tokens // 17, 17)
    assert torch.equal(ds.tokens, ds.labels)


def test_split_is_fixed_and_disjoint(tokenizer):
    ds = load_dataset(DataConfig(seq_len=32, max_documents=1), tokenizer)
    tr1, ev1 = split(ds, 0.1)
    tr2, ev2 = split(ds, 0.1)
    assert torch.equal(ev1.tokens, ev2.tokens)
    assert len(tr1) + len(ev1) == len(ds) and len(ev1) == round(len(ds) * 0.1)


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_chat_records_mask_the_prompt(tmp_path, tokenizer):
    src = _write_jsonl(
        tmp_path / "d.jsonl",
        [
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": "Who wrote Hamlet?"},
                        {"role": "assistant", "content": "Shakespeare."},
                    ]
                }
            ),
            json.dumps({"prompt": "Name a play.", "response": "Macbeth."}),
        ],
    )
    ds = load_dataset(DataConfig(source=src, seq_len=64, packing=False), tokenizer)
    assert ds.tokens.shape == (2, 65)
    row, lab = ds.tokens[0], ds.labels[0]
    answer = tokenizer("Shakespeare.", add_special_tokens=False)["input_ids"]
    supervised = lab[lab != IGNORE_INDEX].tolist()
    assert supervised[: len(answer)] == answer  # loss starts exactly at the answer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Who wrote Hamlet?"}], add_generation_prompt=True, tokenize=True
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert (lab[: len(prompt)] == IGNORE_INDEX).all() and row[: len(prompt)].tolist() == prompt


def test_text_parts_and_alpaca_records_are_the_conversations_they_spell(tmp_path, tokenizer):
    """OpenAI-style content parts and Alpaca's instruction/input/output records (both refused before) render as the
    same conversation written with string contents and prompt/response."""
    records = [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Who wrote "}, {"type": "text", "text": "Hamlet?"}],
                },
                {"role": "assistant", "content": [{"type": "text", "text": "Shakespeare."}]},
            ]
        },
        {"instruction": "Name a play.", "input": "By Shakespeare.", "output": "Macbeth."},
        {"instruction": "Name a poet.", "input": "", "output": "Marlowe."},
    ]
    plain = [
        {"prompt": "Who wrote Hamlet?", "response": "Shakespeare."},
        {"prompt": "Name a play.\n\nBy Shakespeare.", "response": "Macbeth."},
        {"prompt": "Name a poet.", "response": "Marlowe."},
    ]
    got, want = (
        load_dataset(
            DataConfig(source=_write_jsonl(tmp_path / f"{n}.jsonl", map(json.dumps, r)), seq_len=64, packing=False),
            tokenizer,
        )
        for n, r in (("spelled", records), ("plain", plain))
    )
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.labels, want.labels)


@pytest.mark.parametrize(
    "line, reason",
    [
        ("{not json", "not valid JSON"),
        ('{"messages": []}', "'messages' must be a non-empty list"),
        (
            '{"messages": [{"role": "user", "content": "hi"}]}',
            "last of 'messages' must be the assistant's .*role 'user'",
        ),
        (
            '{"question": "hi", "answer": "ho"}',
            "need 'messages', 'conversations' \\('conversation'\\), string 'prompt' and 'response', string "
            "'instruction' and 'output', or a string 'text' \\(keys: question, answer\\)",
        ),
        (
            '{"messages": [{"role": "user", "content": [{"type": "image_url"}]}, '
            '{"role": "assistant", "content": "a"}]}',
            "a 'content' of text",
        ),
        ("[1, 2]", "a record must be a JSON object"),
        ('{"prompt": "q", "chosen": "a", "rejected": "b"}', "a preference pair .* give them as 'response'"),
    ],
)
def test_bad_record_names_file_and_line(tmp_path, tokenizer, line, reason):
    good = json.dumps({"prompt": "a", "response": "b"})
    src = _write_jsonl(tmp_path / "bad.jsonl", [good, good, line])
    with pytest.raises(UserError, match=rf"bad.jsonl:3: .*{reason}"):
        load_dataset(DataConfig(source=src, seq_len=32), tokenizer)


@pytest.mark.parametrize(
    "template, why",
    [("{% if %}", r"line 1: Expected an expression"), ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "nested too")],
)
def test_a_chat_template_that_does_not_compile_is_said_to_be_the_models(
    tmp_path, tokenizer, monkeypatch, template, why
):
    """A broken template was "data.jsonl:1: the model's chat template refuses this conversation", as if the record
    were at fault; one nested past Jinja's parser was a RecursionError traceback."""
    monkeypatch.setattr(tokenizer, "chat_template", template)
    src = _write_jsonl(tmp_path / "d.jsonl", [json.dumps({"prompt": "a", "response": "b"})] * 2)
    with pytest.raises(UserError, match=rf"^model.source: the model's chat template is not a usable Jinja .*\({why}"):
        load_dataset(DataConfig(source=src, seq_len=32), tokenizer)


def test_missing_data_source():
    with pytest.raises(UserError, match="data.source: 'nope.txt' does not exist"):
        load_dataset(DataConfig(source="nope.txt"), tokenizer=None)


def test_empty_text_is_named_as_empty(tmp_path, tokenizer):
    """An empty .txt was "only 1 tokens, fewer than two rows" (the 1 was the EOS memfit appends)."""
    (tmp_path / "a.txt").write_text("")
    with pytest.raises(UserError, match=rf"data.source: '{tmp_path / 'a.txt'}' is empty \(no text to tokenize\)"):
        load_dataset(DataConfig(source=str(tmp_path / "a.txt"), seq_len=16), tokenizer)
    (tmp_path / "b.txt").write_text("")
    with pytest.raises(UserError, match=rf"the 2 .txt files in '{tmp_path}' are empty"):
        load_dataset(DataConfig(source=str(tmp_path), seq_len=16), tokenizer)


def test_sampler_resumes_at_any_batch():
    full = EpochBatchSampler(10, 3, seed=5)
    it = iter(full)
    first = [next(it) for _ in range(8)]  # crosses two epoch boundaries (3 batches per epoch)
    resumed = iter(EpochBatchSampler(10, 3, seed=5, start_batch=4))
    assert [next(resumed) for _ in range(4)] == first[4:]
    assert sorted(sum(first[:3], [])) == sorted(set(sum(first[:3], [])))  # no repeats within an epoch


def test_a_json_array_of_records_is_chat_data_as_its_lines_are(tmp_path, tokenizer):
    """``alpaca_data.json`` is one JSON array: it was read as plain text (brackets and keys trained on as prose);
    now a ``.json`` source is records, an array or one per line, the same rows as the ``.jsonl`` of them."""
    records = [
        {"instruction": "Name a play.", "input": "By Shakespeare.", "output": "Macbeth."},
        {"prompt": "Who wrote Hamlet?", "response": "Shakespeare."},
        {"instruction": "Name a poet.", "input": "", "output": "Marlowe."},
    ]
    (tmp_path / "alpaca.json").write_text(json.dumps(records, indent=2))
    lines = _write_jsonl(tmp_path / "lines.json", map(json.dumps, records))
    jsonl = _write_jsonl(tmp_path / "d.jsonl", map(json.dumps, records))
    want = load_dataset(DataConfig(source=jsonl, seq_len=64), tokenizer)
    for source in (str(tmp_path / "alpaca.json"), lines):
        cfg = DataConfig(source=source, seq_len=64)
        assert cfg.is_chat() and cfg.packs()
        got = load_dataset(cfg, tokenizer)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.labels, want.labels)
    assert not DataConfig(source=str(tmp_path / "alpaca.json"), format="text").is_chat()


@pytest.mark.parametrize(
    "text, message",
    [
        ('{\n  "data": [{"prompt": "a", "response": "b"}]\n}', "holds one JSON object across its lines; give one"),
        ('[{"prompt": "a", "response": "b"},\n {"prompt": ]', r"d.json:2: not valid JSON \(Expecting value"),
        ('[{"prompt": "a", "response": "b"}, {"prompt": "a", "response": "b"}, 3]', "d.json: record 3: a record must"),
        ('["a", "b"]\n{"prompt": "a", "response": "b"}', "d.json:1: a record must be a JSON object"),
    ],
)
def test_a_json_file_that_is_not_records_names_where(tmp_path, tokenizer, text, message):
    (tmp_path / "d.json").write_text(text)
    with pytest.raises(UserError, match=message) as e:
        load_dataset(DataConfig(source=str(tmp_path / "d.json"), seq_len=32), tokenizer)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["deep.jsonl", "deep.json"])
def test_a_record_nested_past_the_parsers_recursion_is_one_line(tmp_path, tokenizer, name):
    """A line (or array) of a hundred thousand brackets was a ``RecursionError`` traceback from ``json``."""
    (tmp_path / name).write_text('{"prompt": "a", "response": "b"}\n' + "[" * 100_000 + "\n")
    with pytest.raises(UserError, match=rf"{name}:2: not valid JSON \(nested too deeply to read") as e:
        load_dataset(DataConfig(source=str(tmp_path / name), seq_len=32), tokenizer)
    assert "\n" not in str(e.value)
    (tmp_path / "array.json").write_text('[{"prompt": "a", "response": "b"}, ' + "[" * 100_000)
    with pytest.raises(UserError, match=r"array.json:1: not valid JSON \(nested too deeply to read"):
        load_dataset(DataConfig(source=str(tmp_path / "array.json"), seq_len=32), tokenizer)


def test_a_big_file_whose_first_line_is_not_json_is_not_read_whole_for_the_message(tmp_path, monkeypatch):
    """Telling a pretty-printed object from a bad first line reads the file whole: only up to ONE_VALUE_READ."""
    from memfit.train import records

    (tmp_path / "d.json").write_text('{\n  "data": [{"prompt": "a", "response": "b"}]\n}')
    monkeypatch.setattr(records, "ONE_VALUE_READ", 10)
    monkeypatch.setattr(records, "read_utf8", lambda *a, **k: pytest.fail("read whole"))
    with pytest.raises(UserError, match=r"d.json:1: not valid JSON \(Expecting property name"):
        list(records.file_records(tmp_path / "d.json"))


def _conversation(*turns):
    roles = ("user", "assistant")
    return {"messages": [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]}


def _chat_ids(tokenizer, messages, **kw):
    """The ids transformers' own ``apply_chat_template(..., tokenize=True)`` gives."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _supervised(ds, row=0):
    return ds.tokens[row][ds.labels[row] != IGNORE_INDEX].tolist()


def test_every_assistant_message_takes_the_loss_or_only_the_last(tmp_path, tokenizer):
    """Only the final answer of a conversation took the loss: the earlier answers of multi-turn data taught nothing.
    Now each assistant message is scored (``data.loss_on: assistant``, as torchtune, Axolotl and TRL do), each
    exactly as the conversation up to it scores its final answer; ``last`` keeps the final answer alone."""
    turns = ("Who wrote Hamlet?", "Shakespeare.", "And Faustus?", "Marlowe, in 1592.")
    two = _write_jsonl(tmp_path / "two.jsonl", [json.dumps(_conversation(*turns))] * 2)
    first = _write_jsonl(tmp_path / "first.jsonl", [json.dumps(_conversation(*turns[:2]))] * 2)
    every, last, alone = (
        load_dataset(DataConfig(source=src, seq_len=96, packing=False, loss_on=on), tokenizer)
        for src, on in ((two, "assistant"), (two, "last"), (first, "assistant"))
    )
    n = len(_chat_ids(tokenizer, _conversation(*turns[:2])["messages"]))  # the first exchange's tokens, alone
    assert torch.equal(every.tokens, last.tokens) and torch.equal(every.tokens[0, :n], alone.tokens[0, :n])
    assert torch.equal(every.labels[0, :n], alone.labels[0, :n])  # the first answer scored as when it ends the talk
    assert (last.labels[0, :n] == IGNORE_INDEX).all()
    assert torch.equal(every.labels[0, n:], last.labels[0, n:])  # the final answer scored the same either way
    marlowe = tokenizer("Marlowe, in 1592.", add_special_tokens=False)["input_ids"]
    shakespeare = tokenizer("Shakespeare.", add_special_tokens=False)["input_ids"]
    assert _supervised(last)[: len(marlowe)] == marlowe
    got = _supervised(every)
    assert got[: len(shakespeare)] == shakespeare and len(got) == len(_supervised(alone)) + len(_supervised(last))
    with pytest.raises(UserError, match=r"data.loss_on must be one of assistant \| last \(got 'all'\)"):
        load_config(None, ["data.loss_on=all"])


def test_a_template_that_renders_an_earlier_answer_differently_is_one_line(tmp_path, tokenizer):
    """A template that writes an answer one way at the end of a conversation and another inside it (as reasoning
    models' templates drop earlier thinking) cannot place the earlier answers: said, with the setting that works."""
    odd = copy.deepcopy(tokenizer)
    odd.chat_template = (
        "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}[{{ m.content }}]"
        "{% else %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>"
        "{% endif %}"
    )
    src = _write_jsonl(tmp_path / "d.jsonl", [json.dumps(_conversation("a", "b", "c", "d"))] * 2)
    message = r"d.jsonl:1: the chat template renders the conversation up to message 2 differently inside the conv"
    with pytest.raises(UserError, match=message + r".*; data.loss_on=last scores the final answer only"):
        load_dataset(DataConfig(source=src, seq_len=64, packing=False), odd)
    ds = load_dataset(DataConfig(source=src, seq_len=64, loss_on="last", packing=False), odd)
    assert _supervised(ds) == odd("d", add_special_tokens=False)["input_ids"]


def test_sharegpt_conversations_are_the_messages_they_spell(tmp_path, tokenizer):
    """ShareGPT's ``{"conversations": [{"from": "human", "value": ...}]}`` (Axolotl's most common format) was
    refused as lacking 'messages'; it is the conversation of the same roles."""
    talk = ("Who wrote Hamlet?", "Shakespeare.", "And Faustus?", "Marlowe.")
    speakers = ("human", "gpt")
    sharegpt = {
        "conversations": [{"from": "system", "value": "Be brief."}]
        + [{"from": speakers[i % 2], "value": text} for i, text in enumerate(talk)]
    }
    messages = _conversation(*talk)
    messages["messages"].insert(0, {"role": "system", "content": "Be brief."})
    got, want = (
        load_dataset(
            DataConfig(source=_write_jsonl(tmp_path / f"{n}.jsonl", [json.dumps(r)] * 2), seq_len=96, packing=False),
            tokenizer,
        )
        for n, r in (("sharegpt", sharegpt), ("messages", messages))
    )
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.labels, want.labels)
    calls = {
        "conversations": [
            {"from": "human", "value": "2+3?"},
            {"from": "function_call", "value": '{"name": "add", "arguments": {"a": 2, "b": 3}}'},
            {"from": "observation", "value": "5"},
            {"from": "gpt", "value": "5."},
        ]
    }  # LLaMA-Factory's tool calling: the call is an answer, the result the tool's message
    roles = [m["role"] for m in record_messages(calls, "x")]
    assert roles == ["user", "assistant", "tool", "assistant"]


def test_either_key_holds_either_shape_of_turn(tmp_path, tokenizer):
    """Hub datasets keep ``conversations`` of roles and contents (refused: "needs 'from'") and ``messages`` of
    ShareGPT's speakers (``"role": "human"`` trained as an unknown role): each is the conversation it spells, and a
    record of both shapes reads as one of either."""
    talk = ("Who wrote Hamlet?", "Shakespeare.", "And Faustus?", "Marlowe.")
    want = _conversation(*talk)["messages"]
    spelled = [
        {"conversations": want},
        {"messages": [{"from": ("human", "gpt")[i % 2], "value": text} for i, text in enumerate(talk)]},
        {"messages": [{"role": ("human", "gpt")[i % 2], "content": text} for i, text in enumerate(talk)]},
        {"conversations": [{"from": "human", "value": talk[0]}, *want[1:]]},
        {"conversation": [{**m, "turn_identifier": 7} for m in want]},  # LMSYS-Chat-1M's and WildChat's key
        {"messages": [{"from": ("human", "gpt")[i % 2], "value": t, "role": None} for i, t in enumerate(talk)]},
    ]
    for record in spelled:
        assert [{k: m[k] for k in ("role", "content")} for m in record_messages(record, "x")] == want
    tokens = [
        load_dataset(
            DataConfig(source=_write_jsonl(tmp_path / f"{n}.jsonl", [json.dumps(r)] * 2), seq_len=96, packing=False),
            tokenizer,
        )
        for n, r in enumerate([{"messages": want}, *spelled])
    ]
    assert all(torch.equal(t.tokens, tokens[0].tokens) and torch.equal(t.labels, tokens[0].labels) for t in tokens)
    kept = {"role": "ipython", "content": "5", "name": "calc"}  # a role no alias names reaches the template as it is
    assert record_messages({"conversations": [kept, want[1]]}, "x")[0] == kept


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"conversations": []}, "'conversations' must be a non-empty list"),
        ({"conversations": [{"from": "bot", "value": "a"}]}, r"needs 'from' \(human \| user \| gpt"),
        ({"conversations": [{"from": "human", "value": 3}]}, "and a string 'value'"),
        ({"conversations": [{"from": ["human"], "value": "a"}]}, r"needs 'from' \(human"),
        ({"conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "b"}]}, "got from 'human'"),
        ({"conversations": [{"role": "user", "content": None}]}, "needs a string 'role' .* or ShareGPT's 'from'"),
    ],
)
def test_a_bad_sharegpt_record_names_file_and_line(tmp_path, tokenizer, record, reason):
    good = json.dumps({"prompt": "a", "response": "b"})
    src = _write_jsonl(tmp_path / "bad.jsonl", [good, json.dumps(record)])
    with pytest.raises(UserError, match=rf"bad.jsonl:2: .*{reason}"):
        load_dataset(DataConfig(source=src, seq_len=32), tokenizer)


@pytest.mark.parametrize("suffix, module", [(".gz", gzip), (".bz2", bz2), (".xz", lzma)])
def test_compressed_data_is_read_as_the_text_it_holds(tmp_path, tokenizer, suffix, module):
    """``records.jsonl.gz`` (as datasets writes them) was "binary, not text ... iconv -f latin1": gzip, bzip2 and
    xz files are read as what they hold, told by their first bytes, their format by the name before the suffix."""
    lines = [json.dumps({"prompt": f"Name play {i}.", "response": "Macbeth." * (i + 1)}) for i in range(4)]
    plain = _write_jsonl(tmp_path / "d.jsonl", lines)
    (tmp_path / f"d.jsonl{suffix}").write_bytes(module.compress(Path(plain).read_bytes()))
    want = load_dataset(DataConfig(source=plain, seq_len=64), tokenizer)
    cfg = DataConfig(source=str(tmp_path / f"d.jsonl{suffix}"), seq_len=64)
    assert cfg.is_chat() and cfg.packs()
    got = load_dataset(cfg, tokenizer)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.labels, want.labels)
    text = "To be, or not to be, that is the question. " * 40
    (tmp_path / "plays").mkdir()
    (tmp_path / "plays" / "a.txt").write_text(text)
    (tmp_path / "plays" / f"b.txt{suffix}").write_bytes(module.compress(text.encode()))
    both = load_dataset(DataConfig(source=str(tmp_path / "plays"), seq_len=16), tokenizer)
    one = load_dataset(DataConfig(source=str(tmp_path / "plays" / "a.txt"), seq_len=16), tokenizer)
    assert len(both) in (2 * len(one), 2 * len(one) + 1)  # the same text twice, an EOS after each
    assert torch.equal(both.tokens[: len(one)], one.tokens)


@pytest.mark.parametrize(
    "name, data, message",
    [
        ("d.jsonl.gz", gzip.compress(b'{"prompt": "a"}\n', mtime=0)[:-6], r"is gzip-compressed but cannot be"),
        ("d.jsonl", b"PAR1\x15\x04\x15" + bytes(40), r"is a Parquet file \(memfit reads one named .parquet as chat"),
        ("d.txt", b"PK\x03\x04" + bytes(40), r"is a zip archive \(unzip it and give the file inside\), not text"),
        ("d.jsonl.zst", b"\x28\xb5\x2f\xfd" + bytes(40), r"is zstd-compressed \(zstd -d decompresses it\), not text"),
    ],
    ids=["gzip-truncated", "parquet-misnamed", "zip", "zstd"],  # bytes in ids: xdist workers must collect the same
)
def test_an_archive_or_a_broken_compressed_file_is_named(tmp_path, tokenizer, name, data, message):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(UserError, match=rf"data.source: '{tmp_path / name}' {message}") as e:
        load_dataset(DataConfig(source=str(tmp_path / name), seq_len=32), tokenizer)
    assert "\n" not in str(e.value)


def test_records_are_tokenized_as_the_chat_template_tokenizes_each(tmp_path, tokenizer):
    """Records are rendered to text and tokenized in batches (the fast tokenizer on every CPU): the rows are those
    of transformers' ``apply_chat_template(..., tokenize=True)`` one record at a time."""
    from memfit.train import data

    talks = [
        _conversation(f"Who wrote play {i}?", "Shakespeare. " * (i % 5 + 1), "When?", "1600." * i) for i in range(9)
    ]
    talks += [{"prompt": f"Name {i}.", "response": " x" * i} for i in range(1, 8)]
    src = _write_jsonl(tmp_path / "d.jsonl", map(json.dumps, talks))
    records = data.chat_records([Path(src)], tokenizer, None, "assistant")
    for record, (ids, labels) in zip(talks, records):
        messages = record_messages(record, "x")
        assert ids == _chat_ids(tokenizer, messages)
        for k in data._scored(messages, "assistant"):
            start = len(_chat_ids(tokenizer, messages[:k], add_generation_prompt=True))
            end = len(_chat_ids(tokenizer, messages[: k + 1]))
            assert labels[start:end] == ids[start:end] and labels[start - 1] == IGNORE_INDEX
    assert sum(x != IGNORE_INDEX for _, lab in records for x in lab) == sum(
        len(_chat_ids(tokenizer, m[: k + 1])) - len(_chat_ids(tokenizer, m[:k], add_generation_prompt=True))
        for m in (record_messages(r, "x") for r in talks)
        for k in data._scored(m, "assistant")
    )


def test_a_chat_template_that_refuses_a_conversation_is_one_line(tmp_path, tokenizer):
    """Llama-2's and Mistral's templates raise for roles that do not alternate: that was jinja2's traceback."""
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = (
        "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{{ m.content }}{% endfor %}"
    )
    good = json.dumps(_conversation("a", "b"))
    bad = json.dumps(
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "user", "content": "b"},
                {"role": "assistant", "content": "c"},
            ]
        }
    )
    src = _write_jsonl(tmp_path / "d.jsonl", [good, bad])
    message = r"d.jsonl:2: the model's chat template refuses this conversation \(Conversation roles must alternate"
    with pytest.raises(UserError, match=message):
        load_dataset(DataConfig(source=src, seq_len=64, packing=False), strict)


def test_tokenized_records_are_kept_between_runs_and_named_by_all_they_depend_on(
    tmp_path, tokenizer, monkeypatch, capsys
):
    """Every start tokenized its chat records again (shakespeare-chat: 9 s of each start on 2 CPUs). They are kept
    in the data cache, named by the file's bytes, the tokenizer and its template, ``data.loss_on`` and
    ``data.max_documents``: a change to any of them tokenizes again; a damaged entry is said, dropped and rebuilt."""
    from memfit.train import data

    cache = tmp_path / "cache"
    monkeypatch.setenv("MEMFIT_DATA_CACHE", str(cache))
    talks = [_conversation(f"Q{i}?", f"A{i}.", "More?", "No." * i) for i in range(6)]
    src = Path(_write_jsonl(tmp_path / "d.jsonl", map(json.dumps, talks)))
    first = data.chat_records([src], tokenizer, None, "assistant")
    assert len(list(cache.glob("*.json.gz"))) == 1
    calls = []
    monkeypatch.setattr(data, "_tokenized", lambda tok, texts: calls.append(len(texts)) or [])
    assert data.chat_records([src], tokenizer, None, "assistant") == first and not calls  # from the cache
    other = copy.deepcopy(tokenizer)
    other.chat_template = tokenizer.chat_template.replace("<|im_start|>", "<|im_start|> ")
    for changed in (
        ([src], tokenizer, None, "last"),
        ([src], tokenizer, 5, "assistant"),
        ([src], other, None, "assistant"),
    ):
        with pytest.raises(StopIteration):  # tokenized again (here by the stand-in, which gives no ids)
            data.chat_records(*changed)
    src.write_text(src.read_text() + json.dumps(_conversation("Q?", "A.")) + "\n")
    with pytest.raises(StopIteration):
        data.chat_records([src], tokenizer, None, "assistant")
    assert len(calls) == 4
    monkeypatch.undo()
    monkeypatch.setenv("MEMFIT_DATA_CACHE", str(cache))
    (entry,) = cache.glob("*.json.gz")
    entry.write_bytes(gzip.compress(json.dumps({"lengths": "AAAA", "ids": "", "scored": ""}).encode()))
    src.write_text("\n".join(map(json.dumps, talks)) + "\n")
    capsys.readouterr()
    assert data.chat_records([src], tokenizer, None, "assistant") == first and entry.is_file()  # rebuilt
    assert f"tokenized data cache entry {entry} is damaged (ValueError); ignored and rebuilt" in capsys.readouterr().err
    monkeypatch.setenv("MEMFIT_DATA_CACHE", "off")
    shutil.rmtree(cache)
    assert data.chat_records([src], tokenizer, None, "assistant") == first and not cache.exists()


def test_a_text_sources_tokens_are_kept_and_named_by_its_files(tmp_path, tokenizer, monkeypatch):
    """The default job tokenized its 42 plays at every start (5.3 s on 2 CPUs): the stream is kept, named by the
    files' bytes and the tokenizer; rows of any data.seq_len are cut from it; an edited file tokenizes again."""
    monkeypatch.setenv("MEMFIT_DATA_CACHE", str(tmp_path / "cache"))
    (tmp_path / "plays").mkdir()
    for name, line in (("a.txt", "To be, or not to be. "), ("b.txt", "All the world's a stage. ")):
        (tmp_path / "plays" / name).write_text(line * 60)
    cfg = DataConfig(source=str(tmp_path / "plays"), seq_len=16)
    want = {n: load_dataset(replace(cfg, seq_len=n), tokenizer) for n in (16, 24)}
    calls = []
    real = tokenizer.__class__.__call__
    monkeypatch.setattr(tokenizer.__class__, "__call__", lambda *a, **k: calls.append(1) or real(*a, **k))
    for n, ds in want.items():
        assert torch.equal(load_dataset(replace(cfg, seq_len=n), tokenizer).tokens, ds.tokens)
    assert not calls and len(list((tmp_path / "cache").glob("*.json.gz"))) == 1
    (tmp_path / "plays" / "b.txt").write_text("Now is the winter. " * 60)
    edited = load_dataset(cfg, tokenizer)
    assert len(calls) == 2 and not torch.equal(edited.tokens[-1], want[16].tokens[-1])


def test_a_directory_of_record_shards_is_its_records_in_order(tmp_path, tokenizer):
    """A dataset saved in shards (``train-00000-of-00002.jsonl``, ...) was a directory "holding no .txt files", and
    with ``data.format=chat`` "does not exist": it is the records of its .jsonl / .json files (compressed or not),
    in name order, as one file of them all."""
    lines = [json.dumps({"prompt": f"Name play {i}.", "response": "Macbeth." * (i % 3 + 1)}) for i in range(9)]
    whole = _write_jsonl(tmp_path / "whole.jsonl", lines)
    shards = tmp_path / "shards"
    shards.mkdir()
    _write_jsonl(shards / "train-00000-of-00003.jsonl", lines[:4])
    (shards / "train-00001-of-00003.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines[4:7]) + "\n").encode()))
    (shards / "train-00002-of-00003.json").write_text(json.dumps([json.loads(x) for x in lines[7:]]))
    (shards / "README.md").write_text("# not data")
    (shards / "dataset_infos.json").write_text(json.dumps({"default": {"features": {}}}, indent=2))  # the Hub's
    want = load_dataset(DataConfig(source=whole, seq_len=64), tokenizer)
    for fmt in ("auto", "chat"):
        cfg = DataConfig(source=str(shards), seq_len=64, format=fmt)
        assert cfg.is_chat() and cfg.packs()
        got = load_dataset(cfg, tokenizer)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.labels, want.labels)
    assert len(load_dataset(DataConfig(source=str(shards), seq_len=64, max_documents=5), tokenizer).tokens) < len(
        want.tokens
    )
    (shards / "notes.txt").write_text("some prose " * 200)  # .txt beside them: text, as before, unless format=chat
    assert not DataConfig(source=str(shards)).is_chat() and DataConfig(source=str(shards), format="chat").is_chat()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(
        UserError, match=r"directory '.*empty' holds no .jsonl, .json or .parquet files of records \(it is empty"
    ):
        load_dataset(DataConfig(source=str(empty), format="chat"), tokenizer)
    (empty / "data").mkdir()  # a dataset repository as the Hub keeps it: Parquet under data/
    (empty / "README.md").write_text("# card")
    with pytest.raises(UserError, match=r"holds no .txt files \(compressed or not\) \(it holds: README.md, data/\)"):
        load_dataset(DataConfig(source=str(empty)), tokenizer)


def test_a_datasets_arrow_directory_is_named_with_the_call_that_writes_its_records(tmp_path, tokenizer):
    """``Dataset.save_to_disk`` leaves .arrow files beside ``dataset_info.json`` and ``state.json``: those two were
    read as records ("holds one JSON object across its lines")."""
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "data-00000-of-00001.arrow").write_bytes(b"\xff\xff\xff\xff" + bytes(60))
    (saved / "dataset_info.json").write_text(json.dumps({"features": {}}, indent=2))
    (saved / "state.json").write_text(json.dumps({"_data_files": []}, indent=2))
    splits = tmp_path / "splits"  # a DatasetDict: dataset_dict.json and a directory per split
    (splits / "train").mkdir(parents=True)
    (splits / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    cases = (
        (saved, f"datasets.load_from_disk('{saved}').to_json('records.jsonl')"),
        (saved / "data-00000-of-00001.arrow", "datasets.Dataset.from_file("),
        (splits, f"datasets.load_from_disk('{splits}')['train'].to_json('records.jsonl')"),
    )
    for source, call in cases:
        with pytest.raises(UserError, match="is an Arrow dataset") as e:
            load_dataset(DataConfig(source=str(source), seq_len=32), tokenizer)
        assert call in str(e.value)


def test_parquet_records_are_the_rows_of_their_json_lines(tmp_path, tokenizer):
    """Datasets on the Hub are Parquet files: a ``.parquet`` file, or a directory of them, is its rows as records
    (the same rows as the JSON lines of the same records); a damaged one is one line."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    records = [{"messages": _conversation(f"Q{i}?", "A." * (i + 1))["messages"]} for i in range(6)]
    records += [{"instruction": f"Name {i}.", "input": "", "output": "x " * i} for i in range(1, 4)]
    jsonl = _write_jsonl(tmp_path / "d.jsonl", map(json.dumps, records))
    want = load_dataset(DataConfig(source=jsonl, seq_len=64), tokenizer)
    (tmp_path / "shards").mkdir()
    pq.write_table(pa.Table.from_pylist(records[:6]), tmp_path / "shards" / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(records[6:]), tmp_path / "shards" / "train-00001-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(records[:6]), tmp_path / "six.parquet")
    got = load_dataset(DataConfig(source=str(tmp_path / "shards"), seq_len=64), tokenizer)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.labels, want.labels)
    six = load_dataset(DataConfig(source=str(tmp_path / "six.parquet"), seq_len=64, packing=False), tokenizer)
    first = load_dataset(DataConfig(source=jsonl, seq_len=64, packing=False, max_documents=6), tokenizer)
    assert torch.equal(six.tokens, first.tokens) and torch.equal(six.labels, first.labels)
    (tmp_path / "bad.parquet").write_bytes(b"PAR1" + bytes(40))
    with pytest.raises(UserError, match=r"data.source: '.*bad.parquet' is not a readable Parquet file \("):
        load_dataset(DataConfig(source=str(tmp_path / "bad.parquet"), seq_len=64), tokenizer)


@pytest.mark.parametrize("indent", [None, 2], ids=["minified", "indented"])
def test_a_json_array_is_read_a_value_at_a_time_as_the_whole_text_decodes(tmp_path, monkeypatch, indent):
    """A JSON array file was read whole and decoded whole (a 1.9 GB array of a million conversations: the text and
    every record as Python objects at once). It is now decoded a value at a time as its text is read, in pieces of
    7 bytes here: values, characters of 2 to 4 bytes and numbers cut between pieces are the whole text's, and the
    first text that is not JSON is said at the line and column ``json.loads`` gives."""
    from memfit.train import records as rec

    monkeypatch.setattr(rec, "JSON_PIECE", 7)
    values = [
        {"prompt": f"é{i} 😀 ü", "response": "x" * i, "n": 1234567890123 + i, "f": [1.5e-7, None, True]}
        for i in range(3)
    ]
    values += [{"a": {"b": ["ü" * 9]}}, 98765432109876543210]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(values, indent=indent, ensure_ascii=False), encoding="utf-8")
    got = list(rec.file_records(path))
    assert [v for _, v in got] == values and [w for w, _ in got][-1] == f"{path}: record 5"
    path.write_text("[ ]\n")
    assert list(rec.file_records(path)) == []
    text = json.dumps(values, indent=indent, ensure_ascii=False)
    for bad in (text.replace('"n"', '"n" 5', 2), text.replace("}, ", "} ", 1).replace("},\n", "}\n", 1), text + " 4"):
        path.write_text(bad, encoding="utf-8")
        with pytest.raises(json.JSONDecodeError) as want:
            json.loads(bad)
        e = want.value
        with pytest.raises(UserError) as said:
            list(rec.file_records(path))
        assert str(said.value) == f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})"


def test_parquet_rows_are_read_a_batch_at_a_time_as_the_whole_table_reads(tmp_path, monkeypatch):
    """A Parquet file was read whole and made Python records whole (``read_table(...).to_pylist()``): a Hub dataset
    of a few hundred thousand conversations held them all as Python objects before the first was tokenized. Its
    rows are now read a batch at a time, across row groups, and are the whole table's rows, in order."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    from memfit.train import records as rec

    monkeypatch.setattr(rec, "PARQUET_BATCH", 4)
    rows = [{"prompt": f"q{i}", "response": "a" * i, "n": i} for i in range(13)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=5)
    assert pq.ParquetFile(path).metadata.num_row_groups == 3
    got = list(rec.file_records(path))
    assert [r for _, r in got] == pq.read_table(path).to_pylist() == rows
    assert [w for w, _ in got] == [f"{path}: row {i}" for i in range(1, 14)]


def test_parquet_without_pyarrow_names_the_extra(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # what an install without the data extra sees
    (tmp_path / "d.parquet").write_bytes(b"PAR1" + bytes(40))
    with pytest.raises(UserError, match=r"is Parquet, which needs pyarrow: pip install 'memfit\[data\]'"):
        load_dataset(DataConfig(source=str(tmp_path / "d.parquet"), seq_len=64), tokenizer)


def test_the_plays_stay_the_plays_beside_a_directory_of_their_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shakespeare").mkdir()
    _write_jsonl(tmp_path / "shakespeare" / "d.jsonl", [json.dumps({"prompt": "a", "response": "b"})])
    assert not DataConfig(source="shakespeare").is_chat()  # read as the package's plays, as text_files reads it
    assert DataConfig(source="./shakespeare").is_chat()


def test_a_data_directory_that_cannot_be_listed_is_one_line(tmp_path, tokenizer, monkeypatch):
    """(Tests run as root, where a mode cannot refuse: the refusal is made by hand.) It was a PermissionError
    traceback from the config check."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real = Path.iterdir

    def refuse(self):
        if self == locked:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "iterdir", refuse)
    with pytest.raises(UserError, match=rf"data.source: cannot list the directory '{locked}' \(Permission denied\)"):
        load_dataset(DataConfig(source=str(locked), seq_len=32), tokenizer)


def test_text_records_are_documents_trained_on_whole_without_a_template(tmp_path, tokenizer):
    """``{"text": ...}`` records (a text dataset written as JSON lines, as for continued pre-training) were refused
    as lacking 'messages'. Each is its tokens and EOS, every one scored, with no chat template, so a base model's
    tokenizer without one trains on them; beside chat records in one file each keeps its own reading."""
    from memfit.train import data

    docs = [f"Document {i}: " + "words " * (3 + i) for i in range(6)]
    talk = _conversation("Q?", "A.")
    src = Path(_write_jsonl(tmp_path / "d.jsonl", [json.dumps({"text": d}) for d in docs] + [json.dumps(talk)]))
    records = data.chat_records([src], tokenizer, None)
    for (ids, labels), doc in zip(records, docs):
        want = tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert ids == labels == want
    ids, labels = records[len(docs)]
    assert ids == _chat_ids(tokenizer, talk["messages"]) and IGNORE_INDEX in labels  # the prompt takes no loss
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    texts = Path(_write_jsonl(tmp_path / "t.jsonl", [json.dumps({"text": d}) for d in docs]))
    assert data.chat_records([texts], plain, None) == data.chat_records([texts], tokenizer, None)
    with pytest.raises(UserError, match=r"d.jsonl:7: a chat record, but the model's tokenizer has no chat template"):
        data.chat_records([src], plain, None)
    with pytest.raises(UserError, match=r"t.jsonl:1: need 'messages'.* or a string 'text' \(keys: text\)"):
        data.chat_records([Path(_write_jsonl(tmp_path / "t.jsonl", ['{"text": 5}', '{"text": 6}']))], tokenizer, None)


def test_tool_calls_are_trained_where_the_template_renders_them_and_refused_where_it_drops_them(tmp_path, tokenizer):
    """An assistant turn that calls a tool (OpenAI's ``tool_calls``, content null) was refused for its null content;
    with content "" and a template that renders content only (SmolLM2's) it trained the call as an empty answer."""
    from memfit.train import data

    call = {"type": "function", "function": {"name": "add_numbers", "arguments": {"a": 2, "b": 3}}}
    talk = {
        "messages": [
            {"role": "user", "content": "2+3?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "5"},
            {"role": "assistant", "content": "5."},
        ]
    }
    src = Path(_write_jsonl(tmp_path / "t.jsonl", [json.dumps(talk)] * 3))
    with pytest.raises(UserError, match=r"t.jsonl:1: message 2 calls add_numbers, but the model's chat template"):
        data.chat_records([src], tokenizer, None)
    named = copy.deepcopy(talk)  # the function's name in the text: the check looked for the name anywhere
    named["messages"][0]["content"] = "Use add_numbers: 2+3?"
    src_named = Path(_write_jsonl(tmp_path / "n.jsonl", [json.dumps(named)] * 3))
    with pytest.raises(UserError, match=r"n.jsonl:1: message 2 calls add_numbers, but the model's chat template"):
        data.chat_records([src_named], tokenizer, None)
    renders_calls = copy.deepcopy(tokenizer)
    renders_calls.chat_template = tokenizer.chat_template.replace(
        "message['content'] + '<|im_end|>'",
        "message['content'] + (message['tool_calls'] | map(attribute='function') | map(attribute='name') | join(',')"
        " if message.get('tool_calls') else '') + '<|im_end|>'",
    )
    assert renders_calls.chat_template != tokenizer.chat_template
    ids, labels = data.chat_records([src], renders_calls, None)[0]
    scored = renders_calls.decode([i for i, lab in zip(ids, labels) if lab != IGNORE_INDEX])
    assert "add_numbers" in scored and "5." in scored  # the call is an answer the loss is taken on
    assert len(data.chat_records([src_named], renders_calls, None)) == 3


@pytest.mark.parametrize("packing", ["plain", "gzip", "bz2", "xz"])
def test_json_lines_are_read_a_line_at_a_time_as_the_whole_file_reads(tmp_path, tokenizer, monkeypatch, packing):
    """A JSON lines file was read whole, then decoded whole: twice its size held before the first record (a 104 MB
    file, 0.2 GiB). Its lines are now read one at a time, decompressed as they come, and give what the whole file
    gives: the same lines, byte order mark and CRLF alike, the same offset and line for a bad byte."""
    from memfit.config import loader
    from memfit.train import records

    compress = {"plain": lambda b: b, "gzip": lambda b: gzip.compress(b, mtime=0), "bz2": bz2.compress}
    compress["xz"] = lzma.compress
    rows = (json.dumps({"prompt": f"é{i}", "response": "ü" * i}, ensure_ascii=False) for i in range(40))
    text = "\ufeff" + "\r\n".join(rows) + "\n\n"
    path = tmp_path / "d.jsonl"
    path.write_bytes(compress[packing](text.encode()))
    whole = loader.read_utf8(path, "data.source", "fix", compressed=True)
    assert list(loader.utf8_lines(path, "data.source", "fix", compressed=True)) == whole.split("\n")[:-1]
    want = [(f"{path}:{i}", json.loads(line)) for i, line in enumerate(whole.split("\n"), 1) if line.strip()]
    monkeypatch.setattr(records, "read_utf8", lambda *a, **k: pytest.fail("read whole"))
    assert list(records.file_records(path)) == want and len(want) == 40
    bad = text.encode().replace(b"\xc3\xa97", b"\xe97")  # line 8: Latin-1's é
    path.write_bytes(compress[packing](bad))
    with pytest.raises(UserError, match=r"not UTF-8 text \(byte 0xe9 at offset \d+, line 8\)") as streamed:
        list(records.file_records(path))
    monkeypatch.undo()
    with pytest.raises(UserError) as at_once:
        loader.read_utf8(path, "data.source", records._FIX, compressed=True)
    assert str(streamed.value) == str(at_once.value)


def test_a_compressed_file_cut_short_is_said_to_be_cut_not_its_cut_record(tmp_path):
    """Read a line at a time, a cut file's cut last line is not read (as a record missing its answer, or a character
    cut in two) before the error that says the file is cut, at any point of the cut."""
    from memfit.train import records

    line = json.dumps({"prompt": "a", "response": "é" * 50}, ensure_ascii=False).encode() + b"\n"
    whole = gzip.compress(line * 300, mtime=0)
    src = tmp_path / "d.jsonl.gz"
    for cut in range(len(whole) // 2, len(whole) - 8, max(1, len(whole) // 40)):
        src.write_bytes(whole[:cut])
        with pytest.raises(UserError, match="is gzip-compressed but cannot be decompressed"):
            list(records.file_records(src))


def test_text_is_tokenized_in_pieces_to_the_tokens_of_one_call(tmp_path, tokenizer, monkeypatch):
    """One tokenizer call on a whole text file held its ids, mask and offsets as Python objects (a 50 MB file
    peaked at 7.6 GiB). Pieces cut after a newline where the seam tokenizes alike apart give the one call's tokens;
    a tokenizer that adds a prefix space to each call fails every seam's check and is cut nowhere."""
    from tokenizers import pre_tokenizers

    from memfit.train import data

    text = "".join(f.read_text() for f in shakespeare_files()[:2]) + "  \n\n   trailing  spaces\n\n\n"
    monkeypatch.setattr(data, "TEXT_PIECE", 5_000)
    spaced = copy.deepcopy(tokenizer)
    spaced.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    for tok in (tokenizer, spaced):
        want = tok(text, add_special_tokens=False)["input_ids"]
        cuts = data._cuts(tok, text)
        assert [int(i) for piece in data.text_ids(tok, text) for i in piece] == want
        assert (len(cuts) > 20) == (tok is tokenizer)  # SmolLM2's: cut (about every 5,000 characters); spaced: not
