"""One fake trace stands for a step at two micro-batches (``trace.steady_timelines``): traced at a prime micro-batch
that divides no size the batch does not make, each storage either scales with the batch or not, so the step at
B = 2 and 3 (the planner's line through micro-batches) is the same trace resized."""

import copy

import pytest

from memfit.config.schema import LoraConfig
from memfit.config.strategy import CheckpointPolicy, Strategy
from memfit.models.presets import preset_config
from memfit.planner.trace import BATCH_PRIMES, StepSpec, steady_timeline, steady_timelines


def _resized_and_traced(spec: StepSpec, layers: int):
    specs = [spec.with_strategy(micro_batch_size=b) for b in (2, 3)]
    return steady_timelines(specs, layers), [steady_timeline(s, layers) for s in specs]


def _rows(timeline):
    return [tuple(int(x) for x in r) for r in timeline.rows]


@pytest.mark.parametrize(
    "strategy, lora",
    [
        (Strategy(precision="fp32"), None),
        (Strategy(activation_checkpointing=CheckpointPolicy("full"), precision="bf16-mixed", loss_chunks=4), None),
        (Strategy(activation_checkpointing=CheckpointPolicy("ffn"), precision="bf16-pure"), LoraConfig(enabled=True)),
        (Strategy(activation_checkpointing=CheckpointPolicy("every_k", 2), precision="bf16-mixed"), None),
        (Strategy(precision="bf16-mixed", quantize_base="nf4", loss_chunks=3), LoraConfig(enabled=True)),
        (Strategy(precision="fp32", packing=True), LoraConfig(enabled=True, target_modules=["q_proj", "v_proj"])),
    ],
    ids=["fp32", "full-chunked", "ffn-lora-pure", "every_k", "nf4-chunked", "packed-qv"],
)
@pytest.mark.parametrize("round_to", [1, 512])
def test_one_trace_resized_to_each_batch_equals_a_trace_of_each(strategy, lora, round_to):
    spec = StepSpec(preset_config("tiny"), 64, strategy, lora, round_to, part="passes")
    resized, traced = _resized_and_traced(spec, 2)
    for r, t in zip(resized, traced):
        assert r.phases == t.phases and _rows(r) == _rows(t)
    assert _rows(resized[0]) != _rows(resized[1])  # the batch shows


def test_a_prime_that_divides_a_size_of_the_model_or_sequence_is_passed_over():
    """The first primes divide the MLP width, the sequence length and a loss chunk: a larger one is traced at."""
    cfg = copy.deepcopy(preset_config("tiny"))
    cfg.intermediate_size = BATCH_PRIMES[0] * 2
    seq_len = BATCH_PRIMES[1] * 2  # and chunks of BATCH_PRIMES[1]
    spec = StepSpec(cfg, seq_len, Strategy(precision="fp32", loss_chunks=2), part="passes")
    from memfit.planner import trace

    seen = []
    real = trace.batch_prime
    trace.batch_prime = lambda model, s: seen.append(real(model, s)) or seen[-1]
    try:
        resized, traced = _resized_and_traced(spec, 2)
    finally:
        trace.batch_prime = real
    assert seen == [BATCH_PRIMES[2]]
    for r, t in zip(resized, traced):
        assert r.phases == t.phases and _rows(r) == _rows(t)


def test_only_a_lines_specs_without_offloading_share_a_trace():
    spec = StepSpec(preset_config("tiny"), 64, Strategy(precision="fp32", micro_batch_size=2), part="passes")
    with pytest.raises(ValueError, match="differ in their micro-batch only"):
        steady_timelines([spec, spec.with_strategy(micro_batch_size=3, precision="bf16-mixed")], 2)
    offloaded = spec.with_strategy(activation_offload=True)
    with pytest.raises(ValueError, match="without offloading"):
        steady_timelines([offloaded, offloaded.with_strategy(micro_batch_size=3)], 2)


def test_without_a_prime_that_would_do_each_batch_is_traced(monkeypatch):
    from memfit.planner import trace

    monkeypatch.setattr(trace, "BATCH_PRIMES", (5,))  # divides the tiny preset's T = 64 + 1: none would do
    spec = StepSpec(preset_config("tiny"), 64, Strategy(precision="fp32"), part="passes")
    traced_at = []
    real = trace._traced
    monkeypatch.setattr(
        trace, "_traced", lambda s, *a, **k: traced_at.append(s.strategy.micro_batch_size) or real(s, *a, **k)
    )
    resized, traced = _resized_and_traced(spec, 2)
    assert traced_at[:3] == [2, 2, 3]  # the line's first spec (no prime: nothing traced), then each batch
    for r, t in zip(resized, traced):
        assert r.phases == t.phases and _rows(r) == _rows(t)
