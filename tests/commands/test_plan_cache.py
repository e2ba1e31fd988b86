"""The plan cache: the same `memfit plan` asked again is answered from disk (the same bytes, its files written again,
torch not imported); a changed input file, a damaged entry or a CPU plan is searched."""

import gzip
import json
import os
import subprocess
import sys

import pytest

from memfit.cli import main

BASE = ["plan", "--model", "tiny", "--seq-len", "64", "--precision", "fp32", "--ac", "none", "--loss-chunks", "0"]
TINY = [*BASE, "--gpu", "mi210"]
NOTE = "answered from the plan cache"


@pytest.fixture
def plans(tmp_path, monkeypatch):
    root = tmp_path / "plans"
    monkeypatch.setenv("MEMFIT_PLAN_CACHE", str(root))
    monkeypatch.chdir(tmp_path)
    return root


def _ask(capsys, *args, base=TINY):
    code = main([*base, *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_same_question_is_answered_from_the_cache_with_the_same_bytes(plans, capsys):
    code, out, err = _ask(capsys, "--top", "3")
    assert code == 0 and NOTE not in err and len(list(plans.glob("*.json.gz"))) == 1
    again, out2, err2 = _ask(capsys, "--top", "3")
    assert again == 0 and out2 == out and err2.endswith(err) and NOTE in err2.splitlines()[0]
    other, out3, err3 = _ask(capsys, "--top", "2")  # another question: searched, kept apart
    assert other == 0 and NOTE not in err3 and out3 != out and len(list(plans.glob("*.json.gz"))) == 2


def test_a_cached_answer_imports_neither_torch_nor_the_planner(plans, capsys):
    code, out, _ = _ask(capsys, "--json")
    assert code == 0
    probe = (
        "import json, sys\n"
        "from memfit.cli import main\n"
        f"rc = main({json.dumps([*TINY, '--json'])})\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'peft')"
        " or m.startswith('memfit.planner'))\n"
        "print(json.dumps({'rc': rc, 'heavy': heavy}), file=sys.stderr)\n"
    )
    env = dict(os.environ, MEMFIT_PLAN_CACHE=str(plans))
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert p.stdout == out and json.loads(out)["fitting"]
    said = json.loads(p.stderr.strip().splitlines()[-1])
    assert said == {"rc": 0, "heavy": []}


@pytest.mark.parametrize("model", ["preset", "config.json"])
def test_a_search_from_cached_traces_imports_neither_torch_nor_transformers(tmp_path, model):
    """Every trace cached, a new question (the plan cache off) is searched without torch, transformers, PEFT, torchao
    or memfit's tracer: a preset is plain data, a config.json read before comes from the config cache, and the
    traces are numpy arrays."""
    args = TINY
    if model == "config.json":
        from memfit.models.presets import preset_config

        preset_config("tiny").save_pretrained(tmp_path / "model")
        args = [a if a != "tiny" else str(tmp_path / "model" / "config.json") for a in TINY]
    probe = (
        "import json, sys\n"
        "from memfit.cli import main\n"
        f"rc = main({json.dumps([*args, '--json'])})\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'peft', 'torchao',"
        " 'deepspeed') or m in ('memfit.planner.trace', 'memfit.planner.tracker', 'memfit.models.load'))\n"
        "print(json.dumps({'rc': rc, 'heavy': heavy}), file=sys.stderr)\n"
    )
    env = dict(os.environ, MEMFIT_PLAN_CACHE="off", MEMFIT_TRACE_CACHE=str(tmp_path / "traces"))
    env["MEMFIT_CONFIG_CACHE"] = str(tmp_path / "configs")
    runs = [subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)]
    runs.append(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300))
    cold, warm = (json.loads(p.stderr.strip().splitlines()[-1]) for p in runs)
    assert cold["rc"] == 0 and "memfit.planner.trace" in cold["heavy"]  # the first search traced
    assert warm == {"rc": 0, "heavy": []}
    assert json.loads(runs[1].stdout)["fitting"] == json.loads(runs[0].stdout)["fitting"]


def test_written_files_are_written_again_and_a_changed_input_file_is_searched(plans, capsys, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  source: random:tiny\ndata:\n  seq_len: 64\ntrain:\n  micro_batch_size: 2\n")
    written = tmp_path / "best.yaml"
    ask = ("--config", str(cfg), "--write-config", str(written))
    code, out, _ = _ask(capsys, *ask)
    first = written.read_text()
    assert code == 0 and "micro_batch_size: 2" in first
    written.unlink()
    code, out2, err2 = _ask(capsys, *ask)
    assert code == 0 and NOTE in err2 and out2 == out and written.read_text() == first
    cfg.write_text(cfg.read_text().replace("micro_batch_size: 2", "micro_batch_size: 1"))
    code, _, err3 = _ask(capsys, *ask)
    assert code == 0 and NOTE not in err3 and "micro_batch_size: 1" in written.read_text()


def test_a_plan_where_nothing_fits_is_replayed_with_its_one_line_status_and_page(plans, capsys, tmp_path):
    page = tmp_path / "plan.html"
    code, _, err = _ask(capsys, "--gpu-mem", "1MiB", "--html", str(page), base=BASE)
    first = page.read_text()
    assert "nothing fits" in first and "closest that do not fit" in first  # the page to look at when nothing fits
    page.unlink()
    again, _, err2 = _ask(capsys, "--gpu-mem", "1MiB", "--html", str(page), base=BASE)
    assert code == again == 2 and "nothing fits" in err and err2.endswith(err) and NOTE in err2.splitlines()[0]
    assert "nothing fits" in err2.splitlines()[-1]  # the error stays the last line (the note came after it)
    assert page.read_text() == first


@pytest.mark.parametrize(
    "damage",
    [b"", b"not gzip", gzip.compress(b"{not json", mtime=0), gzip.compress(b'{"rc": "x"}', mtime=0)],
    ids=["empty", "not-gzip", "gzip-not-json", "gzip-json-without-an-answer"],
)
def test_a_damaged_answer_is_said_in_one_line_and_searched_again(plans, capsys, damage):
    code, out, _ = _ask(capsys)
    (entry,) = plans.glob("*.json.gz")
    entry.write_bytes(damage)
    code, out2, err2 = _ask(capsys)
    lines = [line for line in err2.splitlines() if "plan cache" in line]
    assert code == 0 and out2 == out and len(lines) == 1 and "is damaged" in lines[0] and NOTE not in err2
    assert json.loads(gzip.decompress(entry.read_bytes()))["stdout"] == out  # rebuilt whole


def test_a_cache_that_cannot_be_written_is_said_once_and_the_plan_still_answers(tmp_path, capsys, monkeypatch):
    """``MEMFIT_PLAN_CACHE`` naming a file: every write failed in silence, so nothing was ever cached and nothing
    said why."""
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("MEMFIT_PLAN_CACHE", str(tmp_path / "afile"))
    monkeypatch.setattr("memfit.cache._UNWRITABLE", set())
    said = []
    for _ in range(2):
        code, out, err = _ask(capsys)
        assert code == 0 and out and NOTE not in err
        said.append([line for line in err.splitlines() if "cannot be written" in line])
    assert len(said[0]) == 1 and f"the cache at {tmp_path / 'afile'} cannot be written" in said[0][0]
    assert said[1] == []  # once a process


def test_cpu_plans_and_an_off_cache_keep_nothing(plans, capsys, monkeypatch):
    cpu = ["plan", "--model", "tiny", "--device", "cpu", "--mem", "8GiB", "--seq-len", "64", "--precision", "fp32"]
    assert main([*cpu, "--ac", "none"]) == 0
    assert not plans.exists()
    monkeypatch.setenv("MEMFIT_PLAN_CACHE", "off")
    assert _ask(capsys)[0] == 0 and not plans.exists()
