import dataclasses
import pathlib

import pytest

from memfit.config.loader import dump_config, load_config, parse_override
from memfit.config.schema import RunConfig
from memfit.config.shipped import shipped_configs
from memfit.config.strategy import CheckpointPolicy
from memfit.errors import UserError


@pytest.mark.parametrize("name", sorted(shipped_configs()))
def test_every_shipped_config_loads_and_validates(name):
    cfg = load_config(shipped_configs()[name])
    assert isinstance(cfg, RunConfig)
    assert cfg.output.dir.endswith(name), "each shipped config writes to its own run directory"


def test_required_configs_are_shipped():
    for name in (
        "smollm2-shakespeare-lora-cpu",
        "smollm2-shakespeare-full-cpu",
        "llama2-7b-lora-mi210",
        "llama2-7b-full-zero2",
    ):
        assert name in shipped_configs()


def test_yaml_round_trip(tmp_path):
    cfg = load_config(shipped_configs()["llama2-7b-lora-mi210"])
    p = tmp_path / "c.yaml"
    p.write_text(dump_config(cfg))
    assert dataclasses.asdict(load_config(p)) == dataclasses.asdict(cfg)


def test_override_types_and_lists():
    cfg = load_config(
        None, ["train.max_steps=7", "optimizer.lr=1e-4", "lora.enabled=true", "lora.target_modules=q_proj,v_proj"]
    )
    assert cfg.train.max_steps == 7 and cfg.optimizer.lr == 1e-4 and cfg.lora.enabled is True
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]


def test_unknown_key_gets_did_you_mean():
    with pytest.raises(UserError, match=r"unknown key 'train.max_step'.*did you mean 'max_steps'"):
        load_config(None, ["train.max_step=3"])


def test_unknown_section_gets_did_you_mean(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("trian:\n  max_steps: 3\n")
    with pytest.raises(UserError, match=r"unknown section 'trian'.*did you mean 'train'"):
        load_config(p)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.micro_batch_size=0", r"train.micro_batch_size must be > 0 \(got 0\)"),
        ("train.seed=99999999999999999999999", r"train.seed must be in 0..4294967295 \(got 9+\)"),
        ("output.dir=", r"output.dir is empty; give a value"),
        ("train.eval_batches=-1", r"train.eval_batches must be >= 0 \(got -1\)"),
        ("train.micro_batch_size=four", r"train.micro_batch_size must be an integer \(got 'four'\)"),
        ("strategy.precision=bf17-mixed", r"strategy.precision must be one of .* \(did you mean 'bf16-mixed'\?\)"),
        ("strategy.activation_checkpointing=every_k:0", r"every_k:N with N >= 1"),
        ("data.eval_fraction=0.7", r"data.eval_fraction must be in \(0, 0.5\)"),
        ("allocator.memory_fraction=1.5", r"allocator.memory_fraction must be in \(0, 1\]"),
        ("train.device=tpu", r"train.device must be"),
        ("lora.enabled=maybe", r"lora.enabled must be true or false"),
        ("data.packing=auto", r"data.packing must be true, false or null \(got 'auto'\)"),  # null: its default
        ("train.threads=1.5", r"train.threads must be an integer or null \(got 1.5\)"),
        ("train.profile_step=0", r"train.profile_step must be a step >= 1 or null \(got 0\)"),  # was: never profiled
        ("train.snapshot_at_step=-2", r"train.snapshot_at_step must be a step >= 1 or null \(got -2\)"),
        ("train.metrics_host=", r"train.metrics_host is empty: give an address"),  # was: "train.metrics_host :"
        ("strategy.loss_chunks=100000", r"loss_chunks 100000 is more than data.seq_len 256 positions"),  # was: taken
        ("optimizer.eps=0", r"optimizer.eps must be > 0: it keeps AdamW's update finite .* \(got 0.0\)"),  # was: NaN
        ("lora.alpha=-2", r"lora.alpha must be > 0: the adapters' scale is alpha / rank \(got -2.0\)"),  # was: taken
    ],
)
def test_bad_values_name_the_field(override, message):
    with pytest.raises(UserError, match=message):
        load_config(None, [override])


def test_bad_override_shape():
    with pytest.raises(UserError, match="section.key=value"):
        parse_override("max_steps")


def test_bad_yaml_names_file_and_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  max_steps: [1,\n")
    with pytest.raises(UserError, match=r"c.yaml:\d+: not valid YAML"):
        load_config(p)


def test_a_config_nested_past_the_parsers_recursion_is_one_line(tmp_path):
    """Fifty thousand brackets (a hostile or broken file) were a ``RecursionError`` traceback from the YAML parser;
    as an override's value they are the text they are, which the key's type then refuses."""
    p = tmp_path / "deep.yaml"
    p.write_text("model:\n  source: " + "[" * 50_000 + "\n")
    with pytest.raises(UserError, match=r"deep.yaml: not valid YAML \(nested too deeply to read\)"):
        load_config(p)
    with pytest.raises(UserError, match="train.max_steps"):
        load_config(None, ["train.max_steps=" + "[" * 50_000])


def test_ac_policy_is_parsed_once_at_config_load_into_a_typed_value():
    assert CheckpointPolicy.parse("none") == CheckpointPolicy("none", 1)
    assert CheckpointPolicy.parse("ffn") == CheckpointPolicy("ffn", 1)
    assert CheckpointPolicy.parse("every_k:3") == CheckpointPolicy("every_k", 3)
    assert str(CheckpointPolicy.parse("every_k:3")) == "every_k:3"
    for bad in ("some", "every_k:0", "every_k"):
        with pytest.raises(UserError, match="strategy.activation_checkpointing must be"):
            CheckpointPolicy.parse(bad)
    cfg = load_config(None, ["strategy.activation_checkpointing=every_k:2"])
    assert cfg.strategy.activation_checkpointing == CheckpointPolicy("every_k", 2)
    assert "activation_checkpointing: every_k:2" in dump_config(cfg)


def test_a_key_given_twice_is_refused_with_its_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  max_steps: 5\n  micro_batch_size: 2\n  max_steps: 50\n")
    with pytest.raises(UserError, match=rf"{path}:4: key 'max_steps' is given twice"):
        load_config(path)


def test_a_config_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"train:\n  max_steps: \xff\xfe\n")
    with pytest.raises(UserError, match="not UTF-8 text"):
        load_config(path)


def test_a_huge_echoed_value_is_cut_in_the_printed_line(tmp_path, capsys):
    """A YAML alias bomb expands to a value whose repr is hundreds of MB; the error line stays short."""
    from memfit.cli import main

    levels = ["&a [" + ",".join(["x"] * 9) + "]"]
    for name, prev in zip("bcdef", "abcde"):
        levels.append(f"&{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    path = tmp_path / "bomb.yaml"
    path.write_text("train:\n  seed: [" + ", ".join(levels) + "]\n")  # 9**6 strings once expanded
    assert main(["train", str(path), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) < 2200 and "more characters cut" in err


def test_a_leading_tilde_in_a_path_setting_is_the_home_directory(tmp_path):
    """``dir: ~/runs/x`` in a YAML file made a directory named ``~`` in the working directory."""
    p = tmp_path / "c.yaml"
    p.write_text("output:\n  dir: ~/runs/x\ndata:\n  source: ~/plays\n")
    cfg = load_config(p, ["distributed.deepspeed_config=~/ds.json"])
    home = pathlib.Path.home()
    assert (cfg.output.dir, cfg.data.source) == (str(home / "runs/x"), str(home / "plays"))
    assert cfg.distributed.deepspeed_config == str(home / "ds.json")
    assert load_config(None, ["output.dir=runs/~x"]).output.dir == "runs/~x"  # only a leading one
