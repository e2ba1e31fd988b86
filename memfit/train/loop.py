"""The single-device fine-tuning loop (CUDA, ROCm or CPU) with every memory strategy from the config.

Order matters and is kept here in one place: allocator settings before the first GPU allocation;
model built in the precision's parameter dtype; LoRA adapters before activation-checkpoint wrappers
(so the wrappers hold the adapted layers); optimizer over trainable parameters only.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging as hf_logging

from memfit.config.restart import RestartCondition
from memfit.config.schema import RunConfig, grad_accum_steps, oversubscribed_threads, past_the_last_step
from memfit.device import device_name, resolve_device
from memfit.distributed.deepspeed_engine import (
    ds_reader,
    ds_writer,
    gathered,
    initialize,
    param_offload_ignored,
    reconcile,
    resolve_ds_path,
)
from memfit.distributed.engines import Parallel, parallelize
from memfit.distributed.runtime import init_distributed, on_every_rank, on_main, shutdown
from memfit.errors import Interrupted, OutOfMemoryExit, RestartExit, UserError
from memfit.models.load import build_model, resolve_source
from memfit.models.planning import EXPERTS_LOOP_NOTE, asks_experts_loop, attention_note
from memfit.step.loss import ChunkedLoss, batch_loss_sum, supervised_tokens
from memfit.step.runner import DeepSpeedRunner, StepEngine, StepRunner
from memfit.strategies.allocator import (
    apply_allocator_env,
    apply_device_limits,
    host_keep_decision,
    host_memory_kept,
    kept_heap_limit,
    maybe_release_cache,
    refuse_unsafe,
)
from memfit.strategies.checkpointing import apply_activation_checkpointing
from memfit.strategies.lora import apply_lora, quantize_base
from memfit.strategies.offload import activation_offload
from memfit.strategies.optimizer import build_optimizer, build_scheduler, engine_host_config
from memfit.telemetry.allocator_watch import AllocatorWatch
from memfit.telemetry.display import TrainDisplay, summary_tables
from memfit.telemetry.kernels import KernelProfiler
from memfit.telemetry.metrics_file import MetricsLog, NullLog
from memfit.telemetry.oom import oom_request_bytes
from memfit.telemetry.prometheus import TrainerMetrics, listen_error, metrics_url
from memfit.telemetry.readings import memory_record, reset_peaks, state_bytes
from memfit.telemetry.summary import RunSummary, summarize
from memfit.train.checkpoint import TrainerState, checkpoint_dir, load_checkpoint, save_checkpoint
from memfit.train.data import train_loader
from memfit.train.disk import guarded_write
from memfit.train.export import export_model
from memfit.train.fit_check import planned_step, restart_allocator
from memfit.train.inputs import training_inputs
from memfit.train.levers import engine_kind, run_levers
from memfit.train.profiled_step import profiled_train_step
from memfit.train.run_dir import prepare_run_dir, release, write_config
from memfit.train.sharded_checkpoint import (
    check_compatible,
    dcp_reader,
    dcp_writer,
    full_state_dict,
    load_distributed,
    save_distributed,
)
from memfit.train.stops import StopSignals, check_finite, interrupted, out_of_memory_exit, restart_due
from memfit.train.supervisor import restarts_so_far
from memfit.units import GIB, process_rss_bytes


@dataclass
class TrainResult:
    run_dir: Path
    steps: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    summary: RunSummary | None = None


class Trainer:
    """Builds everything a run needs from a validated ``RunConfig``; ``fit()`` trains and exports.

    Under torchrun every rank builds one; rank 0 owns the run directory, the display, the metrics
    file and the export, and every rank takes part in collectives, checkpoints and evaluation.

    Raises (from the constructor):
        UserError: any problem with the config that shows once files and the device are known.
    """

    def __init__(self, cfg: RunConfig, display_console=None):
        self.cfg = cfg
        t, d = cfg.train, cfg.distributed
        if t.threads:
            torch.set_num_threads(t.threads)
        random.seed(t.seed)
        torch.manual_seed(t.seed)  # the same on every rank: identical initial weights and adapters
        refuse_unsafe(cfg.allocator, torch.version.hip)
        apply_allocator_env(cfg.allocator)  # before anything allocates on a GPU
        gpu = t.device.startswith("cuda") or (t.device == "auto" and torch.cuda.is_available())
        self.ctx = init_distributed(d.backend, "cuda" if gpu else "cpu", d.timeout_s)
        ctx = self.ctx
        self.device = torch.device("cuda", ctx.local_rank) if ctx.distributed and gpu else resolve_device(t.device)
        self.kind = engine_kind(cfg, ctx.world_size)
        self.restart = RestartCondition.parse(t.restart_on) if t.restart_on else None
        self.accum = grad_accum_steps(cfg, ctx.world_size)
        self.precision, self.strategy, self.offload_params = run_levers(cfg, self.device, ctx.world_size)
        self.run, self.resume_from, run_notes = on_main(ctx, lambda: prepare_run_dir(cfg, ctx.world_size))
        self.notes: list[str] = list(run_notes)
        if d.deepspeed_config is not None and self.kind != "deepspeed":
            self.notes.append(f"distributed.deepspeed_config is not read: this run's engine is {self.kind}")
        if self.offload_params and d.zero_stage < 3:
            self.notes.append(param_offload_ignored([d.zero_stage]))
        self.notes += past_the_last_step(cfg)
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.notes += oversubscribed_threads(t.threads, len(os.sched_getaffinity(0)), ranks_here)
        if t.resume and self.resume_from is None:
            self.notes.append(f"train.resume=true but {self.run.root} holds no checkpoint yet: starting at step 0")
        # may convert the embedded GGUF (with its progress bar): rank 0 first, the others then hit the cache
        source = on_main(ctx, lambda: resolve_source(cfg.model.source))
        if not ctx.is_main:
            source = resolve_source(cfg.model.source)
        hf_logging.disable_progress_bar()  # loading/saving bars would tear the training display
        inputs = on_every_rank(ctx, lambda: training_inputs(cfg, source, ctx.world_size, self.accum))
        self.tokenizer, self.train_ds, self.eval = inputs.tokenizer, inputs.train, inputs.eval
        self.notes += inputs.notes
        mconf = inputs.model_config
        self.source, self.mconf = source, mconf
        self.notes += filter(None, [attention_note(mconf, cfg.model.attn_implementation)])

        self.predicted = self.predicted_step_s = self.replayed = None  # replayed: the allocator model's (one GPU)
        if t.plan_check:
            try:
                # the planner's traces draw random numbers; forked, they leave the run's stream as seeded
                # (adapters on a loaded checkpoint are initialised from it next)
                with torch.random.fork_rng(devices=[]):
                    self.predicted, self.replayed, self.predicted_step_s = planned_step(
                        cfg, self.strategy, mconf, self.device, ctx, self.kind, self.offload_params
                    )
            except UserError:
                raise
            except Exception as e:  # the check is advice: a planner defect must not stop a run it cannot judge
                self.notes.append(f"planner failed ({type(e).__name__}: {e}); running without the fit check")
            else:
                self.notes += [EXPERTS_LOOP_NOTE] if asks_experts_loop(mconf) else []
        self.baseline_rss_bytes = process_rss_bytes()
        self.notes += apply_device_limits(cfg.allocator, self.device)
        peak = getattr(self.predicted, "peak_bytes", None)
        self.keep_host = host_keep_decision(cfg.allocator, self.device, peak, self.notes)
        self.kept_limit = kept_heap_limit(self.baseline_rss_bytes, peak)
        self.kernels = KernelProfiler(t.kernel_profile_every, self.device)
        self.watch = AllocatorWatch(
            self.device,
            self.run.root,
            ctx.rank,
            ctx.world_size,
            t.frag_every,
            t.record_memory_history,
            t.snapshot_at_step,
        )
        self.watch.start()  # before the weights arrive: a whole-run trace
        if not self.watch.on and (t.record_memory_history or t.snapshot_at_step is not None):
            self.notes.append("train.record_memory_history / snapshot_at_step apply to CUDA/ROCm devices only")
        model = self._plain_model()
        self.wrapped = apply_activation_checkpointing(model, cfg.strategy.activation_checkpointing)
        self.chunked = ChunkedLoss.attach(model, self.strategy.loss_chunks)  # before any engine wraps the model
        model = model.to(self.device)

        if self.kind == "deepspeed":
            self.par, self.runner = self._deepspeed(model)
        else:
            self.par = parallelize(model, self.kind, d.zero_stage, self.precision, self.device, cfg.optimizer)
            self.scaler = None
            if self.precision.grad_scaler:
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                self.scaler = ShardedGradScaler() if self.kind == "fsdp2" else torch.amp.GradScaler(self.device.type)
            self.runner = StepRunner(
                self.par.model,
                self.par.params,
                self.par.optimizer,
                self.par.precision,
                self.device,
                cfg.optimizer.grad_clip,
                self.scaler,
                ctx,
                self.par.grad_sync,
                self.chunked,
                activation_offload(self.strategy.activation_offload, self.device),
            )
        self.runner: StepEngine
        self.model, self.optimizer, self.params = self.par.module, self.par.optimizer, self.par.params
        self.scheduler = build_scheduler(self.optimizer, t.max_steps, cfg.optimizer)
        self.display_console = display_console
        self.metrics: TrainerMetrics | None = None
        self.metrics_port: int | None = None

    def _plain_model(self) -> torch.nn.Module:
        """The model as configured (weights, LoRA adapters), before any wrapper or engine: a random
        preset on the run's device when it runs alone, everything else on CPU."""
        init_device = self.device if not self.ctx.distributed else torch.device("cpu")  # ranks shard from CPU
        model = build_model(
            self.source,
            self.cfg.model,
            self.precision.param_dtype,
            self.cfg.train.seed,
            init_device,
            trains_on_cpu=self.device.type == "cpu",
        )
        if not self.cfg.lora.enabled:
            return model
        model = apply_lora(model, self.cfg.lora, self.precision)
        quantize_base(model, self.strategy.quantize_base)
        return model

    def _deepspeed(self, model):

        ds_config = reconcile(
            resolve_ds_path(self.cfg.distributed.deepspeed_config),
            self.cfg,
            self.precision,
            self.ctx.world_size,
            self.accum,
        )
        params = [p for p in model.parameters() if p.requires_grad]
        opt_cfg = self.cfg.optimizer  # with offloading, DeepSpeed steps its own host partitions
        opt_cfg = engine_host_config(opt_cfg) if self.strategy.optimizer_offload else opt_cfg
        optimizer = build_optimizer(params, opt_cfg, self.device)
        engine = initialize(model, optimizer, ds_config)
        self.scaler = None
        no_autocast = replace(self.precision, autocast_dtype=None, grad_scaler=False)
        return Parallel("deepspeed", engine, engine.module, optimizer, params, no_autocast), DeepSpeedRunner(
            engine, self.ctx, self.device, self.chunked
        )

    def train_step(self, batches: list[tuple[torch.Tensor, ...]]) -> tuple[float, float]:
        """One optimizer step; returns (mean token loss, gradient norm before clipping)."""
        loss, grad_norm = self.runner.step(batches)
        return float(loss), float(grad_norm)

    # -- pieces -----------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss over the fixed held-out batches (every rank runs them all: FSDP2 needs
        each rank in each forward, and the number is then the single-process one)."""
        model = self.par.model if self.kind == "fsdp2" else self.par.module
        model.eval()
        total, count = 0.0, 0
        for batch in self.eval:
            total += float(batch_loss_sum(model, batch, self.par.precision, self.device, self.chunked))
            count += int(supervised_tokens(batch[1]))
        model.train()
        return total / max(1, count)

    def _shard_io(self):
        """The engine's collective (writer, reader) of a multi-rank checkpoint."""
        if self.kind == "deepspeed":
            return ds_writer(self.par.model), ds_reader(self.par.model)
        return dcp_writer(self.ctx, self.par), dcp_reader(self.ctx, self.par)

    def _checkpoint(self, state: TrainerState) -> None:
        """Write the checkpoint of ``state`` (refused in one line, the previous one untouched, if the disk is full)."""
        keep = self.cfg.train.keep_checkpoints
        held = state_bytes(self.model, self.par.local_optimizer(), self.device.type == "cuda")
        needed = (held.trainable_params_bytes + held.optimizer_bytes) * self.ctx.world_size
        with guarded_write(f"checkpoint step {state.step}", checkpoint_dir(self.run.checkpoints, state.step), needed):
            if self.kind == "single":
                save_checkpoint(self.run.checkpoints, self.model, self.optimizer, self.scheduler, state, keep)
            else:
                save_distributed(self.ctx, self.run.checkpoints, state, self.scheduler, keep, self._shard_io()[0])

    def _resume(self, path: Path) -> TrainerState:
        state = check_compatible(path, self.ctx.world_size, self.kind)
        if self.kind == "single":
            state = load_checkpoint(path, self.model, self.optimizer, self.scheduler, self.device)
        else:
            load_distributed(self.ctx, path, self.scheduler, self._shard_io()[1])
        if self.scaler and state.scaler:
            self.scaler.load_state_dict(state.scaler)
        return state

    def _memory(self, signals: StopSignals) -> tuple[dict[str, Any], signal.Signals | None]:
        """This step's memory fields (with several ranks the worst rank's value, and every rank's in
        ``rank_memory``), and the stop signal any rank received (gathered with them: every rank stops at the
        same step)."""
        mem = memory_record(self.device)
        self._local_memory = mem  # this rank's own values, for its metrics endpoint
        if not self.ctx.distributed:
            return mem, signals.received
        keys = list(mem)
        stop = float(signals.received or 0)
        per_rank = self.ctx.gather_numbers([float(mem[k]) for k in keys] + [stop])
        out: dict[str, Any] = {k: int(max(r[i] for r in per_rank)) for i, k in enumerate(keys)}
        out["rank_memory"] = {k: [int(r[i]) for r in per_rank] for i, k in enumerate(keys)}
        received = max(int(r[-1]) for r in per_rank)
        return out, signal.Signals(received) if received else None

    def _interrupted(self, received: signal.Signals, state: TrainerState, saved: bool) -> Interrupted:
        """Write the final checkpoint a stop signal asks for (unless this step's was just written or the run
        keeps none) and say what survived."""
        took = None
        if self.cfg.train.keep_checkpoints and not saved:
            start = time.perf_counter()
            self._checkpoint(state)
            took = time.perf_counter() - start
        kept = checkpoint_dir(self.run.checkpoints, state.step) if self.cfg.train.keep_checkpoints else None
        return interrupted(received, state.step, self.cfg.train.max_steps, kept, took, self.ctx.is_main)

    def _restart(self, why: str, state: TrainerState, saved: bool, log, display) -> RestartExit:
        """Checkpoint (if not just written), a ``restart`` record (allocator advice on one GPU) and one line."""
        if not saved:
            self._checkpoint(state)
        advice = restart_allocator(self.cfg, self.strategy, self.mconf, self.device, self.ctx, self.watch.recorded())
        log.write({"kind": "restart", "step": state.step, "reason": why, **advice})
        display.log(
            f"restart: {why} after step {state.step}; {checkpoint_dir(self.run.checkpoints, state.step)} holds it"
        )
        return RestartExit(why)

    def _step(self, step: int, batches, last_s: float | None) -> tuple[float, float, dict[str, Any]]:
        """One step and its record's extra fields: measured at ``train.profile_step``, kernels profiled when due."""
        run = functools.partial(self.train_step, batches)
        if step == self.cfg.train.profile_step:
            out, extra = profiled_train_step(run, batches, self.kind, self.device, self.ctx, self.par, self.predicted)
        elif self.kernels.due(step):
            out, extra = self.kernels.profile(run, step, last_s)
        else:
            out, extra = run(), {}
        return *out, extra

    def _export(self, display: TrainDisplay) -> None:
        """The final model or adapter in HF format, consolidated on rank 0."""
        if self.kind == "fsdp2":
            full = full_state_dict(self.par)  # collective: every rank sends its shards
            module = None
            if self.ctx.is_main:
                module = self._plain_model()
                module.load_state_dict(full)
            whole = contextlib.nullcontext()
        else:
            module = self.par.module
            whole = gathered(module)  # DeepSpeed ZeRO-3: every rank gathers, rank 0 writes
        with whole:
            if self.ctx.is_main:
                held = state_bytes(module, None)
                needed = held.trainable_params_bytes if self.cfg.lora.enabled else held.params_bytes
                with guarded_write("export", self.run.export, needed):
                    export_model(module, self.tokenizer, self.source, self.run.export)
                display.log(f"exported {'LoRA adapter' if self.cfg.lora.enabled else 'model'} to {self.run.export}")
        self.ctx.barrier()

    def _bind_metrics(self) -> None:
        """Serve this rank's metrics endpoint (``train.metrics_port``; one port per local rank).

        Raises:
            UserError: the port cannot be bound.
        """
        t = self.cfg.train
        if t.metrics_port is None or self.metrics is not None:
            return
        port = t.metrics_port + self.ctx.local_rank if t.metrics_port else 0
        self.metrics = TrainerMetrics()
        self.metrics.update({"restarts": restarts_so_far()})
        try:
            self.metrics_port = self.metrics.serve(port, t.metrics_host)
        except OSError as e:
            self.metrics = None
            raise UserError(listen_error(e, t.metrics_host, port, "train.metrics_host", "train.metrics_port")) from None

    # -- the loop ---------------------------------------------------------------------------------

    def fit(self) -> TrainResult:
        cfg, t, ctx = self.cfg, self.cfg.train, self.ctx
        state = TrainerState(step=0, micro_batches=0, tokens_seen=0, world_size=ctx.world_size, engine=self.kind)
        if self.resume_from is not None:
            state = self._resume(self.resume_from)
        self._bind_metrics()  # a busy port is refused before anything is written
        log = NullLog()
        if ctx.is_main:
            with guarded_write("output.dir", self.run.root, 0):
                write_config(self.run, cfg)
                kept = state.step if self.resume_from is not None else -1  # a fresh start keeps no earlier record
                log = MetricsLog(self.run.metrics_path, keep_through_step=kept)
        self._log = log  # closed by close() when the run stops early
        result = TrainResult(self.run.root)
        display = TrainDisplay(t.max_steps, state.step, self.display_console, enabled=ctx.is_main)
        label = f"{device_name(self.device)}, {self.precision.name}, AC {cfg.strategy.activation_checkpointing}"
        if self.chunked is not None:
            label += f", loss in {self.chunked.chunks} chunks"
        if self.strategy.activation_offload:
            label += ", activations offloaded to host memory"
        ranks = ""
        if ctx.distributed:
            ranks = f" x {ctx.world_size} ranks ({self.kind}, ZeRO-{cfg.distributed.zero_stage}, {ctx.backend})"
        lora_weights = cfg.lora.enabled and cfg.lora.target_parameters  # a mixture of experts' expert weights
        display.log(
            f"memfit train: {cfg.model.source} on {label}{ranks}, "
            f"{'LoRA r=' + str(cfg.lora.rank) if cfg.lora.enabled else 'full fine-tune'}"
            f"{' with ' + ', '.join(cfg.lora.target_parameters) if lora_weights else ''}"
            f"{' (' + cfg.lora.trained_beside() + ')' if cfg.lora.enabled and cfg.lora.trained_beside() else ''}"
            f"{', base NF4' if self.strategy.quantize_base == 'nf4' else ''}, "
            f"AdamW {self.strategy.adamw_label()}"
            f"{' stepped in backward' if self.strategy.optimizer_in_backward else ''}"
            f"{' (state and step in host memory)' if self.strategy.optimizer_offload else ''}, "
            f"{len(self.train_ds)} train / {sum(len(b[0]) for b in self.eval)} eval sequences of "
            f"{cfg.data.seq_len} tokens, "
            f"global batch {ctx.world_size * t.micro_batch_size * self.accum}"
        )
        if self.resume_from:
            display.log(f"resuming from {self.resume_from.name}")
        if self.predicted is not None:
            display.log(
                f"planner: predicted step peak {self.predicted.peak_bytes / GIB:.3f} GiB of tensors "
                f"{'per rank ' if ctx.distributed else ''}(in {self.predicted.peak_phase})"
            )
        if self.replayed is not None:
            display.log(
                f"allocator model: peak reserved {self.replayed.peak_reserved_bytes / GIB:.3f} GiB under "
                f"{self.replayed.settings.label()} settings (the planned first two steps replayed)"
            )
        for note in self.notes:
            display.log(f"note: {note}")
        if self.metrics_port is not None:
            where = f"rank {ctx.rank} " if ctx.distributed else ""
            display.log(f"metrics: {where}{metrics_url(t.metrics_host, self.metrics_port)}", everywhere=True)

        def do_eval(step: int) -> None:
            if not self.eval:  # train.eval_batches=0
                return
            rec = {"kind": "eval", "step": step, "eval_loss": self.evaluate()}
            log.write(rec)
            result.evals.append(rec)
            display.log(f"step {step:>5}  eval loss {rec['eval_loss']:.4f}")

        loader = iter(
            train_loader(
                self.train_ds,
                cfg.data,
                t.micro_batch_size,
                t.seed,
                state.step * self.accum,  # the global batch is fixed: a resume may split it differently
                self.device,
                ctx.rank,
                ctx.world_size,
                self.accum,
            )
        )
        states_at_step = None
        first, started = state.step, time.perf_counter()  # this process's share of the run (train.restart_on)
        self.par.model.train()
        try:
            with display, StopSignals() as signals, host_memory_kept(self.keep_host, self.kept_limit) as bound:
                if state.step == 0:
                    do_eval(0)
                for step in range(state.step + 1, t.max_steps + 1):
                    reset_peaks(self.device)
                    self.watch.before_step(step)
                    start = time.perf_counter()
                    batches = [next(loader) for _ in range(self.accum)]
                    lr = float(self.scheduler.get_last_lr()[0])  # a tensor under torchao
                    last_s = result.steps[-1]["step_time_s"] if result.steps else None
                    loss, grad_norm, extra = self._step(step, batches, last_s)
                    scaled = self.precision.grad_scaler or self.kind == "deepspeed"
                    check_finite(step, loss, grad_norm, scaled, cfg.optimizer.lr)
                    if states_at_step is None:
                        # grads still alive here
                        states_at_step = state_bytes(self.model, self.par.local_optimizer(), self.device.type == "cuda")
                    self.runner.zero_grad()
                    self.scheduler.step()
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    step_time_s = time.perf_counter() - start
                    n_in = ctx.world_size * sum(b[0][:, :-1].numel() for b in batches)
                    supervised = ctx.world_size * sum(int(supervised_tokens(b[1])) for b in batches)
                    state = TrainerState(
                        step=step,
                        micro_batches=state.micro_batches + self.accum,
                        tokens_seen=state.tokens_seen + n_in,
                        scaler=self.scaler.state_dict() if self.scaler else None,
                        world_size=ctx.world_size,
                        engine=self.kind,
                    )
                    rec = {
                        "kind": "step",
                        "step": step,
                        "loss": loss,
                        "lr": lr,
                        "grad_norm": grad_norm,
                        "step_time_s": step_time_s,
                        "tokens_per_s": n_in / step_time_s,
                        "supervised_tokens_per_s": supervised / step_time_s,
                        "tokens_seen": state.tokens_seen,
                    }
                    memory, received = self._memory(signals)
                    rec.update(memory | extra)
                    if bound():  # a kept heap over its budget, handed back after the step (host_memory_kept)
                        rec["host_heap_trimmed"] = True
                    self.watch.after_step(step, rec)
                    result.steps.append(rec)
                    if self.metrics is not None:
                        self.metrics.update({**rec, **self._local_memory, "rank": ctx.rank})
                    if step % t.log_every == 0 or step == t.max_steps:
                        log.write(rec)
                        display.update(rec)
                    maybe_release_cache(cfg.allocator, self.device, step)
                    if t.eval_every and step % t.eval_every == 0 and step != t.max_steps:
                        do_eval(step)
                    saved = bool(t.keep_checkpoints) and (
                        (t.checkpoint_every and step % t.checkpoint_every == 0) or step == t.max_steps
                    )
                    if saved:
                        self._checkpoint(state)
                    if received is not None:
                        raise self._interrupted(received, state, saved)
                    if self.restart is not None and step != t.max_steps:
                        why = restart_due(self.restart, rec, (step - first, time.perf_counter() - started), ctx)
                        if why is not None:
                            raise self._restart(why, state, saved, log, display)
                if not result.evals or result.evals[-1]["step"] != t.max_steps:
                    do_eval(t.max_steps)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            requested = oom_request_bytes(e)
            if requested is None:
                raise
            raise self._out_of_memory(state.step + 1, requested) from None
        if cfg.output.export:
            self._export(display)
        states = states_at_step or state_bytes(self.model, self.par.local_optimizer(), self.device.type == "cuda")
        where = device_name(self.device) + (f"; model states of rank 0 of {ctx.world_size}" if ctx.distributed else "")
        summary = summarize(
            result.steps,
            result.evals,
            states,
            self.baseline_rss_bytes,
            where,
            self.predicted.peak_bytes if self.predicted else None,
            self.replayed.peak_reserved_bytes if self.replayed else None,
            self.predicted.host_peak_bytes if self.predicted else None,
            self.predicted_step_s,
        )
        if ctx.distributed:
            held = ctx.gather_numbers([states.params_bytes, states.grads_bytes, states.optimizer_bytes])
            summary = replace(
                summary,
                world_size=ctx.world_size,
                engine=self.kind,
                zero_stage=cfg.distributed.zero_stage,
                rank_states=[dict(zip(("params_bytes", "grads_bytes", "optimizer_bytes"), map(int, r))) for r in held],
            )
        log.write(summary.record())
        log.close()
        if ctx.is_main:
            release(self.run.root)  # a finished run holds its directory no longer
        for table in summary_tables(summary):
            display.print(table)
        result.summary = summary
        return result

    def _out_of_memory(self, step: int, requested: int) -> OutOfMemoryExit:
        advice = restart_allocator(self.cfg, self.strategy, self.mconf, self.device, self.ctx, self.watch.recorded())
        return out_of_memory_exit(step, requested, self.watch, self.predicted, self.run, self.ctx.rank, advice)

    def close(self) -> None:
        """Close the metrics file, stop the metrics endpoint, if one was started, and leave the process group."""
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.ctx.is_main:
            release(self.run.root)
        shutdown(self.ctx)
