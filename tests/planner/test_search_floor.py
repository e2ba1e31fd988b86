"""The search's floor under fallback levers (``planner.floor``): two candidates that differ only in levers that declare
their forward changes hold every other category alike in forward, so either's prediction bounds the other's peak from
below and the search leaves a fallback untraced where that bound alone does not fit. Held here against every pair of
relatives of narrowed searches (the bound is only as good as each lever's declaration)."""

import itertools

import pytest

from memfit.config.schema import LoraConfig
from memfit.config.strategy import CheckpointPolicy, fallbacks
from memfit.models.presets import preset_config
from memfit.planner.floor import Relatives, family, forward_changes, forward_floor_bytes
from memfit.planner.hardware import gpu_preset
from memfit.planner.search import Cluster, Pins, Workload, evaluate, reserved_estimate, search, search_space


def predicted_space(lora: bool, gpus: int, pins: dict, engine: str = "fsdp2"):
    w = Workload(preset_config("tiny"), "tiny", 64, 4, LoraConfig(enabled=True) if lora else None)
    c = Cluster(gpu_preset("a100-80g"), gpus)
    p = Pins(pins, engine=engine)
    result = search(w, c, p)
    return p, {s: evaluate(s, result, result.predictor).memory for s in search_space(w, c, p)}


@pytest.mark.parametrize(
    "lora, gpus, engine, pins, levers",
    [
        # one GPU, LoRA: an NF4 base, low-bit states, the step in backward, activation and optimizer offload
        (
            True,
            1,
            "fsdp2",
            {
                "precision": "bf16-mixed",
                "micro_batch_size": 4,
                "loss_chunks": 0,
                "activation_checkpointing": CheckpointPolicy("ffn"),
            },
            {"quantize_base", "optimizer_name", "optimizer_in_backward", "activation_offload", "optimizer_offload"},
        ),
        # two GPUs, a full fine-tune: FSDP2's CPUOffloadPolicy (the parameter shards on the host), DeepSpeed's
        # offload_optimizer, activation offloading
        (
            False,
            2,
            "fsdp2",
            {"precision": "bf16-mixed", "micro_batch_size": 2},
            {"activation_offload", "optimizer_offload"},
        ),
        (False, 2, "deepspeed", {"precision": "bf16-pure", "micro_batch_size": 1}, {"optimizer_offload"}),
    ],
    ids=["lora-1gpu", "full-fsdp2-2gpus", "full-deepspeed-2gpus"],
)
def test_a_candidate_holds_at_least_what_each_relative_sets_under_it(lora, gpus, engine, pins, levers):
    p, memory = predicted_space(lora, gpus, pins, engine)
    assert {n for s in memory for n in fallbacks(s, p.levers)} == levers  # every fallback this cluster has
    bounded = undeclared = one_rank = 0
    for a, b in itertools.permutations(memory, 2):
        if family(a) != family(b):
            continue
        # what b holds in forward, less what the levers they differ in change, a holds in its own forward pass
        forward = memory[a].phase_peaks["forward"].total_bytes
        floor = forward_floor_bytes(memory[b], forward_changes(a, b, sharded=gpus > 1))
        assert floor <= forward <= memory[a].peak_bytes, (a, b, floor, forward)
        bounded += floor > 0
        # each lever's declaration is needed: without it the bound would not hold
        undeclared += forward_floor_bytes(memory[b], frozenset()) > forward
        one_rank += forward_floor_bytes(memory[b], forward_changes(a, b, sharded=False)) > forward
    assert bounded >= 50 and undeclared > 0
    # FSDP2's CPUOffloadPolicy moves the parameter shards (``Lever.sharded_changes``); DeepSpeed's offload_optimizer not
    assert (one_rank > 0) == (engine == "fsdp2" and gpus > 1)


def test_the_search_leaves_untraced_only_fallbacks_a_relative_shows_cannot_fit():
    """A GPU one byte short of what the highest floor the plain candidates set needs: the search traces none of the
    fallbacks bounded out, each of them predicted now does not fit, and it still traces those the bound allows."""
    w = Workload(preset_config("tiny"), "tiny", 64, 4, LoraConfig(enabled=True))
    c = Cluster(gpu_preset("a100-80g"), 1)
    p = Pins(
        {
            "precision": "bf16-mixed",
            "micro_batch_size": 4,
            "loss_chunks": 0,
            "activation_checkpointing": CheckpointPolicy("none"),
        }
    )
    roomy = search(w, c, p)
    reserved = {s: evaluate(s, roomy, roomy.predictor).reserved_bytes for s in search_space(w, c, p)}
    relatives = Relatives(sharded=False)
    for s in reserved:
        if not fallbacks(s, p.levers):
            relatives.add(s, evaluate(s, roomy, roomy.predictor).memory)
    floors = {s: relatives.floor_bytes(s) for s in reserved if fallbacks(s, p.levers)}
    usable = reserved_estimate(max(floors.values())) - 1
    tight = search(w, c, p, headroom=1 - (usable + 0.5) / c.gpu.memory_bytes)
    assert tight.usable_bytes == usable
    traced = {k.strategy for k in tight.fitting + tight.pruned}
    untraced = set(reserved) - traced
    assert untraced and tight.untried == len(untraced)
    assert all(reserved[s] > usable for s in untraced)  # none of them would have fit
    assert {s for s, f in floors.items() if reserved_estimate(f) > usable} <= untraced
    assert any(fallbacks(s, p.levers) for s in traced)  # fallbacks with a lower floor are traced
