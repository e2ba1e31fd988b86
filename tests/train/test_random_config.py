"""model.source=random:<config.json>: any Llama-family architecture with random weights, for training and planning
(issue 21), the tokenizer's ids folded into a smaller vocabulary."""

import json

import pytest

from memfit.errors import UserError
from memfit.models.load import resolve_source
from memfit.models.planning import config_for_planning
from memfit.models.presets import preset_config
from memfit.train.loop import Trainer


@pytest.fixture
def small_config(tmp_path):
    cfg = preset_config("tiny").to_dict()
    cfg["vocab_size"], cfg["num_hidden_layers"] = 1000, 3
    path = tmp_path / "arch" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("as_dir", [False, True])
def test_a_run_trains_random_weights_of_any_config_with_the_tokenizer_folded(tiny_cfg, small_config, as_dir):
    where = small_config.parent if as_dir else small_config
    trainer = Trainer(tiny_cfg(f"model.source=random:{where}", "train.max_steps=2", "train.eval_every=0"))
    try:
        result = trainer.fit()
    finally:
        trainer.close()
    assert trainer.mconf.vocab_size == 1000 and trainer.mconf.num_hidden_layers == 3
    assert any("folded" in note and "1000 embeddings" in note for note in trainer.notes)
    assert len(result.steps) == 2


def test_planning_a_config_json_is_planning_that_architecture(small_config):
    planned = config_for_planning(f"random:{small_config}")
    assert (planned.vocab_size, planned.num_hidden_layers) == (1000, 3)
    assert config_for_planning(str(small_config)) == planned


@pytest.mark.parametrize(
    "text, needle",
    [
        ("{not json", "is not a usable model config"),
        ('{"model_type": "no-such-arch"}', "is not a usable model config"),
        ("[" * 100_000, r"is not a usable model config \(nested too deeply to read\)"),  # was a RecursionError
    ],
)
def test_a_bad_config_is_one_line(tmp_path, text, needle):
    bad = tmp_path / "config.json"
    bad.write_text(text)
    with pytest.raises(UserError, match=needle) as e:
        resolve_source(f"random:{bad}")
    assert "\n" not in str(e.value)


def test_an_unknown_name_still_names_the_closest_preset():
    with pytest.raises(UserError, match="llama2-7b"):
        resolve_source("random:llama2-7bb")


def test_a_config_path_that_is_not_there_is_named_as_a_path_not_as_an_unknown_preset(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    for given, needle in [
        (tmp_path / "none.json", "does not exist"),
        (tmp_path, "is a directory without a config.json"),
        (tmp_path / "notes.txt", "is not a .json file"),
    ]:
        with pytest.raises(UserError, match=f"'{given}' {needle}; give random:<preset> or random:<path to"):
            resolve_source(f"random:{given}")


def test_a_gguf_model_is_named_with_the_conversion(tmp_path):
    """A GGUF file (or a directory of one without config.json) was "not a directory" or "has no config.json"; it is
    named as llama.cpp's format, with the transformers call that converts it (train and plan alike)."""
    (tmp_path / "llama.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    for given in (tmp_path / "llama.gguf", tmp_path):
        with pytest.raises(UserError, match=r"is a GGUF model \(llama.cpp's format\).*gguf_file='llama.gguf'"):
            resolve_source(str(given))
        with pytest.raises(UserError, match="is a GGUF model"):
            config_for_planning(str(given))


def test_a_hub_name_is_named_as_one_with_the_command_that_fetches_it(tmp_path, monkeypatch):
    """``meta-llama/Llama-2-7b-hf`` or ``tatsu-lab/alpaca`` were "not a directory" / "does not exist": memfit never
    downloads, so the line says what the name looks like and the command that brings it here."""
    from memfit.config.schema import DataConfig
    from memfit.train.data import source_files

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"\(a Hugging Face Hub name\? .*hf download meta-llama/Llama-2-7b-hf --local"):
        resolve_source("meta-llama/Llama-2-7b-hf")
    with pytest.raises(UserError, match=r"hf download Qwen/Qwen2.5-7B config.json --local-dir DIR saves it here"):
        config_for_planning("Qwen/Qwen2.5-7B")
    for source in ("tatsu-lab/alpaca", "tatsu-lab/alpaca.jsonl"):
        with pytest.raises(UserError) as e:
            source_files(DataConfig(source=source))
        hint = "datasets.load_dataset('tatsu-lab/alpaca', split='train').to_json('records.jsonl')"
        assert (hint in str(e.value)) == (source == "tatsu-lab/alpaca")  # a file name is a missing file
    (tmp_path / "tatsu-lab").mkdir()
    with pytest.raises(UserError) as e:
        source_files(DataConfig(source="tatsu-lab/alpaca"))
    assert "Hub" not in str(e.value)  # a path here is a path
