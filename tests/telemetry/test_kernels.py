"""train.kernel_profile_every: a profiled step's top kernels (CPU ops here) by self time and their share of the
step, in the step record, the summary and the trainer's endpoint (a bounded label set), with what it cost."""

import pytest
import torch
from support.scrape import scrape

from memfit.telemetry.kernels import TOP_KERNELS, KernelProfiler, top_kernels
from memfit.train.loop import Trainer


def test_top_kernels_orders_by_self_time_and_sums_the_rest():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(key, us, count, device=DeviceType.CPU):
        return SimpleNamespace(
            key=key, self_cpu_time_total=us, self_device_time_total=us, count=count, device_type=device
        )

    events = [event("aten::sum", 300, 20), event("aten::mm", 900, 20), event("aten::empty", 0, 5)]
    events += [event("aten::relu_", 500, 20), event("gemm_kernel", 7000, 3, DeviceType.CUDA)]
    top = top_kernels(events, on_gpu=False, step_s=0.01, top=2)
    assert [(k["name"], k["calls"]) for k in top] == [("aten::mm", 20), ("aten::relu_", 20), ("other", 0)]
    assert [k["self_time_s"] for k in top] == pytest.approx([900e-6, 500e-6, 300e-6])
    assert [k["share"] for k in top] == pytest.approx([0.09, 0.05, 0.03])  # of a 10 ms step
    assert [k["name"] for k in top_kernels(events, on_gpu=True, step_s=1.0)] == ["gemm_kernel"]  # nothing else
    assert [k["name"] for k in top_kernels(events, on_gpu=False, step_s=1.0, top=3)][-1] == "aten::sum"  # no rest


def test_top_kernels_reads_a_real_profile_whole():
    """On real profiler events (their times vary with the machine's load; which op leads is not asserted): every op
    with self time is counted once, in the top or in ``other``."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            (a @ b).relu_().sum()
    events = prof.key_averages()
    every = top_kernels(events, on_gpu=False, step_s=1.0, top=1000)
    assert {"aten::mm", "aten::relu_", "aten::sum"} <= {k["name"] for k in every}
    assert next(k["calls"] for k in every if k["name"] == "aten::mm") == 20
    top = top_kernels(events, on_gpu=False, step_s=1.0, top=2)
    assert len(top) == 3 and top[-1]["name"] == "other" and top[0]["self_time_s"] >= top[1]["self_time_s"] > 0
    assert sum(k["self_time_s"] for k in top) == pytest.approx(sum(k["self_time_s"] for k in every))


def test_the_interval_stretches_when_a_profile_costs_more_than_one_percent():
    p = KernelProfiler(5, torch.device("cpu"))
    assert not p.due(4) and p.due(5)
    _, rec = p.profile(lambda: torch.randn(64, 64).sum(), step=5, last_step_s=1e-6)  # costs far more than 1%
    assert rec["kernel_profile_every"] > 5 and p.next_step == 5 + rec["kernel_profile_every"]
    assert rec["kernel_profile_cost_s"] >= 0 and rec["kernels_of"] == "CPU ops"


def test_a_run_profiles_its_kernels_and_serves_the_top_ones(tiny_cfg):
    trainer = Trainer(tiny_cfg("train.metrics_port=0", "train.max_steps=4", "train.kernel_profile_every=2"))
    try:
        result = trainer.fit()
        profiled = [r for r in result.steps if "kernels" in r]
        assert profiled and profiled[0]["step"] == 2 and all(r["step"] >= 2 for r in profiled)
        top = profiled[-1]["kernels"]
        assert 1 < len(top) <= TOP_KERNELS + 1 and any(k["name"].startswith("aten::") for k in top)
        assert 0 < sum(k["share"] for k in top) and all(k["share"] >= 0 for k in top)
        summary = result.summary
        assert summary.kernels == top and summary.kernel_profiles == len(profiled)
        got = scrape(trainer.metrics_port)
        served = {s.labels["kernel"]: s.value for s in got["memfit_kernel_self_seconds"]}
        assert served == {k["name"]: pytest.approx(k["self_time_s"]) for k in top}
    finally:
        trainer.close()
