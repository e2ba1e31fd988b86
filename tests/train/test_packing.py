"""data.packing: several chat records per row, each attending only to itself. The rows hold every record whole
and once, the summed token loss of packed rows equals that of the same records one per row, and the planner's
prediction of a packed step (its block-causal mask, K/V heads repeated) is the profiler's to the byte."""

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from memfit.config.loader import load_config
from memfit.config.schema import DataConfig
from memfit.config.strategy import Strategy
from memfit.errors import UserError
from memfit.models.load import ModelSource, load_tokenizer
from memfit.models.presets import preset_config
from memfit.planner.categories import Category
from memfit.planner.measure import measured_steady_step
from memfit.planner.predict import Predictor
from memfit.planner.trace import StepSpec
from memfit.step.loss import IGNORE_INDEX, token_loss_sum
from memfit.strategies.precision import precision_policy
from memfit.train.data import load_dataset, packed_rows, padded_rows
from memfit.train.token_cache import TokenRecords

PAD = 0


def _records(lengths: list[int], seed: int = 0) -> TokenRecords:
    """Records of these lengths: random ids, the first third of each a prompt (no loss)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(1, 250, (n,), generator=g).tolist()
        prompt = max(1, n // 3)
        out.append((ids, [IGNORE_INDEX] * prompt + ids[prompt:]))
    return TokenRecords.of(out)


def _spans(positions: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of each run of positions counting up from 0 in one row."""
    starts = (positions == 0).nonzero().flatten().tolist() + [len(positions)]
    return [(a, b - a) for a, b in zip(starts, starts[1:])]


LENGTHS = [40, 7, 65, 23, 23, 64, 3, 90, 12, 31, 50, 2]


def test_packed_rows_hold_every_record_whole_once_and_fewer_rows():
    records = _records(LENGTHS)
    ds = packed_rows(records, 65, PAD)
    assert ds.records == len(records) and ds.truncated == 1  # the 90-token record is cut to a row
    padded = padded_rows(records, 65, PAD)
    assert len(ds) < len(padded) == len(records)
    assert ds.supervised_tokens == padded.supervised_tokens - sum(  # a record's first label never counts
        lab[0] != IGNORE_INDEX for _, lab in records
    )
    found = []
    for r in range(len(ds)):
        for start, n in _spans(ds.positions[r]):
            found.append((ds.tokens[r, start : start + n].tolist(), ds.labels[r, start : start + n].tolist()))
            assert ds.labels[r, start] == IGNORE_INDEX
    wanted = [(ids[:65], lab[:65]) for ids, lab in records]
    for ids, lab in wanted:  # each record once, whole, in one row (its first label masked)
        match = [f for f in found if f[0] == ids]
        assert len(match) == 1 and match[0][1][1:] == lab[1:]
    pads = [f for f in found if f[0] not in [w[0] for w in wanted]]
    assert all(set(ids) == {PAD} and set(lab) == {IGNORE_INDEX} for ids, lab in pads)  # only the tails


def test_the_summed_loss_of_packed_rows_is_that_of_the_records_one_per_row():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny"), dtype=torch.float32).eval()
    records = _records([40, 7, 60, 23, 23, 64, 3, 12, 31, 50, 2, 17])
    packed, padded = packed_rows(records, 65, PAD), padded_rows(records, 65, PAD)
    assert len(packed) < len(padded)
    fp32 = precision_policy("fp32")
    with torch.no_grad():
        (tokens, labels, positions), (one, its) = packed[:], padded[:]
        a = token_loss_sum(model, tokens, labels, fp32, "cpu", positions=positions)
        b = token_loss_sum(model, one, its, fp32, "cpu")
        crossed = token_loss_sum(model, tokens, labels, fp32, "cpu")  # records see each other
    assert torch.allclose(a, b, rtol=1e-5, atol=0), (float(a), float(b))
    assert not torch.allclose(crossed, b, rtol=1e-5, atol=0)  # the same rows without positions: cross-talk


@pytest.fixture(scope="module")
def tokenizer(embedded_dir):
    return load_tokenizer(ModelSource("hf", path=embedded_dir))


def _chat(tmp_path, n: int) -> str:
    lines = [json.dumps({"prompt": f"Question {i}?", "response": "Yes. " * (1 + i % 5)}) for i in range(n)]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_chat_data_packs_by_default_and_says_so(tmp_path, tokenizer):
    src = _chat(tmp_path, 30)
    packed = load_dataset(DataConfig(source=src, seq_len=128), tokenizer)
    padded = load_dataset(DataConfig(source=src, seq_len=128, packing=False), tokenizer)
    assert packed.positions is not None and padded.positions is None
    assert len(padded) == 30 and len(packed) <= 15
    assert packed.notes() and "packed 30 records into" in packed.notes()[0] and not padded.notes()
    cut = load_dataset(DataConfig(source=src, seq_len=16), tokenizer)
    assert cut.truncated > 0 and any("cut to that length" in n for n in cut.notes())


@pytest.mark.parametrize("rows", [packed_rows, padded_rows])
def test_rows_are_laid_out_alike_whatever_pass_size_places_them(rows, monkeypatch):
    """Records are placed into rows ``ROWS_CHUNK`` tokens per pass (bounding the index arrays): passes of a few
    tokens, a record split over none, give the rows one pass gives."""
    from memfit.train import data

    records = _records(LENGTHS * 3, seed=1)
    whole = rows(records, 65, PAD)
    monkeypatch.setattr(data, "ROWS_CHUNK", 50)  # most passes one record, some two or three
    small = rows(records, 65, PAD)
    for a, b in zip(whole[:], small[:]):
        assert a.dtype == torch.long and torch.equal(a, b)
    assert whole.tokens.dtype == whole.labels.dtype == torch.int32  # kept at half the bytes


def test_chat_records_are_held_flat_and_read_a_batch_at_a_time(tmp_path, tokenizer, monkeypatch):
    """A chat source is read, rendered and tokenized ``TOKENIZE_BATCH`` records at a time into flat int32 ids (a
    104 MB JSON lines file peaked at 4.4 GiB of RSS as Python lists, 1.2 GiB so); ``data.max_documents`` reached,
    the files after are not read."""
    from memfit.train import data

    src = _chat(tmp_path, 30)
    one = data.chat_records([tmp_path / "d.jsonl"], tokenizer, None)
    monkeypatch.setattr(data, "TOKENIZE_BATCH", 4)
    assert data.chat_records([tmp_path / "d.jsonl"], tokenizer, None) == one and len(one) == 30
    assert one.ids.dtype == np.int32 and one.scored.dtype == bool and len(one.ids) == one.starts[-1]
    (tmp_path / "junk.jsonl").write_bytes(b"\xff\xfe not this")  # reading it would be one line of error
    assert data.chat_records([Path(src), tmp_path / "junk.jsonl"], tokenizer, 30) == one


@pytest.mark.parametrize("rows", [packed_rows, padded_rows])
def test_records_cut_to_no_answer_are_said_and_rows_with_no_loss_at_all_are_refused(rows):
    """A record whose prompt fills the row keeps none of its answer: the note counts them; rows where no token
    takes a loss would train on a loss of 0 (the run did, and exited 0), so they are one line."""
    some = rows(_records([90, 12, 90, 12]), 21, PAD)  # 30-token prompts, rows of 21
    assert (some.truncated, some.answerless) == (2, 2)
    assert any("2 of them keep none of their answer" in n for n in some.notes())
    some.check_supervised(some)
    none = rows(_records([90] * 4), 21, PAD)
    with pytest.raises(UserError, match=r"takes a loss: every answer lies past data.seq_len \+ 1 = 21"):
        none.check_supervised(none)


def test_packing_refuses_text_data_and_too_few_rows(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text("word " * 100)
    with pytest.raises(UserError, match="data.packing packs chat/instruction records"):
        load_config(None, [f"data.source={tmp_path / 'a.txt'}", "data.packing=true"])
    with pytest.raises(UserError, match="pack into 1 row.*data.packing=false"):
        load_dataset(DataConfig(source=_chat(tmp_path, 3), seq_len=256), tokenizer)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_the_planner_predicts_a_packed_step_as_the_profiler_measures_it(precision):
    cfg = copy.deepcopy(preset_config("tiny"))
    cfg.num_hidden_layers = 6
    strategy = Strategy(precision=precision, optimizer="foreach", micro_batch_size=2, packing=True)
    predicted = Predictor(StepSpec(cfg, 256)).predict(strategy).peak
    measured = measured_steady_step(StepSpec(cfg, 256, strategy))
    assert predicted.as_dict() == measured.as_dict()
    plain = measured_steady_step(StepSpec(cfg, 256, strategy.replace(packing=False)))
    # the mask (B, 1, T, T) and, per layer, K/V repeated to every query head (the tiny preset: 2 K/V heads of 4)
    assert measured[Category.ACTIVATIONS] - plain[Category.ACTIVATIONS] >= 2 * 256 * 256


def test_plan_pins_packing_from_a_chat_config_and_predicts_its_mask(tmp_path, capsys):
    from memfit.cli import main

    cfg = tmp_path / "chat.yaml"
    cfg.write_text("model:\n  source: random:tiny\ndata:\n  source: d.jsonl\n  seq_len: 256\n")
    args = ["plan", "--config", str(cfg), "--gpu", "mi210", "--precision", "fp32", "--ac", "none", "--json"]
    assert main(args) == 0
    packed = json.loads(capsys.readouterr().out)["fitting"][0]
    assert main([*args, "--packing", "false"]) == 0
    plain = json.loads(capsys.readouterr().out)["fitting"][0]
    assert packed["packing"] is True and plain["packing"] is False
    assert packed["peak_bytes"] > plain["peak_bytes"]
