"""A restart in a fresh process takes the allocator settings the what-if replay advises: the advice is the
recommended scenario the run config can set, as allocator.* overrides that the config accepts, none where the
settings in effect are already the best; from the run's own recorded allocator trace where it recorded one, and it
is what `memfit frag --simulate` recommends for that trace; the supervisor appends them and says so in one line."""

import json

from support.snapshots import sawtooth
from support.tiny import FIXTURES

from memfit.allocator.model import AllocatorSettings
from memfit.allocator.snapshot import load_snapshot
from memfit.allocator.whatif import Replay, compare, recorded_advice, restart_advice
from memfit.cli import main
from memfit.config.loader import load_config
from memfit.train.supervisor import allocator_overrides

MIB = 1 << 20
DEFAULT = AllocatorSettings()
GC = AllocatorSettings(garbage_collection_threshold=0.8, memory_fraction=0.95)
ROUNDUP = AllocatorSettings(roundup_power2_divisions=4)
EXPANDABLE = AllocatorSettings(expandable_segments=True)


def _run(settings, reserved, retries=0):
    return Replay(settings, reserved, 90 * MIB, 3, retries, False, 0.1, 100)


def test_the_advice_is_the_best_scenario_the_config_can_set_as_valid_overrides():
    results = [_run(DEFAULT, 100 * MIB), _run(ROUNDUP, 80 * MIB), _run(GC, 95 * MIB), _run(EXPANDABLE, 97 * MIB)]
    advice = restart_advice(results, DEFAULT, None)
    assert advice["settings"] == GC.label()  # roundup_power2_divisions saves more, but no config key sets it
    assert advice["overrides"] == ["allocator.garbage_collection_threshold=0.8", "allocator.memory_fraction=0.95"]
    assert advice["peak_reserved_bytes"] == 95 * MIB and advice["now_peak_reserved_bytes"] == 100 * MIB
    cfg = load_config(None, advice["overrides"])
    assert (cfg.allocator.garbage_collection_threshold, cfg.allocator.memory_fraction) == (0.8, 0.95)


def test_no_advice_where_the_settings_in_effect_are_the_best_and_a_set_fraction_stays():
    results = [_run(DEFAULT, 100 * MIB), _run(EXPANDABLE, 90 * MIB)]
    assert restart_advice(results, EXPANDABLE, None) is None
    assert restart_advice([_run(DEFAULT, 100 * MIB), _run(EXPANDABLE, 99 * MIB)], DEFAULT, None) is None  # noise
    capped = AllocatorSettings(memory_fraction=0.5)
    advice = restart_advice([_run(DEFAULT, 100 * MIB), _run(EXPANDABLE, 90 * MIB)], capped, None)
    assert advice["overrides"] == ["allocator.expandable_segments=true"]  # the run's memory fraction is kept


def test_the_advice_on_a_recorded_trace_is_what_the_replay_recommends():
    results, _ = compare(sawtooth()["device_traces"][0], 1 << 40, hip=None)
    advice = restart_advice(results, DEFAULT, None)
    settable = [r for r in results if r.settings.roundup_power2_divisions is None]
    assert advice is not None and advice["peak_reserved_bytes"] == min(r.peak_reserved_bytes for r in settable)
    assert load_config(None, advice["overrides"]).allocator is not None


def test_the_advice_from_a_runs_own_recorded_trace_is_what_memfit_frag_recommends_for_it(tmp_path, capsys):
    """The H200's recorded trace of a Llama-2-7B LoRA step (the blocks alive when recording began allocated first):
    the restart's advice equals `memfit frag --simulate`'s recommendation and numbers for the same trace."""
    fixture = FIXTURES / "h200-llama2-7b-lora-ffn-bf16pure-step3.pickle.gz"
    snap = load_snapshot(fixture)
    advice, events = recorded_advice(snap, 0, 140 << 30, DEFAULT, None, "2.11.0")
    assert events == len(snap["device_traces"][0]) > 20_000
    args = ["frag", str(fixture), "--simulate", "--capacity", "140GiB", "--torch-version", "2.11.0", "--json"]
    assert main([*args, "--out", str(tmp_path / "frag")]) == 0
    simulated = json.loads(capsys.readouterr().out)["simulate"]
    by_label = {s["label"]: s for s in simulated["settings"]}
    assert advice["settings"] == simulated["recommended"] == "expandable_segments:True"
    assert advice["peak_reserved_bytes"] == by_label[advice["settings"]]["peak_reserved_bytes"]
    assert (
        advice["now_peak_reserved_bytes"] == by_label["default"]["peak_reserved_bytes"] > advice["peak_reserved_bytes"]
    )
    assert advice["overrides"] == ["allocator.expandable_segments=true"]
    assert recorded_advice(snap, 0, 140 << 30, EXPANDABLE, None, "2.11.0") == (None, events)  # already the best


def test_a_snapshot_without_a_recorded_trace_advises_nothing():
    for snap in ({"segments": []}, {"segments": [], "device_traces": [[]]}, {"device_traces": [[{"action": "free"}]]}):
        assert recorded_advice(snap, 0, 1 << 30, DEFAULT, None) == (None, 0)


def test_the_supervisor_appends_the_last_restarts_advice_and_says_it(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    advice = restart_advice([_run(DEFAULT, 100 * MIB), _run(EXPANDABLE, 90 * MIB)], DEFAULT, None)
    advice["replayed"] = "this run's recorded allocator trace (90 events)"
    records = [{"kind": "restart", "step": 2, "reason": "r"}, {"kind": "restart", "step": 4, "allocator": advice}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    said = []
    assert allocator_overrides(metrics, said.append) == ["allocator.expandable_segments=true"]
    assert len(said) == 1 and "expandable_segments:True" in said[0] and "0.10 -> 0.09 GiB" in said[0]
    assert said[0].endswith("in the replay of this run's recorded allocator trace (90 events)")
    metrics.write_text(json.dumps(records[0]) + "\n")
    assert allocator_overrides(metrics, said.append) == [] and len(said) == 1


def test_after_micro_batch_1_and_full_checkpointing_an_oom_takes_the_advised_allocator_settings(tmp_path, monkeypatch):
    """The ladder's third rung: the child that ran out of memory wrote the what-if advice into its oom record; the
    supervisor restarts with it, once (the same advice again means nothing is left)."""
    import memfit.train.supervisor as supervisor
    from memfit.errors import EXIT_OUT_OF_MEMORY

    advice = restart_advice([_run(DEFAULT, 100 * MIB), _run(EXPANDABLE, 90 * MIB)], DEFAULT, None)
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    runs = []

    def child(argv, env):  # a child that runs out of memory at step 3 with the advice in its oom record
        runs.append(argv[argv.index("train") + 1 :])
        with metrics.open("a") as fh:
            fh.write(json.dumps({"kind": "oom", "step": 3, "requested_bytes": 2 * MIB, "allocator": advice}) + "\n")
        return EXIT_OUT_OF_MEMORY

    monkeypatch.setattr(supervisor, "_run_child", child)
    base = ["train.micro_batch_size=1", "strategy.activation_checkpointing=full", f"output.dir={metrics.parent}"]
    said = []
    code = supervisor.supervise([], base, lambda o: load_config(None, o), 1, said.append)
    assert code == EXIT_OUT_OF_MEMORY and len(runs) == 2
    assert runs[1] == [*base, "allocator.expandable_segments=true", "train.resume=true"]
    assert "allocator settings expandable_segments:True" in said[0] and "nothing left" in said[1]
    switch = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "on_oom"]
    assert [s["overrides"] for s in switch] == [["allocator.expandable_segments=true"]]
