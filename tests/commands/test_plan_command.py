"""`memfit plan` as a user runs it: flags, --config / --deepspeed pins, JSON, --explain, --simulate, one-line errors."""

import json
import re
import subprocess
import sys

import pytest
import yaml

from memfit.cli import main
from memfit.config.loader import load_config


def _plan(capsys, *args):
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "llama2-7bb", "--gpu", "mi210"], "did you mean 'llama2-7b'"),
        (["--model", "llama2-7b", "--gpu", "mi211"], "unknown GPU 'mi211' (did you mean 'mi210'?)"),
        (
            ["--model", "tiny", "--gpu", "mi210", "--seq-len", "64", "--zero", "2"],
            "ZeRO stage 2 needs more than one GPU",
        ),
        (
            ["--model", "tiny", "--gpu", "mi210", "--seq-len", "64", "--gpus-per-node", "2", "--global-batch", "3"],
            "not divisible by the 2 GPUs",
        ),
        (
            ["--model", "tiny", "--gpu", "mi210", "--seq-len", "64", "--global-batch", "8", "--micro-batch", "3"],
            "does not divide the per-GPU batch 8",
        ),
        (["--model", "tiny", "--gpu", "t4", "--seq-len", "64", "--precision", "bf16-mixed"], "t4 has no bf16"),
        (
            ["--model", "tiny", "--gpu", "mi210", "--seq-len", "5000"],
            "exceeds the model's max_position_embeddings 1024",
        ),
        (
            ["--model", "llama2-70b", "--gpu", "rtx4090", "--seq-len", "512", "--global-batch", "1"],
            "nothing fits on rtx4090: the closest candidate",
        ),
        (
            ["--model", "tiny", "--gpu", "mi210", "--simulate"],
            "--simulate replays one candidate's step: give --explain N too",
        ),
        (["--model", "tiny", "--gpu-mem", "0"], "--gpu-mem must be more than 0 bytes (got '0')"),
        (
            ["--model", "tiny", "--gpu", "mi210", "--write-config", "/no/such/dir/run.yaml"],
            "cannot write '/no/such/dir/run.yaml': its directory '/no/such/dir' does not exist; give another",
        ),
        (["--model", "tiny", "--gpu", "mi210", "--seq-len", "64", "--explain", "0"], "--explain must be a row of"),
        (
            ["--model", "tiny", "--gpu", "mi210", "--html", "/"],
            "cannot write '/': it is a directory; give another --html",
        ),
        (["--model", "tiny", "--gpu", "mi210", "--torch-version", "banana"], "--torch-version must look like 2.11"),
        (["--model", "tiny", "--gpu", "mi210", "--hip-version", "6.2"], "--hip-version 6.2: only --simulate reads"),
        (
            ["--model", "tiny", "--gpu", "mi210", "--seq-len", "64", "--loss-chunks", "100"],
            "--loss-chunks 100 is more than --seq-len 64 positions; use at most 64",
        ),
    ],
)
def test_plan_errors_are_one_line(capsys, args, message):
    code, _, err = _plan(capsys, *args)
    assert code == 2 and message in err and "\n" not in err


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (["--explain", "0"], "--explain must be a row of the table, 1 or more (got 0)"),
        (["--top", "-1"], "--top must be >= 0 (got -1)"),
        (["--html", "/proc/memfit-plan.html"], "cannot write '/proc/memfit-plan.html': its directory refuses files"),
    ],
)
def test_an_option_no_table_can_satisfy_is_refused_before_the_search(capsys, flag, message):
    """--seq-len 5000 is past tiny's 1024 positions, which only the search finds: these options are refused first
    (they were refused after a search of seconds; a 70B search takes minutes)."""
    code, _, err = _plan(capsys, "--model", "tiny", "--gpu", "mi210", "--seq-len", "5000", *flag)
    assert code == 2 and message in err and "\n" not in err


def test_a_refusal_of_pins_names_the_file_that_pinned_the_key(capsys, tmp_path):
    """The shipped MI210 config pins the fused AdamW; 4-bit states from the command line step one parameter at a
    time: the refusal names the config file as well as its key, so the user knows what to edit."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  source: random:tiny\ndata:\n  seq_len: 64\noptimizer:\n  implementation: fused\n")
    code, _, err = _plan(capsys, "--config", str(cfg), "--gpu", "mi210", "--optimizer-name", "adamw4bit")
    assert code == 2 and "\n" not in err
    assert err.endswith(
        f"set optimizer.implementation auto or for-loop (got fused) (pinned by --config {cfg}: "
        "optimizer.implementation)"
    ), err
    code, _, err = _plan(
        capsys, "--config", str(cfg), "--gpu", "mi210", "--optimizer-name", "adamw4bit", "--optimizer", "for-loop"
    )
    assert code == 0, err


def test_plan_reads_train_config_and_deepspeed_json(capsys, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 1,
                "gradient_accumulation_steps": 4,
                "zero_optimization": {"stage": 2},
                "bf16": {"enabled": True},
            }
        )
    )
    code, out, _ = _plan(
        capsys,
        "--model",
        "tiny",
        "--gpu",
        "mi250x",
        "--gpus-per-node",
        "2",
        "--deepspeed",
        str(ds),
        "--json",
        "--seq-len",
        "64",
    )
    assert code == 0
    rows = json.loads(out)["fitting"] + json.loads(out)["pruned"]
    assert {(r["zero_stage"], r["micro_batch_size"], r["grad_accum_steps"], r["precision"]) for r in rows} == {
        (2, 1, 4, "bf16-mixed")
    }
    cfg = tmp_path / "t.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "model": {"source": "random:tiny"},
                "data": {"seq_len": 64},
                "strategy": {"activation_checkpointing": "ffn", "precision": "bf16-pure"},
                "train": {"micro_batch_size": 2, "grad_accum_steps": 2},
            }
        )
    )
    code, out, _ = _plan(capsys, "--config", str(cfg), "--gpu", "mi210", "--json")
    rows = json.loads(out)["fitting"]
    assert code == 0 and {(r["activation_checkpointing"], r["precision"], r["micro_batch_size"]) for r in rows} == {
        ("ffn", "bf16-pure", 2)
    }


def test_plan_json_explain_and_written_configs(capsys, tmp_path):
    run_yaml, ds_json = tmp_path / "run.yaml", tmp_path / "ds.json"
    code, out, _ = _plan(
        capsys, "--model", "tiny", "--gpu-mem", "1GiB", "--seq-len", "128", "--global-batch", "4", "--json"
    )
    assert code == 0
    plan = json.loads(out)
    assert plan["fitting"] and plan["fitting"][0]["fits"] and "assumptions" in plan
    assert plan["gpu"] == "custom-1GiB"  # a GPU known by its memory is named by it (not custom-0.00976562GiB)
    code, out, err = _plan(
        capsys,
        "--model",
        "tiny",
        "--gpu",
        "h100",
        "--gpus-per-node",
        "2",
        "--seq-len",
        "128",
        "--global-batch",
        "8",
        "--explain",
        "1",
        "--write-config",
        str(run_yaml),
        "--write-deepspeed",
        str(ds_json),
        "--json",
    )
    # with --json, stdout is the JSON alone: the explanation and "wrote ..." go to stderr
    assert code == 0 and json.loads(out)["fitting"] and "per phase peak" in err and "backward" in err
    assert f"wrote {run_yaml}" in err
    cfg = load_config(run_yaml)  # the written config is a valid memfit train config
    assert cfg.model.source == "random:tiny" and cfg.data.seq_len == 128
    ds = json.loads(ds_json.read_text())
    assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 2 == 8


def test_plan_simulate_replays_the_explained_step_under_allocator_settings(capsys):
    code, out, _ = _plan(
        capsys,
        "--model",
        "tiny",
        "--gpu",
        "mi210",
        "--seq-len",
        "128",
        "--global-batch",
        "4",
        "--ac",
        "none",
        "--precision",
        "bf16-mixed",
        "--micro-batch",
        "4",
        "--explain",
        "1",
        "--simulate",
    )
    assert code == 0
    text = " ".join(out.split())
    assert "what-if: the two traced steps'" in text and "in mi210's 64 GiB less 512 MiB of runtime context" in text
    for label in ("default", "expandable_segments:True", "max_split_size_mb:128", "roundup_power2_divisions:4"):
        assert label in text
    assert "recommendation:" in text and "give --hip-version (and --torch-version) to judge it" in text
    assert "PYTORCH_CUDA_ALLOC_CONF" not in text  # an AMD GPU: the HIP variable, when one is recommended


def test_plan_takes_lora_targets_and_alpha_and_shows_them(capsys, tmp_path):
    """Adapting q/v only holds fewer adapters than all seven projections: less optimizer state; the
    title, the JSON and the written train config carry the targets and alpha."""
    base = [
        "--model",
        "tiny",
        "--gpu",
        "mi210",
        "--seq-len",
        "64",
        "--global-batch",
        "4",
        "--ac",
        "none",
        "--precision",
        "bf16-mixed",
        "--micro-batch",
        "4",
        "--optimizer",
        "fused",
        "--loss-chunks",
        "0",
    ]
    code, out, _ = _plan(capsys, *base, "--lora", "--json")
    every = json.loads(out)["fitting"][0]
    run_yaml = tmp_path / "run.yaml"
    code, out, _ = _plan(
        capsys,
        *base,
        "--lora",
        "--lora-targets",
        "q_proj,v_proj",
        "--lora-alpha",
        "32",
        "--json",
        "--write-config",
        str(run_yaml),
    )
    plan = json.loads(out.splitlines()[0])  # then "wrote run.yaml"
    qv = plan["fitting"][0]
    assert code == 0 and plan["lora_config"] == {"rank": 16, "alpha": 32.0, "target_modules": ["q_proj", "v_proj"]}
    assert qv["peak_by_category_bytes"]["optimizer"] < every["peak_by_category_bytes"]["optimizer"]
    cfg = load_config(run_yaml)
    assert cfg.lora.target_modules == ["q_proj", "v_proj"] and cfg.lora.alpha == 32.0
    code, out, _ = _plan(capsys, *base, "--lora", "--lora-targets", "q_proj,v_proj", "--lora-alpha", "32")
    assert "tiny + LoRA r=16 on q_proj,v_proj (alpha 32)" in " ".join(out.split())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lora-targets", "q_proj"], "give --lora too"),
        (
            ["--lora", "--lora-targets", ","],
            "--lora-targets must name at least one module, e.g. q_proj,v_proj (got ',')",
        ),
        (["--lora", "--lora-rank", "0"], "--lora-rank must be >= 1 (got 0)"),
        (["--lora", "--lora-alpha", "nan"], "--lora-alpha must be a finite number > 0: the adapters' scale is"),
        (["--lora", "--lora-alpha", "-1"], "--lora-alpha must be a finite number > 0: the adapters' scale is"),  # taken
        (["--lora-rank", "0"], "--lora-rank describes LoRA adapters: give --lora too"),  # was: ignored in silence
        (["--lora-rank", "8", "--lora-alpha", "16"], "--lora-rank, --lora-alpha describe LoRA adapters: give --lora"),
        (["--lora", "--lora-targets", "qq_proj"], "'qq_proj' is not a Linear module of this model (did you mean"),
        (["--lora", "--lora-targets", "gate_up_proj"], "v_proj, or all-linear (every one but the output head)"),
        (["--lora", "--lora-rank", "65"], "lora.rank 65 is above every adapted weight's smaller side (at most 64"),
    ],
)
def test_plan_refuses_bad_lora_flags_in_one_line(capsys, args, message):
    code, _, err = _plan(capsys, "--model", "tiny", "--gpu", "mi210", "--seq-len", "64", *args)
    assert code == 2 and message in err and len(err.splitlines()) == 1


def test_plan_device_cpu_is_the_trainers_cpu_prediction_with_the_runtime_apart(capsys):
    """--device cpu: exact tensor bytes (no allocator rounding, offloading not searched: one memory), the same
    peak the trainer's fit check predicts for that CPU run, and the runtime's resident memory stated apart."""
    from memfit.config.strategy import CheckpointPolicy, Strategy
    from memfit.models.presets import preset_config
    from memfit.planner.search import predict_run

    args = ["--model", "tiny", "--device", "cpu", "--mem", "4GiB", "--seq-len", "64", "--global-batch", "2"]
    code, out, _ = _plan(capsys, *args, "--ac", "none", "--micro-batch", "2", "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["gpu"] == "cpu" and plan["gpu_memory_bytes"] == 4 << 30 and plan["runtime_bytes"] > 0
    best = plan["fitting"][0]
    assert best["precision"] == "fp32"  # on a CPU fp32 ranks first among equals
    assert not any(c["activation_offload"] or c["optimizer_offload"] for c in plan["fitting"] + plan["pruned"])
    strategy = Strategy(
        activation_checkpointing=CheckpointPolicy.parse(best["activation_checkpointing"]),
        **{k: best[k] for k in ("precision", "quantize_base", "loss_chunks", "optimizer", "optimizer_name")},
        optimizer_in_backward=best["optimizer_in_backward"],
        micro_batch_size=2,
    )
    trainer_view = predict_run(preset_config("tiny"), 64, strategy, None, on_gpu=False)
    assert best["peak_bytes"] == trainer_view.peak_bytes
    assert best["predicted_reserved_bytes"] == best["peak_bytes"] + plan["runtime_bytes"]
    code, out, _ = _plan(capsys, *args[:-4], "--seq-len", "64", "--global-batch", "2", "--top", "1")
    assert code == 0 and "runtime resident" in out and "1 x cpu (4 GiB)" in out
    assert "keeps freed memory between steps" in " ".join(out.split())  # the kept heap is not in reserved


def test_the_cpu_runtime_share_is_read_with_torch_and_transformers_loaded():
    """A --device cpu plan's runtime share is this process's resident size with what a run holds loaded: a plan from
    cached traces imports neither torch nor transformers' modeling code, so ``this_cpu`` must (a fresh process)."""
    probe = (
        "import sys\n"
        "from memfit.planner.auto import this_cpu\n"
        "assert 'torch' not in sys.modules\n"
        "this_cpu('4GiB')\n"
        "print('torch' in sys.modules and 'transformers.modeling_utils' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--device", "cpu", "--gpu", "h100"], "give --mem, not --gpu"),
        (["--device", "cpu", "--gpus-per-node", "2"], "--device cpu plans one process"),
        (["--gpu", "h100", "--mem", "4GiB"], "--mem is the memory of a --device cpu plan"),
        (["--device", "cpu", "--explain", "1", "--simulate"], "a --device cpu plan has none"),
        (["--device", "cpu", "--precision", "fp16-mixed"], "a CPU run has no fp16 loss scaling"),
        (["--device", "cpu", "--mem", "1MiB"], "try LoRA, more --mem, or a shorter --seq-len"),
        (["--device", "cpu", "--mem", "1MiB", "--lora"], "try more --mem, a lower --lora-rank, or a shorter"),
    ],
)
def test_plan_device_cpu_errors_are_one_line(capsys, extra, message):
    code, _, err = _plan(capsys, "--model", "tiny", "--seq-len", "64", *extra)
    assert code == 2 and message in err and "\n" not in err


LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 100}
MIXTRAL = {"model_type": "mixtral", "num_attention_heads": 4, "num_local_experts": 4, "num_experts_per_tok": 2}


@pytest.mark.parametrize(
    "config, message",
    [
        ({"hidden_size": -64, "num_attention_heads": 4}, "has hidden_size -64; every size must be a whole number >= 1"),
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, "4 attention heads, not a multiple of its 3 key/value"),
        ({"num_attention_heads": 3}, "config.json"),  # newer transformers refuse it themselves, older ones at the heads
        ({"num_attention_heads": 4, "num_hidden_layers": 0}, "num_hidden_layers 0"),
        ({"num_attention_heads": 0}, "has num_attention_heads 0; every size"),  # a ZeroDivisionError traceback
        # a traceback from torch.topk in the trace workers; 0 was planned without a word (every MoE output zero)
        (MIXTRAL | {"num_local_experts": 0}, "routes each token to num_experts_per_tok 2 of its num_local_experts 0"),
        (MIXTRAL | {"num_experts_per_tok": 5}, "num_experts_per_tok must be a whole number from 1 to"),
        (MIXTRAL | {"num_experts_per_tok": 0}, "routes each token to num_experts_per_tok 0 of its num_local_experts 4"),
        (  # a traceback from the trace workers (KeyError: 'bogus') after transformers' warning
            {"num_attention_heads": 4, "rope_scaling": {"type": "bogus", "factor": 2.0}},
            "has rope_type 'bogus', which transformers does not know; use one of default, linear",
        ),
        ({"num_attention_heads": 4, "rope_scaling": {"rope_type": "linear"}}, "'factor'"),  # transformers' own check
        # read without a word, then a traceback where the model was built (the trace workers, the trainer)
        ({"num_attention_heads": 4, "hidden_act": "bogus"}, "a model transformers can build (KeyError: 'bogus')"),
        ({"num_attention_heads": 4, "pad_token_id": 500}, "can build (AssertionError: Padding_idx must be within"),
        ({"num_attention_heads": 4, "head_dim": 0}, "is not a model transformers can build (ZeroDivisionError"),
        ({"num_attention_heads": 4, "dtype": "bogus"}, "(module 'torch' has no attribute 'bogus')"),
        # read and planned without a word; a run's loss was NaN from step 1, blamed on the learning rate
        ({"num_attention_heads": 4, "rope_theta": -1}, "has rope_theta -1; it must be a number > 0"),
        ({"num_attention_heads": 4, "rms_norm_eps": -1.0}, "has rms_norm_eps -1.0; it must be a number > 0"),
        (
            {"num_attention_heads": 4, "model_type": "gpt2"},
            "config.json': GPT2LMHeadModel is not a Llama-family decoder (no model.layers[i].mlp)",
        ),
    ],
    ids=[
        "negative",
        "kv-heads",
        "heads",
        "no-layers",
        "no-heads",
        "no-experts",
        "top-k-past-experts",
        "top-k-0",
        "rope-type",
        "rope-factor",
        "hidden-act",
        "pad-token",
        "head-dim",
        "dtype",
        "rope-theta",
        "rms-norm-eps",
        "gpt2",
    ],
)
def test_a_config_json_with_impossible_sizes_is_one_line(capsys, tmp_path, config, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA | config))
    code, _, err = _plan(capsys, "--model", str(path), "--gpu", "h100", "--seq-len", "64")
    assert code == 2 and message in err and "\n" not in err


def test_a_config_with_no_experts_and_none_per_token_is_planned_as_dense(capsys, tmp_path):
    """A dense model's config may say it has no experts and routes to none (a dense Granite-4.0's does)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA | {"num_attention_heads": 4, "num_local_experts": 0, "num_experts_per_tok": 0}))
    code, out, _ = _plan(capsys, "--model", str(path), "--gpu", "h100", "--seq-len", "64", "--json")
    assert code == 0 and json.loads(out)["fitting"], out[-500:]


@pytest.mark.parametrize(
    "ds, message",
    [
        ({"zero_optimization": "x"}, 'zero_optimization must be a JSON object (got "x")'),
        ({"bf16": True}, "bf16 must be a JSON object (got true)"),
        ({"zero_optimization": {"offload_optimizer": 1}}, "zero_optimization.offload_optimizer must be a JSON object"),
        ({"gradient_accumulation_steps": "x"}, 'gradient_accumulation_steps must be a whole number >= 1 or "auto"'),
        ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu must be a whole number"),
        ("[" * 100_000, "ds.json:1: not valid JSON (nested too deeply to read)"),  # was a RecursionError
    ],
)
def test_a_deepspeed_json_of_the_wrong_shape_is_one_line(capsys, tmp_path, ds, message):
    path = tmp_path / "ds.json"
    path.write_text(ds if isinstance(ds, str) else json.dumps(ds))
    code, _, err = _plan(capsys, "--model", "tiny", "--gpu", "h100", "--deepspeed", str(path))
    assert code == 2 and message in err and "\n" not in err


def test_plan_takes_a_shipped_config_by_name_as_train_does(capsys):
    code, out, _ = _plan(capsys, "--config", "tiny-cpu", "--gpu", "h100", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["model"] == "random:tiny" and plan["seq_len"] == 64 and plan["fitting"]


def test_a_written_config_carries_the_data_it_was_planned_for(capsys, tmp_path):
    """--write-config keeps a --config's data.source; a plan of packed rows without one writes memfit's offline chat
    set (packing packs chat records: train refused the text default it wrote before) and says so in its header."""
    import yaml

    from memfit.config.loader import load_config

    packed = tmp_path / "packed.yaml"
    code, _, err = _plan(
        capsys,
        "--model",
        "tiny",
        "--gpu",
        "h100",
        "--seq-len",
        "64",
        "--packing",
        "true",
        "--write-config",
        str(packed),
    )
    assert code == 0, err
    assert yaml.safe_load(packed.read_text())["data"] == {"source": "shakespeare-chat", "seq_len": 64, "packing": True}
    assert "# packed rows pack chat records: data.source shakespeare-chat" in packed.read_text()
    assert load_config(packed).data.packs()  # a config train accepts as it is
    records = tmp_path / "chat.jsonl"
    records.write_text('{"prompt": "a", "response": "b"}\n' * 4)
    mine = tmp_path / "mine.yaml"
    mine.write_text(f"model:\n  source: random:tiny\ndata:\n  source: {records}\n  seq_len: 64\n")
    again = tmp_path / "again.yaml"
    code, _, err = _plan(capsys, "--config", str(mine), "--gpu", "h100", "--write-config", str(again))
    assert code == 0, err
    written = yaml.safe_load(again.read_text())["data"]
    assert written["source"] == str(records) and written["packing"] is True  # chat data packs by default
    assert "offline set" not in again.read_text()


def test_top_zero_shows_every_row(capsys):
    """``--top 0`` printed a table with no rows; 0 now means every row (``--top 1`` shows one)."""
    plan = ["--model", "tiny", "--gpu", "h100", "--seq-len", "64", "--global-batch", "4"]
    outs = {top: _plan(capsys, *plan, "--top", top)[1] for top in ("0", "1", "10000")}
    rows = {top: len(re.findall(r"^│ +\d+ │", out, re.MULTILINE)) for top, out in outs.items()}
    assert outs["0"] == outs["10000"] and rows["0"] > rows["1"] == 1
    assert f"fit in {rows['0']} rows" in " ".join(outs["0"].split())
