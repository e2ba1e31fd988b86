"""The predictor traces a step in two parts (``StepSpec.part``): forward and backward without an optimizer
("passes"), and clipping with the optimizer step alone on gradients made for it ("update"). Each part's moments
are the whole step's, byte for byte and category by category, and the update's extrapolate from one and two
layers to any depth."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from memfit.config.schema import LoraConfig
from memfit.config.strategy import CheckpointPolicy, Strategy
from memfit.models.presets import preset_config
from memfit.planner.categories import Category
from memfit.planner.trace import StepSpec, extrapolate_regions, steady_timeline, trace_allocations

OPTIMIZER = list(Category).index(Category.OPTIMIZER)


def _moments(spec: StepSpec, part: str, layers: int, phases: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    peaks = steady_timeline(replace(spec, part=part), layers).region_peaks()
    return {k: v for k, v in peaks.items() if k.startswith(phases)}


@pytest.mark.parametrize(
    "lora, precision, ac, levers",
    [
        (False, "fp32", "none", {}),
        (False, "bf16-mixed", "full", {"grad_accum_steps": 2}),
        (False, "fp16-mixed", "every_k:2", {"loss_chunks": 4}),
        (True, "bf16-mixed", "ffn", {"packing": True}),
        (True, "fp32", "full", {"activation_offload": True}),
        (True, "bf16-pure", "none", {"loss_chunks": 4, "packing": True}),
    ],
)
def test_passes_hold_the_forward_and_backward_moments_of_the_whole_step(lora, precision, ac, levers):
    """Every forward and backward moment, each category but the optimizer state (the whole step's comes from its
    own AdamW; the predictor takes the candidate's from the update), equal to the byte."""
    strategy = Strategy(
        precision=precision, activation_checkpointing=CheckpointPolicy.parse(ac), micro_batch_size=2, **levers
    )
    spec = StepSpec(preset_config("tiny"), 64, strategy, LoraConfig() if lora else None, round_to=512)
    step, passes = (_moments(spec, part, 4, ("forward", "backward")) for part in ("step", "passes"))
    assert step.keys() == passes.keys() and len(step) > 100
    drop = lambda row: row[:OPTIMIZER] + row[OPTIMIZER + 1 :]  # noqa: E731
    assert {k: drop(v) for k, v in passes.items()} == {k: drop(v) for k, v in step.items()}
    assert any(v[list(Category).index(Category.GRADS)] for v in passes.values())  # gradients counted as such


@pytest.mark.parametrize(
    "lora, precision, levers",
    [
        (False, "fp32", {"optimizer": "for-loop"}),
        (False, "bf16-mixed", {"optimizer": "foreach", "packing": True}),
        (False, "bf16-pure", {"optimizer_name": "adamw8bit", "optimizer": "for-loop"}),
        (True, "bf16-mixed", {"optimizer": "fused", "quantize_base": "nf4"}),
        (True, "bf16-pure", {"optimizer_name": "adamw4bit", "optimizer": "for-loop"}),
        (True, "fp32", {"optimizer": "fused", "optimizer_offload": True}),
    ],
)
@pytest.mark.parametrize("round_to", [1, 512])
def test_the_update_alone_holds_the_whole_steps_update_moments(lora, precision, levers, round_to):
    """Clipping and the optimizer step traced on gradients made for them equal those after a traced backward,
    every category to the byte: the step's loss and the token ids a trainable embedding saved are counted as
    backward leaves them."""
    strategy = Strategy(precision=precision, micro_batch_size=2, **levers)
    spec = StepSpec(preset_config("tiny"), 64, strategy, LoraConfig() if lora else None, round_to=round_to)
    step, update = (_moments(spec, part, 2, ("clip", "optimizer")) for part in ("step", "update"))
    assert set(step) == {"clip", "optimizer"}
    assert update == step


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize(
    "lora, levers",
    [
        (False, {"optimizer": "for-loop"}),
        (False, {"optimizer": "foreach"}),
        (False, {"optimizer_name": "adamw4bit", "optimizer": "for-loop"}),
        (True, {"optimizer_name": "adamw8bit", "optimizer": "for-loop", "quantize_base": "nf4"}),
        (True, {"optimizer": "fused", "optimizer_offload": True}),
    ],
)
def test_update_moments_extrapolate_from_one_and_two_layers(tied, lora, levers):
    """What the predictor reads (``Predictor._optimizer_depths``) gives the 6-layer update exactly."""
    cfg = copy.deepcopy(preset_config("tiny"))
    cfg.num_hidden_layers, cfg.tie_word_embeddings = 6, tied
    strategy = Strategy(precision="bf16-mixed", micro_batch_size=2, **levers)
    spec = StepSpec(cfg, 64, strategy, LoraConfig() if lora else None, round_to=512)
    one, two, six = (_moments(spec, "update", n, ("clip", "optimizer")) for n in (1, 2, 6))
    assert extrapolate_regions(one, two, 1, 2, 6) == six
    assert six["optimizer"] != two["optimizer"]  # depth shows: the comparison is not of constants


def test_several_steps_are_traced_whole_only():
    with pytest.raises(ValueError, match="whole step"):
        trace_allocations(StepSpec(preset_config("tiny"), 64, part="passes"), 2, steps=2)
