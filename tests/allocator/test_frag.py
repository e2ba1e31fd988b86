"""memfit frag on hand-built snapshots; expected numbers worked out here from the block lists."""

import json
import pickle
import re

import pytest
from support.snapshots import MIB, fragmented, segment, snapshot
from support.tiny import FIXTURES

from memfit.allocator.snapshot import analyze, load_snapshot
from memfit.cli import main
from memfit.errors import UserError

FIXTURE_H200 = "h200-llama2-7b-lora-ffn-bf16pure-step3.pickle.gz"

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write(tmp_path, data, name="snap.pickle"):
    p = tmp_path / name
    p.write_bytes(pickle.dumps(data))
    return p


def test_numbers_match_the_definitions(tmp_path):
    r = analyze(load_snapshot(_write(tmp_path, fragmented())))
    reserved = 80 * MIB + 20 * MIB + 2 * MIB
    allocated = 40 * MIB + 20 * MIB + 10 * MIB + 512  # active blocks, awaiting-free included
    requested = (40 * MIB - 300) + 20 * MIB + (10 * MIB - 512) + 100
    external = 12 * MIB + 8 * MIB + 6 * MIB + 4 * MIB + (2 * MIB - 512)
    assert r.reserved_bytes == reserved and r.allocated_bytes == allocated and r.requested_bytes == requested
    assert r.awaiting_free_bytes == 10 * MIB
    assert r.internal_free_bytes == 300 + 512 + 412
    assert r.external_free_bytes == external
    assert r.requested_bytes + r.internal_free_bytes + r.external_free_bytes == r.reserved_bytes
    assert r.largest_free_bytes == 12 * MIB
    assert r.fragmentation_ratio == pytest.approx(1 - 12 * MIB / external)
    assert r.reserved_overhead == pytest.approx(external / reserved)
    assert len(r.segments) == 3 and sum(s.segment_type == "small" for s in r.segments) == 1


def test_one_hole_is_zero_fragmentation_and_dust_approaches_one():
    one = analyze(snapshot([segment(0, [(8 * MIB, "active_allocated", None), (24 * MIB, "inactive", 0)])]))
    assert one.fragmentation_ratio == 0.0
    blocks = [(1 * MIB, "active_allocated" if i % 2 else "inactive", 0 if i % 2 == 0 else None) for i in range(64)]
    dust = analyze(snapshot([segment(0, blocks)]))
    assert dust.fragmentation_ratio == pytest.approx(1 - 1 / 32)
    empty = analyze(snapshot([segment(0, [(4 * MIB, "active_allocated", None)])]))
    assert empty.external_free_bytes == 0 and empty.fragmentation_ratio == 0.0


def test_restricted_unpickler_refuses_objects(tmp_path):
    import collections

    p = _write(tmp_path, {"segments": [], "x": collections.OrderedDict()}, "evil.pickle")
    with pytest.raises(UserError, match="refers to the Python object 'collections.OrderedDict'"):
        load_snapshot(p)

    class Boom:
        def __reduce__(self):
            import os

            return (os.system, ("echo pwned",))

    q = _write(tmp_path, {"segments": [], "boom": Boom()}, "boom.pickle")
    with pytest.raises(UserError, match="posix.system|os.system"):
        load_snapshot(q)


def _segment(total: int, blocks: list[tuple[int, int, str]]) -> bytes:
    rows = [{"address": a, "size": n, "state": state} for a, n, state in blocks]
    return pickle.dumps({"segments": [{"address": 0, "total_size": total, "blocks": rows}]})


@pytest.mark.parametrize(
    "content, message",
    [
        (b"not a pickle", "is not a readable pickle"),
        (pickle.dumps([1, 2]), "has no 'segments' list"),
        (pickle.dumps({"segments": [[1, 2]]}), "segments[0] is list, not a dict"),
        (pickle.dumps({"segments": [None]}), "segments[0] is None, not a dict"),
        (pickle.dumps({"segments": [{"address": 0, "total_size": 8, "blocks": None}]}), "segments[0].blocks is None"),
        (
            pickle.dumps({"segments": [{"address": 0, "total_size": 8, "blocks": [{"address": 0, "state": "x"}]}]}),
            "segments[0].blocks[0] has no 'size'",
        ),
        (
            pickle.dumps({"segments": [{"address": "0x0", "total_size": 8, "blocks": []}]}),
            "segments[0].address is str '0x0', not int",
        ),
        (pickle.dumps({"segments": [], "device_traces": [[{"action": "snapshot"}, 7]]}), "device_traces[0][1] is int"),
        (pickle.dumps({"segments": [], "device_traces": [[{"action": None}]]}), "device_traces[0][0].action is None"),
        (
            pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc", "size": "big"}]]}),
            "device_traces[0][0].size is str 'big', not int",
        ),
        (pickle.dumps({"segments": [], "device_traces": {"0": []}}), "device_traces is dict, not list"),
        (pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc", "size": 8}]]}), "(alloc) has no 'addr'"),
        (_segment(-4096, [(0, -4096, "inactive")]), "segments[0].total_size is -4096, not a byte count >= 0"),
        (_segment(4096, [(0, 4096, "freed")]), "blocks[0].state is 'freed', not one of active_allocated, active_"),
        (
            _segment(4096, [(0, 4096, "active_allocated"), (0, 4096, "inactive")]),
            "segments[0]: its blocks add up to 8,192 bytes, its total_size is 4,096",
        ),
        (
            pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc", "addr": 0, "size": -3}]]}),
            "device_traces[0][0].size is -3, not a byte count >= 0",
        ),
    ],
)
def test_bad_files_are_one_line(tmp_path, capsys, content, message):
    p = tmp_path / "bad.pickle"
    p.write_bytes(content)
    assert main(["frag", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


@pytest.mark.parametrize(
    "command, extra, message",
    [
        ("frag", ["--capacity", "0"], "--capacity 0: only --simulate reads this; add --simulate"),
        ("frag", ["--capacity", "0", "--simulate"], "--capacity must be more than 0 bytes (got '0')"),
        ("report", ["--capacity", "8GiB", "--hip-version", "6.2"], "--capacity 8GiB, --hip-version 6.2: only"),
    ],
)
def test_replay_options_without_the_replay_are_one_line_before_anything_is_written(
    tmp_path, capsys, command, extra, message
):
    """They were ignored in silence (``frag --capacity 0`` wrote its plots and said nothing of the capacity)."""
    p = _write(tmp_path, fragmented())
    assert main([command, str(p), "--out", str(tmp_path / "o"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and not (tmp_path / "o").exists()


def test_frag_command_writes_report_and_pngs(tmp_path, capsys):
    p = _write(tmp_path, fragmented())
    out = tmp_path / "plots"
    assert main(["frag", str(p), "--out", str(out), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["reserved_bytes"] == 102 * MIB and r["ooms"] == 1
    # 64 MiB asked; 32 MiB free in the cache + 3 MiB on the device: too little, whatever the layout
    assert r["oom_details"][0]["cause"] == "shortage" and r["oom_details"][0]["largest_free_bytes"] == 12 * MIB
    assert r["requested_bytes"] + r["internal_free_bytes"] + r["external_free_bytes"] == r["reserved_bytes"]
    peak = r["at_peak"]  # after the 12 MiB alloc; the layout there is worked out in test_layout.py
    assert peak["trace_entry"] == 2 and peak["largest_free_bytes"] == 8 * MIB and peak["inferred_blocks"] == 1
    assert peak["allocated_bytes"] == r["allocated_bytes"] + 12 * MIB
    assert len(r["plots"]) == 3
    for png in r["plots"]:
        assert open(png, "rb").read(8) == PNG_MAGIC
    assert main(["frag", str(p), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert (
        "fragmentation ratio" in text
        and "OOM at trace entry 5: asked for 64.0 MiB with 3.0 MiB free on the device" in text
    )
    assert "at peak (entry 2)" in text and "freed before the dump: 1 block(s)" in text


AT_2_13 = ("--torch-version", "2.13")  # what a ROCm build does with expandable segments depends on its release


def test_simulate_compares_settings_and_recommends(tmp_path, capsys):
    from support.snapshots import sawtooth

    p = _write(tmp_path, sawtooth())
    assert (
        main(["frag", str(p), "--out", str(tmp_path / "o"), "--simulate", "--hip-version", "5.7.31921", *AT_2_13]) == 0
    )
    text = capsys.readouterr().out.replace("\n", " ")
    assert "what-if replay of 90 trace events" in text
    assert "expandable_segments is ignored on ROCm 5.7" in text
    assert "recommendation:" in text
    assert "model check (default settings, as the snapshot was taken): peak reserved" in text
    assert open(tmp_path / "o" / "whatif_device0.png", "rb").read(8) == PNG_MAGIC
    assert (
        main(
            [
                "frag",
                str(p),
                "--out",
                str(tmp_path / "j"),
                "--simulate",
                "--json",
                "--hip-version",
                "5.7.31921",
                *AT_2_13,
            ]
        )
        == 0
    )
    sim = json.loads(capsys.readouterr().out)["simulate"]
    assert sim["settings"][0]["label"] == "default" and sim["recommended"] == "roundup_power2_divisions:4"
    assert sim["settings"][1]["not_here"].startswith("expandable_segments is ignored on ROCm 5.7 (PyTorch 2.12+")
    assert sim["settings"][2]["label"] == "expandable_segments:True,max_split_size_mb:512"
    assert sim["settings"][2]["not_here"] == sim["settings"][1]["not_here"]  # ignored there before it is unsafe
    assert (
        main(["frag", str(p), "--out", str(tmp_path / "k"), "--simulate", "--json", "--hip-version", "7.2.1", *AT_2_13])
        == 0
    )
    sim = json.loads(capsys.readouterr().out)["simulate"]
    assert sim["settings"][1]["not_here"] is None and "pytorch #123548" in sim["settings"][2]["not_here"]
    assert "max_split_size_mb" not in (sim["recommended"] or "") or "expandable" not in sim["recommended"]
    assert sim["model_check"]["events"] == 90 and sim["capacity_bytes"] is None
    assert main(["frag", str(p), "--out", str(tmp_path / "o"), "--simulate", "--capacity", "200 megs"]) == 2
    assert "--capacity must look like" in capsys.readouterr().err
    assert main(["frag", str(p), "--out", str(tmp_path / "c"), "--simulate", "--capacity", "300MiB", "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)["simulate"]
    assert sim["capacity_bytes"] == 300 << 20 and any(s["oom"] or s["alloc_retries"] for s in sim["settings"])


def test_whatif_replay_numbers_follow_the_model():
    from support.snapshots import sawtooth

    from memfit.allocator.model import AllocatorSettings
    from memfit.allocator.whatif import compare, replay

    entries = sawtooth()["device_traces"][0]
    default = replay(entries, AllocatorSettings(), 1 << 40)
    expandable = replay(entries, AllocatorSettings(expandable_segments=True), 1 << 40)
    # same requests; a default large block keeps a rest of up to 1 MiB it cannot split off, an expandable
    # one splits off any rest of 512 B or more: at most 31 blocks live at once (30 kept + 1 temporary)
    assert 0 <= default.peak_allocated_bytes - expandable.peak_allocated_bytes <= 31 * (1 << 20)
    assert expandable.peak_reserved_bytes < default.peak_reserved_bytes
    results, best = compare(entries, 1 << 40, hip=None)
    assert best is not None and best.peak_reserved_bytes == min(r.peak_reserved_bytes for r in results)
    tight = replay(entries, AllocatorSettings(), default.peak_allocated_bytes)  # no room for any cache
    assert tight.oom or tight.alloc_retries > 0
    # over time: one point per alloc / free entry, ending where the replay ended
    assert [p.index for p in default.series] == list(range(len(entries)))
    assert (
        default.series[-1].reserved_bytes
        <= default.peak_reserved_bytes
        == max(p.reserved_bytes for p in default.series)
    )
    assert max(p.allocated_bytes for p in default.series) == default.peak_allocated_bytes
    assert all(0 <= p.fragmentation_ratio <= 1 for p in default.series)
    assert default.series[-1].fragmentation_ratio == default.fragmentation_at_end
    retries = [p.alloc_retries for p in tight.series]
    assert retries == sorted(retries) and retries[-1] == tight.alloc_retries
    if tight.oom:
        assert len(tight.series) < len(entries)


def test_replay_check_sets_the_model_beside_the_snapshot():
    """5 MiB then 3 MiB, then the 5 MiB freed: both fit one 20 MiB large-pool segment (requests between
    1 and 10 MiB get kLargeBuffer segments; each split leaves > 1 MiB), so the allocator's own state
    at the dump is that segment: 5 MiB free, 3 MiB allocated, 12 MiB free."""
    from support.snapshots import segment, snapshot

    from memfit.allocator.model import AllocatorSettings
    from memfit.allocator.whatif import replay_check

    base = 0x7F0000000000
    trace = [
        {"action": "alloc", "addr": base, "size": 5 * MIB, "stream": 0},
        {"action": "alloc", "addr": base + 5 * MIB, "size": 3 * MIB, "stream": 0},
        {"action": "free_completed", "addr": base, "size": 5 * MIB, "stream": 0},
    ]
    snap = snapshot(
        [segment(base, [(5 * MIB, "inactive", 0), (3 * MIB, "active_allocated", 3 * MIB), (12 * MIB, "inactive", 0)])],
        [trace],
    )
    check = replay_check(snap, 0, AllocatorSettings())
    assert (check.model_reserved_bytes, check.snapshot_reserved_bytes) == (20 * MIB, 20 * MIB)
    assert (check.model_segments, check.snapshot_segments, check.unmatched_frees) == (1, 1, 0)
    assert check.model_peak_allocated_bytes == 8 * MIB and check.reserved_error == 0
    late = snapshot(snap["segments"], [[{"action": "free_completed", "addr": 1, "size": 512, "stream": 0}, *trace]])
    check = replay_check(late, 0, AllocatorSettings())  # the block freed first was alive when recording began
    assert (check.unmatched_frees, check.model_peak_allocated_bytes, check.model_reserved_bytes) == (
        0,
        8 * MIB,
        22 * MIB,
    )


def test_a_step_trace_from_an_h200_replays_with_the_blocks_alive_at_its_start(tmp_path):
    """A recorded fixture: Llama-2-7B-shaped, LoRA, ffn checkpointing, bf16-pure, 4 x 1024 tokens, the
    allocator's history recorded for step 3 only (train.snapshot_at_step=3) on an H200, 2026-11-30.
    Replayed from an empty allocator it peaked at 20.6 GiB against the trace's 33.6; with the 2087
    blocks alive at the start (12.8 GiB of weights and optimizer state) allocated first it gives the
    trace's 529 segments and its peak reserved within 0.5%."""
    import gzip

    from memfit.allocator.layout import Rebuilt
    from memfit.allocator.model import AllocatorSettings
    from memfit.allocator.whatif import live_at_start, replay_check

    path = tmp_path / "step3.pickle"
    path.write_bytes(gzip.decompress((FIXTURES / FIXTURE_H200).read_bytes()))
    snap = load_snapshot(path)
    rebuilt = Rebuilt(snap, 0)
    prefix = live_at_start(rebuilt)
    assert len(prefix) == 2087 and sum(r for _, (r, _) in prefix) == rebuilt.start.requested
    check = replay_check(snap, 0, AllocatorSettings(), rebuilt)
    assert check.unmatched_frees == 0 and check.model_segments == check.snapshot_segments == 529
    assert abs(check.peak_reserved_error) <= 0.005, check
    assert check.model_peak_allocated_bytes == max(p.allocated_bytes for p in rebuilt.totals())


@pytest.mark.parametrize("expandable", [False, True])
def test_replaying_the_models_own_trace_ends_where_the_model_ended(expandable):
    """A random workload with empty_cache() calls, written out as PyTorch writes it: the replay (which
    empties its cache where the trace released segments without mapping new ones) reproduces it."""
    from support.snapshots import model_workload

    from memfit.allocator.model import AllocatorSettings
    from memfit.allocator.whatif import replay_check

    settings = AllocatorSettings(expandable_segments=expandable)
    snap, truth = model_workload(settings, seed=3)
    assert any(e["action"] in ("segment_free", "segment_unmap") for e in snap["device_traces"][0])
    check = replay_check(snap, 0, settings)
    assert check.model_reserved_bytes == check.snapshot_reserved_bytes == truth[-1][1]
    assert check.model_segments == check.snapshot_segments and check.unmatched_frees == 0
    assert check.model_peak_reserved_bytes == check.trace_peak_reserved_bytes == max(t[1] for t in truth)
    assert check.peak_reserved_error == 0


def test_defaults_stay_recommended_unless_a_setting_retries_less_or_saves_two_percent(capsys):
    from rich.console import Console

    from memfit.allocator.model import AllocatorSettings
    from memfit.allocator.whatif import Replay, recommend
    from memfit.commands.frag import render_whatif

    def run(settings, reserved, oom=False, retries=0):
        return Replay(settings, reserved, 90 * MIB, 3, retries, oom, 0.1, 100)

    default, gc = AllocatorSettings(), AllocatorSettings(garbage_collection_threshold=0.8, memory_fraction=0.95)
    expandable = AllocatorSettings(expandable_segments=True)
    assert recommend([run(default, 100 * MIB), run(gc, 99 * MIB)], None).settings == default  # 1%: noise
    assert recommend([run(default, 100 * MIB), run(gc, 97 * MIB)], None).settings == gc
    assert recommend([run(default, 100 * MIB, retries=2), run(gc, 101 * MIB)], None).settings == gc  # no retry
    assert recommend([run(default, 100 * MIB, retries=1), run(gc, 90 * MIB, retries=1)], None).settings == gc
    assert (
        recommend([run(default, 100 * MIB), run(expandable, 50 * MIB)], "6.2.41133").settings == default
    )  # no-op there
    assert recommend([run(default, 100 * MIB, oom=True), run(gc, 99 * MIB, oom=True)], None) is None
    results = [run(default, 100 * MIB), run(gc, 97 * MIB)]
    render_whatif(results, results[1], None, Console(width=200), "t", rocm=True)
    out = capsys.readouterr().out
    assert (
        "recommendation: PYTORCH_HIP_ALLOC_CONF=garbage_collection_threshold:0.8 and "
        "allocator.memory_fraction=0.95 (torch.cuda.set_per_process_memory_fraction)"
    ) in out


def test_long_replays_keep_a_bounded_series_with_every_change_of_reserved():
    from memfit.allocator.model import AllocatorSettings
    from memfit.allocator.whatif import SERIES_POINTS, replay

    entries = []
    for i in range(30_000):  # 60k entries: a 1 MiB block reused, and every 1000th step a 30 MiB one kept
        entries += [{"action": "alloc", "addr": 1, "size": MIB}, {"action": "free_completed", "addr": 1, "size": MIB}]
        if i % 1000 == 0:
            entries.append({"action": "alloc", "addr": 10 + i, "size": 30 * MIB})
    r = replay(entries, AllocatorSettings(), 1 << 40)
    assert len(r.series) <= SERIES_POINTS + 60 and r.series[-1].index == len(entries) - 1
    reserved = [p.reserved_bytes for p in r.series]
    assert reserved == sorted(reserved) and reserved[-1] == r.peak_reserved_bytes  # each growth is a point
    assert (
        len(set(reserved)) == 31
    )  # the 1 MiB block's 2 MiB small-pool segment, then one 30 MiB segment per kept block


def test_an_oom_with_enough_free_memory_in_pieces_is_blamed_on_fragmentation(tmp_path, capsys):
    """Five 20 MiB blocks in one 100 MiB segment, the 2nd and 4th freed: 40 MiB free, no piece over
    20 MiB; a 30 MiB request fails with 1 MiB left on the device."""
    from support.snapshots import BASE, entry

    trace = [entry("segment_alloc", BASE, 100 * MIB, 0)]
    trace += [entry("alloc", BASE + i * 20 * MIB, 20 * MIB, 1 + i) for i in range(5)]
    trace += [entry("free_completed", BASE + i * 20 * MIB, 20 * MIB, 10 + i) for i in (1, 3)]
    trace += [{"action": "oom", "size": 30 * MIB, "device_free": MIB, "stream": 0, "time_us": 20, "frames": []}]
    blocks = [(20 * MIB, "active_allocated" if i % 2 == 0 else "inactive", None if i % 2 == 0 else 0) for i in range(5)]
    p = _write(tmp_path, snapshot([segment(BASE, blocks)], [trace]))
    assert main(["frag", str(p), "--out", str(tmp_path / "o"), "--json"]) == 0
    oom = json.loads(capsys.readouterr().out)["oom_details"][0]
    assert (oom["cause"], oom["trace_entry"], oom["external_free_bytes"], oom["largest_free_bytes"]) == (
        "fragmentation",
        8,
        40 * MIB,
        20 * MIB,
    )
    assert main(["frag", str(p), "--out", str(tmp_path / "o")]) == 0
    assert "enough free memory, but in pieces" in " ".join(capsys.readouterr().out.split())


def test_a_directory_given_as_the_snapshot_a_file_as_out_a_bad_version_and_top_are_one_line(tmp_path, capsys):
    assert main(["frag", str(tmp_path)]) == 2
    snapshot, taken = tmp_path / "s.pickle", tmp_path / "taken"
    snapshot.write_bytes(pickle.dumps({"segments": [], "device_traces": []}))
    taken.write_text("x")
    assert main(["frag", str(snapshot), "--out", str(taken)]) == 2
    assert main(["frag", str(snapshot), "--hip-version", "x"]) == 2
    assert main(["frag", str(snapshot), "--top", "-3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and "is a directory; give the pickle" in err[0]
    assert f"--out {taken} is a file" in err[1] and "--hip-version must look like 6.2" in err[2]
    assert "--top must be >= 0 (got -3)" in err[3]


def test_top_zero_lists_every_segment(tmp_path, capsys):
    """``--top 0`` listed no segment; 0 now lists every one, as ``plan --top 0`` shows every row."""
    p = _write(tmp_path, fragmented())
    texts = {}
    for top in ("0", "1", "10000"):
        assert main(["frag", str(p), "--out", str(tmp_path / "plots"), "--top", top]) == 0
        texts[top] = capsys.readouterr().out
    listed = {top: len(re.findall(r"^│ 0x[0-9a-f]+ │", text, re.MULTILINE)) for top, text in texts.items()}
    assert texts["0"] == texts["10000"] and listed["0"] > listed["1"] == 1
