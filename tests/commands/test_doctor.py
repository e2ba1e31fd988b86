"""memfit doctor and allocator-settings parsing, with recorded ROCm/CUDA build strings as fixtures."""

import json

import pytest

from memfit.allocator.conf import check, expandable_takes_effect, parse, rocm_version
from memfit.cli import main
from memfit.telemetry.platform import PROBE_BLOCKS, PROBE_MIB, judge_expandable_probe, report

ROCM_57 = "5.7.31921-d1770ee1b"  # torch.version.hip of a ROCm 5.7 wheel
ROCM_70 = "7.0.51831-a3e329ad8"


def test_good_strings_parse():
    c = parse(
        "backend:native,expandable_segments:True,max_split_size_mb:512,garbage_collection_threshold:0.6,"
        "roundup_power2_divisions:[256:1,512:2,>:4]"
    )
    assert c.errors == []
    assert c.settings == {
        "backend": "native",
        "expandable_segments": "True",
        "max_split_size_mb": "512",
        "garbage_collection_threshold": "0.6",
        "roundup_power2_divisions": "[256:1,512:2,>:4]",
    }


@pytest.mark.parametrize(
    "text, error",
    [
        ("expandable_segment:True", "unknown key 'expandable_segment' (did you mean 'expandable_segments'?)"),
        ("max_split_size_mb:abc", "max_split_size_mb must be an integer > 20"),
        ("max_split_size_mb:16", "max_split_size_mb must be an integer > 20"),
        ("garbage_collection_threshold:1.5", "garbage_collection_threshold must be a number in (0, 1)"),
        ("expandable_segments:yes", "expandable_segments must be True or False"),
        ("backend:arena", "backend must be one of native"),
        ("roundup_power2_divisions:3", "roundup_power2_divisions must be a power of two"),
        ("expandable_segments", "must look like key:value"),
    ],
)
def test_bad_strings_name_the_setting(text, error):
    assert any(error in e for e in parse(text).errors), parse(text).errors


@pytest.mark.parametrize(
    "torch_version, hip, takes",
    [
        ("2.13.0+cpu", None, True),  # CUDA/CPU builds: since 2.1
        ("2.10.0+rocm7.0", ROCM_70, False),  # before the ROCm allocator had it
        ("2.11.0+rocm7.1", ROCM_70, None),  # PyTorch's 2.11 or AMD's release/2.11 with the backport
        ("2.12.0+rocm6.4", "6.4.43482-0f2d60242", False),  # gated to ROCm >= 7.0 (pytorch #179930)
        ("2.12.1+rocm7.0", ROCM_70, True),
        ("2.13.0+rocm7.2", "7.2.26015-fc0010cf6", True),  # #179781's gate (< 7.2) did not last
        (None, ROCM_70, None),  # the release unknown
    ],
)
def test_expandable_segments_is_judged_by_the_torch_release_and_the_rocm_version(torch_version, hip, takes):
    verdict, why = expandable_takes_effect(hip, torch_version)
    assert verdict is takes
    warned = check("expandable_segments:True", hip, torch_version=torch_version).warnings
    assert (warned == [why]) if takes is not True else (warned == [] and why == "")


def test_max_split_with_expandable_segments_is_warned_on_rocm_and_refused_by_the_trainer(monkeypatch):
    from memfit.config.schema import AllocatorConfig
    from memfit.errors import UserError
    from memfit.strategies.allocator import refuse_unsafe

    both = "expandable_segments:True,max_split_size_mb:512"
    assert any("pytorch #123548" in w for w in check(both, "7.2.26015", torch_version="2.13.0").warnings)
    assert check(both, None, torch_version="2.13.0").warnings == []  # CUDA: no known harm
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    cfg = AllocatorConfig(expandable_segments=True, max_split_size_mb=512)
    with pytest.raises(UserError, match=r"pytorch #123548.*set allocator.allow_unsafe=true to run it anyway"):
        refuse_unsafe(cfg, "7.2.26015")
    refuse_unsafe(cfg, None)
    refuse_unsafe(AllocatorConfig(expandable_segments=True, max_split_size_mb=512, allow_unsafe=True), "7.2.26015")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:256")  # half from the environment
    with pytest.raises(UserError, match="max_split_size_mb with expandable_segments:True"):
        refuse_unsafe(AllocatorConfig(expandable_segments=True), "7.2.26015")


def _segment(size, expandable=None, kind="large"):
    return {"total_size": size, "segment_type": kind, "is_expandable": expandable}


def test_the_live_probe_reads_the_allocators_segments():
    """The shapes memory_snapshot() gives for PROBE_BLOCKS allocations of PROBE_MIB MiB: one segment each when the
    setting was ignored, one growing segment (``is_expandable``, or a build without that key) when it was taken."""
    block = PROBE_MIB << 20
    assert judge_expandable_probe([_segment(block) for _ in range(PROBE_BLOCKS)])[0] is False
    assert judge_expandable_probe([_segment(PROBE_BLOCKS * block, True), _segment(2 << 20, False, "small")])[0]
    assert judge_expandable_probe([_segment(PROBE_BLOCKS * block)])[0] is True  # no is_expandable key
    assert judge_expandable_probe([_segment(block)])[0] is None
    r = report(
        env={"PYTORCH_HIP_ALLOC_CONF": "expandable_segments:True"},
        hip=ROCM_70,
        cuda=None,
        torch_version="2.12.0+rocm7.0",
        probe=[_segment(block) for _ in range(PROBE_BLOCKS)],
    )
    assert r["expandable_segments"]["expected"] is True and r["expandable_segments"]["probed"] is False
    assert any("unlike what this build's versions say" in w for w in r["warnings"])
    assert any(w.startswith("expandable_segments:True is set but live probe:") for w in r["warnings"])


def test_platform_no_ops_are_warned():
    assert rocm_version(ROCM_57) == (5, 7) and rocm_version(None) is None
    old = check("expandable_segments:True", ROCM_57, torch_version="2.13.0")
    assert any("ignored on ROCm 5.7" in w for w in old.warnings)
    assert check("expandable_segments:True", ROCM_70, torch_version="2.13.0").warnings == []
    assert check("expandable_segments:True", None).warnings == []
    gc = check("garbage_collection_threshold:0.8", None)
    assert any("only acts when a memory fraction is set" in w for w in gc.warnings)
    assert check("garbage_collection_threshold:0.8", None, memory_fraction_set=True).warnings == []


def test_report_on_a_recorded_rocm_build_environment():
    env = {
        "PYTORCH_HIP_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:10",
        "PYTORCH_ROCM_ALLOCATOR": "ARENA",
        "HSA_AMD_SDMA_MAX_WG_SIZE": "16",
    }
    r = report(env=env, hip=ROCM_57, cuda=None, torch_version="2.13.0+rocm5.7", probe=None)
    assert r["build"] == f"ROCm/HIP {ROCM_57}"
    assert any("ignored on ROCm 5.7" in w for w in r["warnings"])
    assert any("max_split_size_mb must be an integer > 20" in p for p in r["problems"])
    assert any(w.startswith("PYTORCH_ROCM_ALLOCATOR is set") and "PYTORCH_HIP_ALLOC_CONF" in w for w in r["warnings"])
    assert any(w.startswith("HSA_AMD_SDMA_MAX_WG_SIZE is set") and "HSA_ENABLE_SDMA" in w for w in r["warnings"])


def test_hip_variable_on_a_cuda_build_is_flagged():
    r = report(env={"PYTORCH_HIP_ALLOC_CONF": "expandable_segments:True"}, hip=None, cuda="12.8")
    assert any("not a ROCm build" in w for w in r["warnings"])


def test_a_variable_hidden_by_pytorch_alloc_conf_is_flagged():
    env = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    r = report(env=env, hip=None, cuda="12.8")
    assert any(w.startswith("PYTORCH_CUDA_ALLOC_CONF not read: PYTORCH_ALLOC_CONF is set") for w in r["warnings"])
    assert not any(
        "not read: PYTORCH_ALLOC_CONF" in w
        for w in report(env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, hip=None, cuda="12.8")["warnings"]
    )


def test_doctor_json_on_this_machine(capsys, monkeypatch):
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HSA_QUEUE_PRIORITY", "high")
    assert main(["doctor", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["torch"] and "gloo" in r["collectives"] and set(r["extras"]) >= {"deepspeed", "amdsmi", "nvidia-ml-py"}
    assert any("HSA_QUEUE_PRIORITY" in w and "torch.cuda.Stream(priority=-1)" in w for w in r["warnings"])


def test_doctor_exit_code_flags_problems(capsys, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:abc")
    assert main(["doctor"]) == 1
    assert (
        "problem: PYTORCH_CUDA_ALLOC_CONF: max_split_size_mb must be an integer > 20"
        in capsys.readouterr().out.replace("\n", " ")
    )
