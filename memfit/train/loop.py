"""The single-device fine-tuning loop (CUDA, ROCm or CPU) with every memory strategy from the config.

Order matters and is kept here in one place: allocator settings before the first GPU allocation;
model built in the precision's parameter dtype; LoRA adapters before activation-checkpoint wrappers
(so the wrappers hold the adapted layers); optimizer over trainable parameters only.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers.utils import logging as hf_logging

from memfit.config.schema import RunConfig
from memfit.device import device_name, resolve_device
from memfit.errors import OutOfMemoryExit, UserError
from memfit.memory.categories import StepMemory
from memfit.memory.plan import check_fits, predict_run
from memfit.memory.snapshot import analyze
from memfit.models.load import build_model, load_tokenizer, model_config, resolve_source
from memfit.strategies.allocator import apply_allocator_env, apply_device_limits, maybe_release_cache
from memfit.strategies.checkpointing import apply_activation_checkpointing
from memfit.strategies.lora import apply_lora
from memfit.strategies.optimizer import build_optimizer, build_scheduler, resolve_implementation
from memfit.strategies.precision import Precision, resolve_precision
from memfit.telemetry.display import TrainDisplay, summary_tables
from memfit.telemetry.memory import GIB, memory_record, process_rss_bytes, reset_peaks, state_bytes
from memfit.telemetry.oom import oom_request_bytes
from memfit.telemetry.prometheus import TrainerMetrics
from memfit.train.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from memfit.train.data import IGNORE_INDEX, eval_batches, load_dataset, split, train_loader
from memfit.train.export import export_model
from memfit.train.run_dir import MetricsLog, prepare_run_dir, write_config


def token_loss_sum(model, tokens: torch.Tensor, labels: torch.Tensor, precision, device) -> torch.Tensor:
    """Summed next-token cross-entropy over supervised positions, from fp32 logits.

    Args:
        tokens: (B, T+1) token ids; the model reads tokens[:, :-1].
        labels: (B, T+1) targets with IGNORE_INDEX where no loss is taken; scored on labels[:, 1:].
    """
    with precision.autocast(device):
        logits = model(input_ids=tokens[:, :-1]).logits  # (B, T, V)
    return F.cross_entropy(
        logits.float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


@dataclass
class StepRunner:
    """One optimizer step of the trainer; the planner traces this same object under FakeTensorMode."""

    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    precision: Precision
    device: torch.device
    grad_clip: float
    scaler: torch.amp.GradScaler | None = None

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward over ``batches`` (gradient accumulation), clip, optimizer step, free grads.

        The loss is normalised by the supervised tokens of the whole step, so accumulation over k
        micro-batches gives the same update as one batch k times larger.

        Returns:
            (loss, grad_norm) as 0-d tensors; loss is the mean token loss of the step.
        """
        # a tensor, not an int: no host sync, and traceable under FakeTensorMode
        n_tokens = sum((labels[:, 1:] != IGNORE_INDEX).sum() for _, labels in batches).clamp_min(1).to(self.device)
        loss_sum = torch.zeros((), device=self.device)
        for tokens, labels in batches:
            tokens = tokens.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            loss = token_loss_sum(self.model, tokens, labels, self.precision, self.device) / n_tokens
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            loss_sum += loss.detach()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip or float("inf"))
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        return loss_sum, grad_norm

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


@dataclass
class TrainResult:
    run_dir: Path
    steps: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


class Trainer:
    """Builds everything a run needs from a validated ``RunConfig``; ``fit()`` trains and exports.

    Raises (from the constructor):
        UserError: any problem with the config that shows once files and the device are known.
    """

    def __init__(self, cfg: RunConfig, display_console=None):
        self.cfg = cfg
        t = cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        random.seed(t.seed)
        torch.manual_seed(t.seed)
        apply_allocator_env(cfg.allocator)  # before anything allocates on a GPU
        self.device = resolve_device(t.device)
        self.precision = resolve_precision(cfg.strategy.precision, self.device)
        self.run, self.resume_from = prepare_run_dir(cfg)

        source = resolve_source(cfg.model.source)  # may convert the embedded GGUF (with its progress bar)
        hf_logging.disable_progress_bar()  # loading/saving bars would tear the training display
        mconf = model_config(source, cfg.model)
        if cfg.data.seq_len > mconf.max_position_embeddings:
            raise UserError(
                f"data.seq_len {cfg.data.seq_len} exceeds the model's max_position_embeddings "
                f"{mconf.max_position_embeddings}; lower data.seq_len"
            )
        self.tokenizer = load_tokenizer(source)
        if len(self.tokenizer) > mconf.vocab_size:
            raise UserError(
                f"model.source: the tokenizer has {len(self.tokenizer)} tokens but the model only "
                f"{mconf.vocab_size} embeddings; use a checkpoint directory with its own tokenizer"
            )
        self.source = source
        train_ds, eval_ds = split(load_dataset(cfg.data, self.tokenizer), cfg.data.eval_fraction)
        self.train_ds, self.eval = train_ds, eval_batches(eval_ds, t.micro_batch_size, t.eval_batches)

        self.predicted = self._plan_check(mconf) if t.plan_check else None
        self.baseline_rss_bytes = process_rss_bytes()
        model = build_model(source, cfg.model, self.precision.param_dtype, t.seed)
        if cfg.lora.enabled:
            model = apply_lora(model, cfg.lora)
        self.wrapped = apply_activation_checkpointing(model, cfg.strategy.activation_checkpointing)
        self.model = model.to(self.device)
        self.notes = apply_device_limits(cfg.allocator, self.device)
        if self.device.type == "cuda" and t.record_memory_history:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        elif t.record_memory_history or t.snapshot_at_step is not None:
            self.notes.append("train.record_memory_history / snapshot_at_step apply to CUDA/ROCm devices only")

        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, cfg.optimizer, self.device)
        self.scheduler = build_scheduler(self.optimizer, t.max_steps, cfg.optimizer)
        self.scaler = torch.amp.GradScaler(self.device.type) if self.precision.grad_scaler else None
        self.runner = StepRunner(
            self.model, self.params, self.optimizer, self.precision, self.device, cfg.optimizer.grad_clip, self.scaler
        )
        self.display_console = display_console
        self.metrics: TrainerMetrics | None = None
        self.metrics_port: int | None = None

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        """One optimizer step; returns (mean token loss, gradient norm before clipping)."""
        loss, grad_norm = self.runner.step(batches)
        return float(loss), float(grad_norm)

    def _plan_check(self, mconf) -> StepMemory:
        """Predict this run's steady-state step peak (memfit plan's engine) before allocating anything.

        Raises:
            UserError: on a GPU, when the prediction does not fit its memory (or memory_fraction).
        """
        cfg, gpu = self.cfg, self.device.type == "cuda"
        impl = resolve_implementation(cfg.optimizer.implementation, self.device)
        step = predict_run(mconf, cfg.data.seq_len, cfg.train.micro_batch_size, cfg.train.grad_accum_steps,
                           cfg.strategy.activation_checkpointing, self.precision.name, impl,
                           cfg.lora if cfg.lora.enabled else None, on_gpu=gpu)
        if gpu:
            capacity = int(torch.cuda.get_device_properties(self.device).total_memory * (cfg.allocator.memory_fraction or 1.0))
            check_fits(step, capacity, device_name(self.device))
        return step

    # -- pieces -----------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss over the fixed held-out batches."""
        self.model.eval()
        total, count = 0.0, 0
        for tokens, labels in self.eval:
            tokens, labels = tokens.to(self.device), labels.to(self.device)
            total += float(token_loss_sum(self.model, tokens, labels, self.precision, self.device))
            count += int((labels[:, 1:] != IGNORE_INDEX).sum())
        self.model.train()
        return total / max(1, count)

    def _checkpoint(self, state: TrainerState) -> None:
        save_checkpoint(self.run.checkpoints, self.model, self.optimizer, self.scheduler, state, self.cfg.train.keep_checkpoints)

    # -- the loop ---------------------------------------------------------------------------------

    def fit(self) -> TrainResult:
        cfg, t = self.cfg, self.cfg.train
        state = TrainerState(step=0, micro_batches=0, tokens_seen=0)
        if self.resume_from is not None:
            state = load_checkpoint(self.resume_from, self.model, self.optimizer, self.scheduler, self.device)
            if self.scaler and state.scaler:
                self.scaler.load_state_dict(state.scaler)
        write_config(self.run, cfg)
        log = MetricsLog(self.run.metrics_path, keep_through_step=state.step)
        result = TrainResult(self.run.root)
        display = TrainDisplay(t.max_steps, state.step, self.display_console)
        label = f"{device_name(self.device)}, {self.precision.name}, AC {cfg.strategy.activation_checkpointing}"
        display.log(
            f"memfit train: {cfg.model.source} on {label}, "
            f"{'LoRA r=' + str(cfg.lora.rank) if cfg.lora.enabled else 'full fine-tune'}, "
            f"AdamW {resolve_implementation(cfg.optimizer.implementation, self.device)}, "
            f"{len(self.train_ds)} train / {sum(len(b[0]) for b in self.eval)} eval sequences of {cfg.data.seq_len} tokens"
            + (f", resuming from {self.resume_from.name}" if self.resume_from else "")
        )
        if self.predicted is not None:
            display.log(f"planner: predicted step peak {self.predicted.peak_bytes / GIB:.3f} GiB of tensors "
                        f"(in {self.predicted.peak_phase})")
        for note in self.notes:
            display.log(f"note: {note}")
        if t.metrics_port is not None and self.metrics is None:
            self.metrics = TrainerMetrics()
            try:
                self.metrics_port = self.metrics.serve(t.metrics_port, t.metrics_host)
            except OSError as e:
                raise UserError(f"train.metrics_port {t.metrics_port}: cannot listen on {t.metrics_host} ({e.strerror}); "
                                "pick a free port or 0") from None
            display.log(f"metrics: http://{t.metrics_host}:{self.metrics_port}/metrics")

        def do_eval(step: int) -> None:
            rec = {"kind": "eval", "step": step, "eval_loss": self.evaluate()}
            log.write(rec)
            result.evals.append(rec)
            display.log(f"step {step:>5}  eval loss {rec['eval_loss']:.4f}")

        loader = iter(train_loader(self.train_ds, cfg.data, t.micro_batch_size, t.seed, state.micro_batches, self.device))
        states_at_step = None
        self.model.train()
        try:
            with display:
                if state.step == 0:
                    do_eval(0)
                for step in range(state.step + 1, t.max_steps + 1):
                    reset_peaks(self.device)
                    start = time.perf_counter()
                    batches = [next(loader) for _ in range(t.grad_accum_steps)]
                    lr = self.scheduler.get_last_lr()[0]
                    loss, grad_norm = self.train_step(batches)
                    if states_at_step is None:
                        states_at_step = state_bytes(self.model, self.optimizer)  # grads still alive here
                    self.runner.zero_grad()
                    self.scheduler.step()
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    step_time_s = time.perf_counter() - start
                    n_in = sum(tok[:, :-1].numel() for tok, _ in batches)
                    state = TrainerState(
                        step=step,
                        micro_batches=state.micro_batches + t.grad_accum_steps,
                        tokens_seen=state.tokens_seen + n_in,
                        scaler=self.scaler.state_dict() if self.scaler else None,
                    )
                    rec = {
                        "kind": "step", "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                        "step_time_s": step_time_s, "tokens_per_s": n_in / step_time_s,
                        "tokens_seen": state.tokens_seen, **memory_record(self.device),
                    }
                    self._gpu_memory_extras(step, rec)
                    result.steps.append(rec)
                    if self.metrics is not None:
                        self.metrics.update(rec)
                    if step % t.log_every == 0 or step == t.max_steps:
                        log.write(rec)
                        display.update(rec)
                    maybe_release_cache(cfg.allocator, self.device, step)
                    if t.eval_every and step % t.eval_every == 0 and step != t.max_steps:
                        do_eval(step)
                    if (t.checkpoint_every and step % t.checkpoint_every == 0) or step == t.max_steps:
                        self._checkpoint(state)
                if not result.evals or result.evals[-1]["step"] != t.max_steps:
                    do_eval(t.max_steps)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            requested = oom_request_bytes(e)
            if requested is None:
                raise
            raise self._out_of_memory(state.step + 1, requested) from None
        if cfg.output.export:
            export_model(self.model, self.tokenizer, self.source, self.run.export)
            display.log(f"exported {'LoRA adapter' if cfg.lora.enabled else 'model'} to {self.run.export}")
        states = states_at_step or state_bytes(self.model, self.optimizer)
        run_table, mem_table, summary = summary_tables(
            result.steps, result.evals, states, self.baseline_rss_bytes, device_name(self.device),
            self.predicted.peak_bytes if self.predicted else None,
        )
        log.write(summary)
        log.close()
        display.console.print(run_table)
        display.console.print(mem_table)
        result.summary = summary
        return result

    def _gpu_memory_extras(self, step: int, rec: dict[str, Any]) -> None:
        """On a GPU: fragmentation every ``train.frag_every`` steps (into the step record and metrics)
        and the snapshot asked for by ``train.snapshot_at_step``."""
        t = self.cfg.train
        if self.device.type != "cuda":
            return
        if t.frag_every and step % t.frag_every == 0:
            report = analyze({"segments": torch.cuda.memory_snapshot()}, self.device.index or 0)
            rec.update(fragmentation_ratio=report.fragmentation_ratio, largest_free_block_bytes=report.largest_free_bytes)
        if t.snapshot_at_step == step:
            torch.cuda.memory._dump_snapshot(str(self.run.root / f"snapshot_step{step}.pickle"))

    def _out_of_memory(self, step: int, requested: int) -> OutOfMemoryExit:
        """Dump a snapshot on a GPU, and say what was asked, what was predicted and what to try."""
        where = ""
        if self.device.type == "cuda":
            path = self.run.root / f"oom_step{step}_snapshot.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            where = f"; snapshot {path} (memfit frag {path} --simulate)"
        predicted = ""
        if self.predicted is not None:
            parts = ", ".join(f"{c.value} {v / GIB:.2f}" for c, v in self.predicted.peak.bytes_by_category.items() if v)
            predicted = f"; planner predicted a {self.predicted.peak_bytes / GIB:.2f} GiB peak in {self.predicted.peak_phase} ({parts})"
        return OutOfMemoryExit(
            f"out of memory at step {step}: an allocation of {requested / GIB:.2f} GiB ({requested} bytes) failed"
            f"{predicted}{where}; try `memfit plan --config {self.run.config_path}` for a configuration that fits"
        )

    def close(self) -> None:
        """Stop the metrics endpoint, if one was started."""
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
