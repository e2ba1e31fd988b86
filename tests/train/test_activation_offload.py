"""strategy.activation_offload: saved tensors in host memory between forward and backward. The same losses,
the planner against real tensors (device bytes as a GPU holds them, host bytes apart), and the search."""

import pytest
import torch
from support.tiny import wide_tiny_config

from memfit.config.strategy import CheckpointPolicy, Strategy
from memfit.planner.categories import DEVICE_CATEGORIES, Category
from memfit.planner.cost import offload_time_s
from memfit.planner.measure import measured_steady_step
from memfit.planner.predict import Predictor
from memfit.planner.trace import StepSpec, trace_step
from memfit.strategies.offload import ActivationOffload, observing
from memfit.train.loop import Trainer


def _wide_tiny(layers: int = 8):
    return wide_tiny_config(layers)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_offloaded_activations_train_the_same_losses(tiny_cfg, tmp_path, lora):
    """fp32 on CPU: the saved tensors' values come back bit for bit, so the losses are the plain run's."""
    results = {}
    for offload in (False, True):
        trainer = Trainer(
            tiny_cfg(
                "train.max_steps=3",
                "data.seq_len=128",
                "strategy.activation_checkpointing=ffn",
                f"lora.enabled={str(lora).lower()}",
                f"strategy.activation_offload={str(offload).lower()}",
                f"output.dir={tmp_path}/o{offload}",
            )
        )
        assert (trainer.runner.offload is not None) == offload
        results[offload] = trainer.fit()
    plain, offloaded = results[False], results[True]
    assert offloaded.summary.predicted_peak_bytes and offloaded.summary.predicted_step_time_s  # the fit check ran
    assert [r["loss"] for r in offloaded.steps] == pytest.approx([r["loss"] for r in plain.steps], rel=1e-6)
    assert [e["eval_loss"] for e in offloaded.evals] == pytest.approx([e["eval_loss"] for e in plain.evals], rel=1e-6)


def test_offload_copies_each_saved_tensor_once_and_gives_back_equal_values():
    """A tensor saved twice (x * x) is copied once; parameters and small tensors stay; gradients are exact."""
    lin = torch.nn.Linear(256, 512)
    x = torch.randn(4, 256, 256, requires_grad=True)
    packs = []
    with observing(lambda t, packed: packs.append((t, packed)), lambda *_: None):
        with ActivationOffload(torch.device("cpu"), copies_back=True):
            y = lin(x * x).relu().sum()
    y.backward()
    got = x.grad.clone()
    x.grad = None
    lin.zero_grad()
    lin(x * x).relu().sum().backward()
    assert torch.equal(got, x.grad)
    offloaded = [p for t, p in packs if p is not t]
    assert any(t._base is lin.weight for t, _ in packs)  # a matmul saves weight.t(), a view of the parameter
    assert all(p is t for t, p in packs if t._base is lin.weight)  # which is not copied
    assert len({id(p) for p in offloaded}) < len(offloaded)  # x, saved by mul twice, has one host copy


@pytest.mark.parametrize("micro_batch", [1, 2])
def test_a_chunked_loss_over_a_frozen_head_recomputes_from_offloaded_copies(micro_batch):
    """LoRA leaves the output projection frozen. At micro-batch 1 a chunk of the sequence counts as contiguous
    with a stride no host copy keeps, and a frozen weight's matmul folds a 3-D input into rows only where its
    strides allow: forward took a batched matmul and the recomputation from the offloaded copy an mm, and
    checkpointing refused the step (on Llama-2-7B at 512 tokens, where a chunk passes the offload threshold)."""
    from memfit.step.loss import ChunkedLoss

    torch.manual_seed(0)
    body = torch.nn.Linear(16, 64)
    head = torch.nn.Linear(64, 100, bias=False).requires_grad_(False)
    x, y = torch.randn(micro_batch, 32, 16), torch.randint(0, 100, (micro_batch, 32))
    plain = torch.nn.functional.cross_entropy(head(body(x)).flatten(0, 1), y.flatten(), reduction="sum")
    plain.backward()
    expected, body.weight.grad = body.weight.grad, None
    chunked = ChunkedLoss(head, 4)
    with ActivationOffload(torch.device("cpu"), copies_back=True, min_bytes=0), chunked.targets(y):
        loss = head(body(x))  # the summed loss, chunk by chunk
    loss.backward()
    assert loss.item() == pytest.approx(plain.item(), rel=1e-6)
    torch.testing.assert_close(body.weight.grad, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "ac, precision, lora",
    [("none", "fp32", False), ("ffn", "bf16-mixed", True), ("every_k:2", "bf16-pure", False), ("full", "fp32", True)],
)
def test_planner_predicts_offloaded_activations_as_the_profiler_measures_them(ac, precision, lora):
    """The planner's prediction (depths extrapolated, as ``memfit plan`` computes it) against torch.profiler on
    a real step: device categories within 3% each as a GPU holds them (host copies apart, copies back into new
    buffers), host bytes within 5%; as a CPU run holds them (one memory), activations and host copies together;
    and the saving against the step without offloading is the measured one."""
    from memfit.config.schema import LoraConfig

    cfg = _wide_tiny()
    lora_cfg = LoraConfig(enabled=True) if lora else None
    strategy = Strategy(
        activation_checkpointing=CheckpointPolicy.parse(ac),
        precision=precision,
        optimizer="foreach",
        micro_batch_size=2,
        activation_offload=True,
    )
    predicted = Predictor(StepSpec(cfg, 256, lora=lora_cfg)).predict(strategy)
    measured = measured_steady_step(StepSpec(cfg, 256, strategy, lora_cfg))
    for c in DEVICE_CATEGORIES:
        assert abs(predicted.peak[c] - measured[c]) <= 0.03 * measured[c], (
            c,
            predicted.peak.as_dict(),
            measured.as_dict(),
        )
    assert measured[Category.HOST] > 0
    assert abs(predicted.host_peak_bytes - measured[Category.HOST]) <= 0.05 * measured[Category.HOST]

    on_cpu = Predictor(StepSpec(cfg, 256, lora=lora_cfg, host_is_device=True)).predict(strategy).peak
    one_memory = measured_steady_step(StepSpec(cfg, 256, strategy, lora_cfg, host_is_device=True))
    together = one_memory[Category.ACTIVATIONS] + one_memory[Category.HOST]
    assert abs(on_cpu[Category.ACTIVATIONS] - together) <= 0.03 * together
    assert abs(on_cpu.total_bytes - (one_memory.total_bytes + one_memory.host_bytes)) <= 0.03 * on_cpu.total_bytes

    plain = strategy.replace(activation_offload=False)
    measured_plain = measured_steady_step(StepSpec(cfg, 256, plain, lora_cfg))
    predicted_plain = Predictor(StepSpec(cfg, 256, lora=lora_cfg)).predict(plain)
    saved = measured_plain.total_bytes - measured.total_bytes
    assert abs((predicted_plain.peak_bytes - predicted.peak_bytes) - saved) <= 0.01 * measured_plain.total_bytes


def test_predicted_fallback_levers_equal_direct_traces():
    """Offloading and the step in backward, alone and together, every policy, chunked or not, several
    micro-batches: the prediction from two depths equals a direct trace at 10 layers, device categories and
    host bytes (the step in backward: no optimizer phase, every step ran inside backward)."""
    cfg = _wide_tiny(10)
    predictor = Predictor(StepSpec(cfg, 256))
    for ac, chunks, mb, offload, in_backward in (
        ("none", 0, 2, True, False),
        ("every_k:2", 4, 3, True, True),
        ("ffn", 4, 1, True, False),
        ("full", 0, 3, True, True),
        ("full", 4, 2, True, False),
        ("none", 0, 1, False, True),
        ("full", 4, 3, False, True),
    ):
        strategy = Strategy(
            activation_checkpointing=CheckpointPolicy.parse(ac),
            precision="bf16-mixed",
            optimizer="foreach",
            micro_batch_size=mb,
            loss_chunks=chunks,
            activation_offload=offload,
            optimizer_in_backward=in_backward,
        )
        case = (ac, chunks, mb, offload, in_backward)
        predicted, direct = predictor.predict(strategy), trace_step(StepSpec(cfg, 256, strategy))
        for c in DEVICE_CATEGORIES:
            assert abs(predicted.peak[c] - direct.peak[c]) <= 0.005 * direct.peak_bytes, (case, c)
        assert predicted.host_peak_bytes == pytest.approx(direct.host_peak_bytes, rel=0.005), case
        assert ("optimizer" in direct.phase_peaks) != in_backward, case


def test_offloading_costs_what_compute_does_not_hide():
    """Long sequences hide the copies behind compute; short ones do not (the published anchors' two cases)."""
    assert offload_time_s(0, 25.0, 1.0, lora=False) == 0.0
    assert offload_time_s(10 * 10**9, 25.0, 3.0, lora=False) == 0.0  # 0.4 s each way under 0.5 s / 1 s hidden
    short = offload_time_s(10 * 10**9, 25.0, 0.3, lora=False)  # 0.4 s each way, 0.05 s / 0.1 s hidden
    assert short == pytest.approx(0.35 + 0.30)


def test_search_tries_offloading_where_the_twin_without_it_does_not_fit():
    """memfit plan's search: a fallback lever (offload, step in backward) is traced only for candidates whose
    twin without it does not fit (offloading only when nothing fits without it), and then it is a candidate like
    any other, host bytes beside. 617 MiB (586 usable): the smallest plain candidate needs 588 MiB with the
    runtime context, offloading candidates 584-585."""
    from memfit.planner.hardware import custom_gpu
    from memfit.planner.search import Cluster, Pins, Workload, search

    w = Workload(_wide_tiny(), "wide-tiny", 1024, 2)
    # the optimizer in host memory (a fallback tried before offloading activations) pinned off: this is about the latter
    pins = Pins({"optimizer": "foreach", "loss_chunks": 0, "precision": "bf16-pure", "optimizer_offload": False})
    r = search(w, Cluster(custom_gpu(617 << 20)), pins)
    done = {c.strategy: c for c in (*r.fitting, *r.pruned)}
    twins = {s: done[s.replace(activation_offload=False, optimizer_in_backward=False)] for s in done}
    fallbacks = [s for s in done if s.activation_offload or s.optimizer_in_backward]
    assert fallbacks
    assert all(not twins[s].fits for s in fallbacks)
    rescued = [s for s in fallbacks if done[s].fits and s.activation_offload]
    assert rescued and all(done[s].memory.host_peak_bytes > 0 for s in rescued)
    assert all(done[s].memory.host_peak_bytes == 0 for s in done if not s.activation_offload)
    assert r.best is not None and r.best.strategy.activation_offload
    roomy = search(w, Cluster(custom_gpu(737 << 20)), pins)  # plain candidates fit: offloading is not tried
    assert roomy.best is not None and not any(c.strategy.activation_offload for c in (*roomy.fitting, *roomy.pruned))
    assert roomy.untried > 0
