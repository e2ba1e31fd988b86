import json

import pytest
import torch

from memfit.config.schema import DataConfig
from memfit.errors import UserError
from memfit.models.load import ModelSource, load_tokenizer
from memfit.step.loss import IGNORE_INDEX
from memfit.train.data import EpochBatchSampler, load_dataset, shakespeare_files, split


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
        ('{"messages": [{"role": "user", "content": "hi"}]}', "last message must have role 'assistant'"),
        ('{"text": "hi"}', "need 'messages', string 'prompt' and 'response', or string 'instruction' and 'output'"),
        (
            '{"messages": [{"role": "user", "content": [{"type": "image_url"}]}, '
            '{"role": "assistant", "content": "a"}]}',
            "a 'content' of text",
        ),
        ("[1, 2]", "a record must be a JSON object"),
    ],
)
def test_bad_record_names_file_and_line(tmp_path, tokenizer, line, reason):
    good = json.dumps({"prompt": "a", "response": "b"})
    src = _write_jsonl(tmp_path / "bad.jsonl", [good, good, line])
    with pytest.raises(UserError, match=rf"bad.jsonl:3: .*{reason}"):
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
