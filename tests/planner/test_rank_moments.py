"""What a rank holds at each moment of a step: where each traced moment is in the step, what FSDP2's ZeRO-3 holds
gathered there, and a trace whose gradients are summed as a step without a trace sums them.

The per-rank peaks themselves are measured against torch.profiler on two real ranks in
``tests/integration/test_two_ranks.py`` (``test_per_rank_profiled_peak_matches_the_planner``)."""

import copy

import numpy as np
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

from memfit.config.strategy import Strategy
from memfit.models.presets import preset_config
from memfit.planner.categories import PHASES
from memfit.planner.predict import Predictor
from memfit.planner.sharding import moment_places, zero3_gathered
from memfit.planner.trace import StepSpec
from memfit.planner.tracker import StepTracker
from memfit.step.loss import ChunkedLoss
from memfit.telemetry.profiler import allocation_events, peak_of

STEP = (
    "forward",  # before the model's forward: every group sharded
    "forward:outer#0+0",  # the embeddings: the root group gathered, its all-gather's output kept; layer 0's at its end
    "forward:first#0+0",
    "forward:first#0+1",
    "forward:last#0+0",  # a layer's start: the previous layer's all-gather output is freed after this one's copy-out
    "forward:last#0+1",
    "forward:outer#1+0",  # the final norm and head: the last layer's output kept until the root's post-forward
    "forward:loss#0+0",  # the loss, outside the model
    "backward:loss#0+0",  # its backward, before the gradient of the model's output
    "backward:outer#0+0",  # the head's: the last layer prefetched
    "backward:last#0+0",
    "backward:first#0+0",
    "backward:outer#1+0",  # the embeddings', after every layer's
    "clip",
)


def test_zero3_holds_at_each_place_what_fsdp2_holds():
    """Layers and root groups held whole per moment, as read from FSDP2's hooks (benchmarks/fsdp2_gathered_layers.py)
    and from the per-rank profiles of two real ranks (benchmarks/RESULTS.md, fortieth session)."""
    phases = np.array([PHASES.index(k.partition(":")[0]) for k in STEP])
    layers, roots = zero3_gathered(phases, moment_places(STEP))
    assert layers.tolist() == [0, 2, 2, 2, 3, 2, 1, 0, 0, 1, 2, 2, 0, 0]
    assert roots.tolist() == [0, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]


def test_chunked_loss_moments_keep_their_place_in_the_step():
    """A chunked loss's moments are traced apart and put in place of the unchunked ones where they ran: a rank's rules
    read where a moment is (ZeRO-3 held no layer gathered at the head's backward when it came last)."""
    cfg = copy.deepcopy(preset_config("tiny"))
    cfg.num_hidden_layers = 6
    predictor = Predictor(StepSpec(cfg, 64))
    strategy = Strategy(precision="fp32", optimizer="foreach", micro_batch_size=2, loss_chunks=4)
    keys = predictor._passes(predictor._step_spec(strategy), 2).keys
    segments = list(dict.fromkeys(k.rsplit("+", 1)[0] for k in keys))
    assert segments == [
        "forward",
        "forward:outer#0",
        "forward:first#0",
        "forward:last#0",
        "forward:outer#1",
        "forward:loss#0",
        "backward:loss#0",
        "backward:outer#0",
        "backward:last#0",
        "backward:first#0",
        "backward:outer#1",
    ], segments


def test_a_trace_sums_gradients_in_place_where_a_step_without_one_does():
    """Under any dispatch mode autograd sums two gradients of one tensor out of place; without one, in place where
    nothing else holds the first. A tied embedding's gradient under a chunked loss (four chunks summed, then the
    embeddings' added) took three more vocabulary-sized buffers under the tracker than without it, and the profiled
    peak one more; with the tracker summing in place as the engine would, the same allocations, peak and gradient."""
    cfg = LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, 64))
    vocab_sized = cfg.vocab_size * cfg.hidden_size * 4
    for chunks in (0, 4):
        model = LlamaForCausalLM(cfg)
        chunked = ChunkedLoss.attach(model, chunks)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def loss():
            if chunked:
                with chunked.targets(ids):
                    return model(input_ids=ids).logits
            logits = model(input_ids=ids).logits.float()
            return F.cross_entropy(logits.view(-1, cfg.vocab_size), ids.view(-1), reduction="sum")

        seen = []
        for tracked in (False, True):
            model.zero_grad(set_to_none=True)
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                if tracked:
                    tracker = StepTracker(model, optimizer)
                    with tracker:
                        tracker.track([*model.parameters(), ids])
                        loss().backward()
                else:
                    loss().backward()
            events = allocation_events(prof, "cpu")
            big = sum(1 for _, _, n in events if n >= vocab_sized)
            seen.append((big, peak_of(events), model.model.embed_tokens.weight.grad.clone()))
        (big, peak, grad), (big_traced, peak_traced, grad_traced) = seen
        assert (big_traced, peak_traced) == (big, peak), (chunks, seen[0][:2], seen[1][:2])
        torch.testing.assert_close(grad_traced, grad)
