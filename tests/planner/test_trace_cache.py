"""The planner's trace cache: a repeated search reads its traces back unchanged, a damaged entry is said once and
traced again, concurrent writers leave a whole entry, and the key changes with everything that changes a trace."""

import gzip
import multiprocessing
import os
import shutil
from pathlib import Path

import pytest

from memfit.config.schema import ModelConfig
from memfit.config.strategy import CheckpointPolicy, Strategy
from memfit.models.load import model_config, resolve_source
from memfit.models.planning import ReadConfig, config_for_planning, config_key, transformers_config
from memfit.models.presets import Preset, preset, preset_config
from memfit.planner import trace_cache
from memfit.planner.hardware import gpu_preset
from memfit.planner.predict import Predictor
from memfit.planner.search import Cluster, Pins, Workload, search, step_allocations
from memfit.planner.timeline import Timeline
from memfit.planner.trace import StepSpec, steady_timeline

SPEC = StepSpec(preset_config("tiny"), 64, Strategy(micro_batch_size=2))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "traces"
    monkeypatch.setenv("MEMFIT_TRACE_CACHE", str(root))
    return root


def test_a_repeated_search_reads_every_trace_back_and_plans_the_same(cache):
    w = Workload(preset_config("tiny"), "tiny", 64, 4)
    pins = Pins({"precision": "fp32", "activation_checkpointing": CheckpointPolicy("none")})
    first = search(w, Cluster(gpu_preset("h100")), pins)
    assert first.traces > 0 and first.cached_traces == 0
    assert len(list(cache.glob("*.json.gz"))) == first.traces
    again = search(w, Cluster(gpu_preset("h100")), pins)
    assert again.cached_traces == again.traces == first.traces
    assert [(c.strategy, c.memory) for c in again.fitting] == [(c.strategy, c.memory) for c in first.fitting]
    assert [(c.strategy, c.memory) for c in again.pruned] == [(c.strategy, c.memory) for c in first.pruned]


def test_a_cached_timeline_is_the_traced_one(cache):
    fresh = steady_timeline(SPEC, 2)
    key = trace_cache.trace_key(SPEC, 2)
    trace_cache.store(key, fresh)
    back = trace_cache.load(key)
    assert back.phases == fresh.phases and back.rows.tolist() == [list(r) for r in fresh.rows]


# mtime=0: the same bytes (and test ids) at every collection
DAMAGED = [b"", b"not gzip", gzip.compress(b"{not json", mtime=0), gzip.compress(b'{"phases": [1]}', mtime=0)]


@pytest.mark.parametrize("damage", DAMAGED)
def test_a_damaged_entry_is_said_in_one_line_removed_and_traced_again(cache, capsys, damage):
    predictor = Predictor(SPEC)
    key = trace_cache.trace_key(SPEC, 2)
    cache.mkdir(parents=True)
    (cache / f"{key}.json.gz").write_bytes(damage)
    timeline = predictor._trace(SPEC, 2)
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is damaged" in err and "ignored and rebuilt" in err
    assert predictor.cached == 0 and predictor.traces == 1
    assert trace_cache.load(key).rows.tolist() == [list(r) for r in timeline.rows]  # traced again and stored whole


def _write_many(root: str, rows: int) -> None:
    import os

    os.environ["MEMFIT_TRACE_CACHE"] = root
    timeline = Timeline(["forward:outer"] * rows, [(i, 0, 0, 0, 0, 0, 0) for i in range(rows)])
    for _ in range(30):
        trace_cache.store("same", timeline)


def test_concurrent_writers_of_one_entry_leave_it_whole(cache):
    with multiprocessing.get_context("fork").Pool(2) as pool:
        pool.starmap(_write_many, [(str(cache), 50_000)] * 4)
    back = trace_cache.load("same")
    assert back is not None and len(back.rows) == 50_000 and back.rows[-1][0] == 49_999
    assert not list(cache.glob(".tmp-*"))


def test_the_key_changes_with_everything_that_changes_a_trace():
    keys = {
        trace_cache.trace_key(SPEC, 2),
        trace_cache.trace_key(SPEC, 3),
        trace_cache.trace_key(SPEC.with_strategy(precision="bf16-mixed"), 2),
        trace_cache.trace_key(StepSpec(preset_config("tiny"), 128, SPEC.strategy), 2),
        trace_cache.trace_key(StepSpec(preset_config("tiny"), 64, SPEC.strategy, round_to=512), 2),
        trace_cache.trace_key(StepSpec(preset_config("smollm2-135m"), 64, SPEC.strategy), 2),
        trace_cache.trace_key(StepSpec(preset("tiny"), 64, SPEC.strategy), 2),  # a preset as plain data
        trace_cache.trace_key(StepSpec(preset("tiny", "eager"), 64, SPEC.strategy), 2),
    }
    assert len(keys) == 8
    assert trace_cache.trace_key(SPEC, 2) == trace_cache.trace_key(
        StepSpec(preset_config("tiny"), 64, SPEC.strategy), 2
    )


def test_off_writes_nothing_and_an_unwritable_cache_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMFIT_TRACE_CACHE", "off")
    assert trace_cache.cache_root() is None
    trace_cache.store("k", Timeline(["forward:outer"], [(1, 0, 0, 0, 0, 0, 0)]))
    assert trace_cache.load("k") is None
    blocked = tmp_path / "file"
    blocked.write_text("a file where the directory would be")
    monkeypatch.setenv("MEMFIT_TRACE_CACHE", str(blocked / "traces"))
    trace_cache.store("k", Timeline(["forward:outer"], [(1, 0, 0, 0, 0, 0, 0)]))  # no error
    assert trace_cache.load("k") is None


def test_an_empty_cache_setting_is_the_default_and_bad_worker_counts_are_one_line(monkeypatch):
    from memfit.cache import cache_dir
    from memfit.errors import UserError
    from memfit.planner.predict import plan_workers

    monkeypatch.setenv("MEMFIT_CACHE", "")  # not the working directory
    assert cache_dir() == Path.home() / ".cache" / "memfit"
    monkeypatch.setenv("MEMFIT_PLAN_WORKERS", "two")
    with pytest.raises(UserError, match=r"MEMFIT_PLAN_WORKERS must be a whole number of processes \(got 'two'\)"):
        plan_workers()


def test_each_cache_directory_keeps_within_its_limit_removing_what_was_least_recently_used(tmp_path, monkeypatch):
    """Keys name memfit's source and the library versions, so every upgrade left the old entries behind for good (and
    a killed writer its temporary file). A write now removes the entries least recently read or written past
    ``MEMFIT_CACHE_LIMIT`` (default 4 GiB a directory), never the one it wrote; a read marks its entry."""
    from memfit import cache

    monkeypatch.setattr(cache, "_HELD", {})
    monkeypatch.setenv("MEMFIT_CACHE_LIMIT", "2KiB")
    root = tmp_path / "c"
    root.mkdir()
    for age, name in enumerate(["old", "read", "new"]):
        (root / f"{name}.json.gz").write_bytes(b"x" * 1000)
        os.utime(root / f"{name}.json.gz", (1000 + age, 1000 + age))
    (root / ".tmp-killed.json.gz").write_bytes(b"x" * 5000)
    os.utime(root / ".tmp-killed.json.gz", (1000, 1000))
    (root / ".tmp-writing.json.gz").write_bytes(b"x")  # a writer at work now
    cache.write_entry(root, "read", {"v": 1})  # written (or read) now: the most recent; 2,030 bytes held
    assert cache.read_entry(root, "read", "test") == {"v": 1}
    cache.write_entry(root, "big", {"v": "y" * 200_000})  # gzipped, some 250 bytes: past 2 KiB, "old" goes
    assert sorted(p.name for p in root.iterdir()) == [
        ".tmp-writing.json.gz",
        "big.json.gz",
        "new.json.gz",
        "read.json.gz",
    ]
    assert sum(p.stat().st_size for p in root.glob("*.json.gz")) <= 2 * 1024
    monkeypatch.setattr(cache, "_HELD", {})
    monkeypatch.setenv("MEMFIT_CACHE_LIMIT", "1KiB")  # one entry over it alone: the one written stays
    cache.write_entry(root, "alone", {"v": os.urandom(2000).hex()})
    assert sorted(p.name for p in root.iterdir()) == [".tmp-writing.json.gz", "alone.json.gz"]
    monkeypatch.setenv("MEMFIT_CACHE_LIMIT", "off")
    assert cache.cache_limit() is None
    monkeypatch.delenv("MEMFIT_CACHE_LIMIT")
    assert cache.cache_limit() == 4 << 30


def test_a_cache_limit_that_is_no_size_is_one_line_before_any_work(tmp_path):
    import subprocess
    import sys

    env = {**os.environ, "MEMFIT_CACHE_LIMIT": "lots"}
    r = subprocess.run(
        [sys.executable, "-m", "memfit.cli", "plan", "--model", "tiny"], capture_output=True, text=True, env=env
    )
    assert r.returncode == 2 and r.stderr.strip() == (
        "memfit: error: MEMFIT_CACHE_LIMIT must be a size such as 8GiB or 512MiB, or off for no limit (got 'lots')"
    )


def test_a_switch_word_is_never_a_directory_and_a_leading_tilde_is_home(tmp_path, monkeypatch):
    """``MEMFIT_PLAN_CACHE=1`` made a directory named ``1`` in the working one, ``MEMFIT_CACHE='~/c'`` one named
    ``~``."""
    from memfit.cache import cache_dir, cache_root

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "home-cache"))
    for word in ("on", "1", " TRUE ", "yes"):
        monkeypatch.setenv("MEMFIT_PLAN_CACHE", word)
        assert cache_root("MEMFIT_PLAN_CACHE", "plans") == tmp_path / "home-cache" / "plans"
    for word in ("off", "0", "False", "no", ""):
        monkeypatch.setenv("MEMFIT_PLAN_CACHE", word)
        assert cache_root("MEMFIT_PLAN_CACHE", "plans") is None
    monkeypatch.setenv("MEMFIT_PLAN_CACHE", "~/plans")
    assert cache_root("MEMFIT_PLAN_CACHE", "plans") == Path.home() / "plans"
    monkeypatch.setenv("MEMFIT_PLAN_CACHE", "2")  # a relative directory is still a directory
    assert cache_root("MEMFIT_PLAN_CACHE", "plans") == Path("2")
    monkeypatch.setenv("MEMFIT_CACHE", "~/c")
    assert cache_dir() == Path.home() / "c"
    assert list(tmp_path.iterdir()) == []


def test_a_preset_as_plain_data_traces_as_its_transformers_config_and_the_trainer_names_it_as_plan_does():
    """``memfit plan`` reads a preset as a ``Preset`` (no transformers import); its trace is its ``LlamaConfig``'s,
    and the trainer's fit check, planning a ``random:`` preset, asks the trace cache for the same entries."""
    strategy = Strategy(micro_batch_size=2, activation_checkpointing=CheckpointPolicy("full"), precision="bf16-mixed")
    plain = steady_timeline(StepSpec(preset("tiny"), 64, strategy), 2)
    built = steady_timeline(StepSpec(preset_config("tiny"), 64, strategy), 2)
    assert plain.phases == built.phases and plain.rows == built.rows
    trainer_side = model_config(resolve_source("random:tiny"), ModelConfig())
    assert isinstance(trainer_side, Preset)
    keys = {trace_cache.trace_key(StepSpec(c, 64, strategy), 2) for c in (trainer_side, config_for_planning("tiny"))}
    assert len(keys) == 1


def test_a_configurations_allocator_events_are_traced_once_and_read_back(cache, capsys, monkeypatch):
    """``step_allocations`` (``memfit plan --explain``'s replay, the trainer's on a GPU) traces two full-depth steps
    once; asked again it reads them from the trace cache. A damaged entry is said in one line and traced again."""
    import memfit.planner.trace as trace

    strategy = Strategy(micro_batch_size=2, grad_accum_steps=4)
    first = step_allocations(preset("tiny"), 64, strategy, None)
    key = trace_cache.allocations_key(StepSpec(preset("tiny"), 64, strategy.replace(grad_accum_steps=2), None, 512), 2)
    assert (cache / f"{key}.json.gz").is_file() and trace_cache.trace_key(SPEC, 2) != key
    real = trace.trace_allocations
    monkeypatch.setattr(trace, "trace_allocations", lambda *a, **k: pytest.fail("traced again"))
    assert step_allocations(preset("tiny"), 64, strategy, None) == first and len(first) > 100
    (cache / f"{key}.json.gz").write_bytes(gzip.compress(b'{"allocations": [[1, 2, 3]]}', mtime=0))
    monkeypatch.setattr(trace, "trace_allocations", real)
    assert step_allocations(preset("tiny"), 64, strategy, None) == first
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is damaged" in err and trace_cache.load_allocations(key) == first


def test_a_read_config_is_kept_named_as_the_trainers_and_read_again_when_its_file_changes(
    tmp_path, monkeypatch, capsys
):
    """A config.json's config is read by transformers once and then taken from the config cache; its trace-cache
    name is that of the transformers config the trainer holds for ``random:<that file>``; an edited file is read
    again, and a damaged entry is said in one line and read again."""
    import memfit.models.planning as planning

    monkeypatch.setenv("MEMFIT_CONFIG_CACHE", str(tmp_path / "configs"))
    preset_config("tiny").save_pretrained(tmp_path / "model")
    file = tmp_path / "model" / "config.json"
    first = config_for_planning(str(file))
    assert isinstance(first, ReadConfig) and first.num_hidden_layers == 2 and first.tie_word_embeddings
    trainer_side = model_config(resolve_source(f"random:{file}"), ModelConfig())
    assert config_key(first) == config_key(trainer_side)
    real = planning._read
    monkeypatch.setattr(planning, "_read", lambda *a: pytest.fail("read again"))
    assert config_for_planning(str(tmp_path / "model")) == first  # the directory names the same file
    monkeypatch.setattr(planning, "_read", real)
    before = set((tmp_path / "configs").glob("*.json.gz"))
    file.write_text(file.read_text().replace('"num_hidden_layers": 2', '"num_hidden_layers": 5'))
    assert config_for_planning(str(file)).num_hidden_layers == 5
    (entry,) = set((tmp_path / "configs").glob("*.json.gz")) - before
    entry.write_bytes(gzip.compress(b'{"path": "x"}', mtime=0))
    assert config_for_planning(str(file)).num_hidden_layers == 5
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "config cache entry" in err and "is damaged" in err


def test_a_config_cached_from_one_copy_is_read_from_another_after_the_first_is_gone(tmp_path, monkeypatch):
    """The config cache is keyed by a file's bytes, and its entry named the file it was first read from: with that
    copy deleted, planning an identical copy elsewhere read the deleted path again ('is not a usable model config
    (Repo id must be in the form ...)')."""
    monkeypatch.setenv("MEMFIT_CONFIG_CACHE", str(tmp_path / "configs"))
    for copy in ("first", "second"):
        preset_config("tiny").save_pretrained(tmp_path / copy)
    first = config_for_planning(str(tmp_path / "first"))
    shutil.rmtree(tmp_path / "first")
    second = config_for_planning(str(tmp_path / "second"))
    assert second.path == str(tmp_path / "second" / "config.json") and config_key(second) == config_key(first)
    assert transformers_config(second).num_hidden_layers == 2
