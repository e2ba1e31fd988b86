"""The strategy vocabulary: every memory lever's choices, how it is parsed, and the ``Strategy`` value.

A lever is one field of ``Strategy``. Its ``Lever`` metadata names the run-config key that sets it, the
``memfit plan`` / ``memfit bench`` flag that pins it, and the values the planner searches when it is not
pinned. The same ``Strategy`` value is the planner's pins and candidates, a bench cell's configuration,
the traced step's configuration and what the trainer resolves its config to, so a new lever is one
field here plus its implementation (the strategy module that applies it and the planner that traces it).

Choices are listed once, here: the config schema, the planner and the commands import them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from memfit.errors import UserError, did_you_mean
from memfit.units import switch

AC_KINDS = ("none", "full", "ffn", "every_k")
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-pure")
"""Concrete precision policies; ``auto`` (config only) resolves to one of them on the device."""
PRECISION_CHOICES = ("auto", *PRECISIONS)
PRECISION_PREFERENCE = ("bf16-mixed", "fp16-mixed", "bf16-pure", "fp32")
"""Numerically safest first: the planner's tie-break between equally fast candidates."""
OPTIMIZER_IMPLEMENTATIONS = ("fused", "foreach", "for-loop")
"""AdamW implementations, in the planner's order of preference; ``auto`` (config only) picks by device."""
OPTIMIZER_CHOICES = ("auto", *OPTIMIZER_IMPLEMENTATIONS)
OPTIMIZER_NAMES = ("adamw", "adamw8bit", "adamw4bit")
"""AdamW with fp32 (or, under bf16-pure, bf16) moments, then torchao's block-quantized 8-bit and 4-bit moments:
numerically safest first."""
LOW_BIT_STATE = {"adamw8bit": "8-bit", "adamw4bit": "4-bit"}
QUANTIZED_BASES = ("none", "nf4")
"""How a LoRA run stores its frozen decoder Linear weights: as the precision says, or 4-bit NF4 (QLoRA)."""
OFFLOAD_PREFETCH = 4
"""With activations offloaded, how many entries' copies back start when backward unpacks the one saved after them
(``strategies.offload``; the planner traces deep enough to see them, ``planner.spec``)."""
ZERO_STAGES = (0, 1, 2, 3)
ENGINE_OF_STAGE = {0: "ddp", 1: "zero1", 2: "fsdp2", 3: "fsdp2"}
"""The engine a multi-rank run of ``distributed.engine fsdp2`` uses at each ZeRO stage."""

_EVERY_K = re.compile(r"^every_k:(\d+)$")


@dataclass(frozen=True)
class CheckpointPolicy:
    """An activation-checkpointing policy: ``none | full | ffn | every_k:N`` (always non-reentrant).

    ``every`` is N for ``every_k:N`` and 1 otherwise; ``str()`` gives the text a user writes.
    """

    kind: str = "none"
    every: int = 1

    @classmethod
    def parse(cls, text: Any, name: str = "strategy.activation_checkpointing") -> CheckpointPolicy:
        """The policy ``text`` spells.

        Raises:
            UserError: naming ``name``, for anything but none | full | ffn | every_k:N with N >= 1.
        """
        if isinstance(text, CheckpointPolicy):
            return text
        text = str(text)
        if text in AC_KINDS and text != "every_k":
            return cls(text)
        m = _EVERY_K.match(text)
        if m and int(m.group(1)) >= 1:
            return cls("every_k", int(m.group(1)))
        raise UserError(
            f"{name} must be none | full | ffn | every_k:N with N >= 1 (got '{text}'){did_you_mean(text, AC_KINDS[:3])}"
        )

    def __str__(self) -> str:
        return f"every_k:{self.every}" if self.kind == "every_k" else self.kind


def _choice(choices: tuple[str, ...]) -> Callable[[Any, str], str]:
    def parse(text: Any, name: str) -> str:
        if text not in choices:
            raise UserError(
                f"{name} must be one of {' | '.join(choices)} (got '{text}'){did_you_mean(str(text), choices)}"
            )
        return text

    return parse


def _int_in(allowed: tuple[int, ...] | None) -> Callable[[Any, str], int]:
    def parse(text: Any, name: str) -> int:
        try:
            value = int(text)
        except (TypeError, ValueError):
            raise UserError(f"{name} must be an integer (got '{text}')") from None
        if (allowed is not None and value not in allowed) or value <= 0 and allowed is None:
            need = " | ".join(map(str, allowed)) if allowed else "> 0"
            raise UserError(f"{name} must be {need} (got {value})")
        return value

    return parse


@dataclass(frozen=True)
class Lever:
    """What memfit knows about one field of ``Strategy``.

    Attributes:
        config_key: ``section.key`` of the run config that sets it. Levers of the ``strategy`` section
            *are* that section: ``memfit.config.schema.StrategyConfig`` is generated from them.
        flag: the ``memfit plan`` / ``memfit bench`` flag that pins it (None: derived, not pinned).
        searched: the values ``memfit plan`` tries when it is not pinned (the planner narrows some by
            hardware: precisions by bf16 support, ZeRO stages by world size, micro-batches by batch).
        parse: ``(text, name) -> value``, raising a UserError that names ``name``.
        help: the config key's help text (``memfit train --help-config``), for ``strategy`` levers.
        config_default: the config's default where it differs from the concrete one (``auto``).
        config_parse: validates the config's value where it admits more than ``parse`` (``auto``).
        fallback: a lever that trades time or accuracy for memory and saves nothing a faster twin needs: the
            planner tries its other values only for candidates whose twin (its first searched value: off, or
            32-bit AdamW) does not fit (unless pinned).
        last_resort: a fallback whose traces cost several times a plain candidate's: tried only when no
            candidate without it fits (unless pinned).
        forward_changes: the memory categories (``planner.categories.Category`` values) whose bytes its values may
            change in the forward pass (None: not declared). Two candidates that differ only in levers that declare
            them hold every other category alike in forward, so either's prediction bounds the other's peak from
            below: the planner leaves a fallback untraced where that bound alone does not fit.
        sharded_changes: what it may change besides on several ranks (an engine's offload of parameter shards).
    """

    config_key: str
    flag: str | None
    searched: tuple
    parse: Callable[[Any, str], Any]
    help: str = ""
    config_default: Any = None
    config_parse: Callable[[Any, str], Any] | None = None
    fallback: bool = False
    last_resort: bool = False
    forward_changes: tuple[str, ...] | None = None
    sharded_changes: tuple[str, ...] = ()


def _lever(
    default: Any, config_key: str, flag: str | None, searched: tuple, parse: Callable[[Any, str], Any], **more: Any
):
    return field(default=default, metadata={"lever": Lever(config_key, flag, searched, parse, **more)})


def _at_least(low: int) -> Callable[[Any, str], int]:
    def parse(text: Any, name: str) -> int:
        try:
            value = int(text)
        except (TypeError, ValueError):
            raise UserError(f"{name} must be an integer (got '{text}')") from None
        if value < low:
            raise UserError(f"{name} must be >= {low} (got {value})")
        return value

    return parse


def _flag(text: Any, name: str) -> bool:
    """A yes/no lever from a bool or the text a flag or YAML gives (true/false, yes/no, on/off, 1/0)."""
    if isinstance(text, bool):
        return text
    on = switch(str(text))
    if on is not None:
        return on
    raise UserError(f"{name} must be true or false (got '{text}')")


def _loss_chunks(text: Any, name: str) -> int:
    value = _at_least(0)(text, name)
    if value == 1:
        raise UserError(f"{name} must be 0 (the whole logits) or >= 2 chunks (got 1)")
    return value


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """One choice of every memory lever, concrete (no ``auto``): per rank, per optimizer step.

    Field order is the planner's enumeration order (the last varies fastest); fields are keyword-only, so
    a new lever never shifts anyone's arguments.
    """

    activation_checkpointing: CheckpointPolicy = _lever(
        CheckpointPolicy(),
        "strategy.activation_checkpointing",
        "--ac",
        (CheckpointPolicy("none"), CheckpointPolicy("every_k", 2), CheckpointPolicy("ffn"), CheckpointPolicy("full")),
        CheckpointPolicy.parse,
        help="none | full (every decoder layer) | ffn (MLP blocks only) | every_k:N (every N-th layer); "
        "always non-reentrant",
    )
    precision: str = _lever(
        "fp32",
        "strategy.precision",
        "--precision",
        PRECISIONS,
        _choice(PRECISIONS),
        help="auto (by device) | fp32 | bf16-mixed (fp32 master, bf16 autocast) | fp16-mixed (GradScaler) "
        "| bf16-pure; the loss is always computed in fp32",
        config_default="auto",
        config_parse=_choice(PRECISION_CHOICES),
    )
    quantize_base: str = _lever(
        "none",
        "lora.quantize_base",
        "--quantize-base",
        QUANTIZED_BASES,
        _choice(QUANTIZED_BASES),
        fallback=True,
        forward_changes=("params", "temporaries"),  # 4-bit weights, each dequantized for its matmul
    )
    loss_chunks: int = _lever(
        0,
        "strategy.loss_chunks",
        "--loss-chunks",
        (0, 8),
        _loss_chunks,
        help="0: the output projection and fp32 cross-entropy over the whole (B, T, V) logits | N >= 2: over "
        "N chunks of the sequence, each chunk's logits recomputed in backward (the logits never exist whole)",
    )
    activation_offload: bool = _lever(
        False,
        "strategy.activation_offload",
        "--activation-offload",
        (False, True),
        _flag,
        help="copy what autograd saves for backward (at least 256 KiB, not parameters) to host memory in "
        "forward and back in backward (pinned buffers, a side stream, prefetch); with checkpointing only the "
        "checkpoint boundaries move",
        fallback=True,
        last_resort=True,
        forward_changes=("activations", "temporaries"),  # saved tensors copied out, buffers for the copies
    )
    optimizer: str = _lever(
        "foreach",
        "optimizer.implementation",
        "--optimizer",
        OPTIMIZER_IMPLEMENTATIONS,
        _choice(OPTIMIZER_IMPLEMENTATIONS),
        forward_changes=(),  # the update's temporaries only
    )
    optimizer_name: str = _lever(
        "adamw",
        "optimizer.name",
        "--optimizer-name",
        OPTIMIZER_NAMES,
        _choice(OPTIMIZER_NAMES),
        fallback=True,
        forward_changes=("optimizer",),  # smaller states, whole in every steady forward pass
    )
    optimizer_in_backward: bool = _lever(
        False,
        "optimizer.in_backward",
        "--optimizer-in-backward",
        (False, True),
        _flag,
        fallback=True,
        forward_changes=("grads",),  # none without accumulation, which the step in backward cannot do
    )
    optimizer_offload: bool = _lever(
        False,
        "optimizer.offload",
        "--optimizer-offload",
        (False, True),
        _flag,
        fallback=True,
        forward_changes=("grads", "optimizer"),  # on one GPU a host master copy: the device weights stay
        sharded_changes=("params",),  # FSDP2's CPUOffloadPolicy and DeepSpeed's offload_param move their shards
    )
    packing: bool = _lever(
        False,
        "data.packing",
        "--packing",
        (False,),
        _flag,
        help="several chat/instruction records per row, each attending only to itself (position ids restart per "
        "record; transformers then builds a block-causal (B, 1, T, T) mask for SDPA and eager); null: on for chat "
        "data. Not searched: a property of the data, pinned from the config",
    )
    micro_batch_size: int = _lever(1, "train.micro_batch_size", "--micro-batch", (), _int_in(None))
    zero_stage: int = _lever(0, "distributed.zero_stage", "--zero", ZERO_STAGES, _int_in(ZERO_STAGES))
    grad_accum_steps: int = _lever(1, "train.grad_accum_steps", None, (), _int_in(None))

    def replace(self, **changes: Any) -> Strategy:
        return dataclasses.replace(self, **changes)

    def overrides(self, only: Iterable[str] | None = None) -> list[str]:
        """``section.key=value`` for every lever (or the levers named in ``only``): this strategy as ``memfit
        train`` overrides, with what a lever implies (a step in backward: no global-norm clipping)."""
        chosen = levers() if only is None else {n: lever for n, lever in levers().items() if n in set(only)}
        out = [f"{lever.config_key}={getattr(self, name)}" for name, lever in chosen.items()]
        return out + (
            ["optimizer.grad_clip=0"] if self.optimizer_in_backward and "optimizer_in_backward" in chosen else []
        )

    def conflict(self, grad_clip: float = 0.0, world_size: int = 1, engine: str = "single") -> str | None:
        """Why this strategy cannot run as given, or None: the levers that do not combine, by config key.

        Activation offloading wraps the trainer's own forward, which DeepSpeed's engine replaces. The optimizer
        step in backward steps each parameter as soon as its gradient is whole, so nothing may need every
        gradient at once (accumulation, global-norm clipping, a loss scaler's unscale and inf check) and no
        engine may still have to reduce the gradient (several ranks).
        """
        if self.quantize_base != "none" and (engine not in ("single", "ddp") or self.zero_stage > 0):
            return (
                f"lora.quantize_base {self.quantize_base} (torchao's NF4 weights) runs on one process or DDP without "
                f"ZeRO (got {engine}, ZeRO-{self.zero_stage}); use lora.quantize_base none there"
            )
        if self.optimizer_name != "adamw":
            why = f"optimizer.name {self.optimizer_name} (torchao's block-quantized states)"
            if self.optimizer != "for-loop":
                return (
                    f"{why} steps one parameter at a time: set optimizer.implementation auto or for-loop "
                    f"(got {self.optimizer})"
                )
            if engine not in ("single", "ddp") or self.zero_stage > 0:
                return (
                    f"{why} runs on one process or DDP without ZeRO (got {engine}, ZeRO-{self.zero_stage}); "
                    "use optimizer.name adamw there"
                )
        if self.optimizer_offload:
            why = "optimizer.offload (the optimizer state and step on the host)"
            if self.optimizer_in_backward:
                return f"{why} steps after backward: it cannot run with optimizer.in_backward=true"
            if engine not in ("single", "fsdp2", "deepspeed"):
                return (
                    f"{why} runs on one process, or on several with FSDP2 (distributed.zero_stage 2 or 3: "
                    f"CPUOffloadPolicy) or DeepSpeed (zero_optimization.offload_optimizer in its JSON); got {engine}"
                )
        if self.activation_offload and engine == "deepspeed":
            return (
                "strategy.activation_offload does not reach into DeepSpeed's engine; use distributed.engine fsdp2, "
                "or DeepSpeed's own activation_checkpointing.cpu_checkpointing in its JSON"
            )
        if not self.optimizer_in_backward:
            return None
        why = "optimizer.in_backward=true steps each parameter as soon as its gradient is whole"
        if self.grad_accum_steps > 1:
            return f"{why}: it cannot accumulate gradients (train.grad_accum_steps {self.grad_accum_steps}); use 1"
        if grad_clip:
            return f"{why}: it cannot clip the global gradient norm; set optimizer.grad_clip=0 (got {grad_clip:g})"
        if self.precision == "fp16-mixed":
            return f"{why}: fp16-mixed's GradScaler needs every gradient at once; use strategy.precision bf16-mixed"
        if world_size > 1 or engine not in ("single",):
            return f"{why}: on {world_size} ranks ({engine}) the gradient is not reduced yet; run it on one process"
        return None

    def as_dict(self) -> dict[str, Any]:
        """Lever name to plain value (policies as their text): for JSON and tables."""
        return {name: _plain(getattr(self, name)) for name in levers()}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "Strategy":
        """The strategy ``as_dict`` gave (results.json, plan JSON), each value parsed by its lever.

        Raises:
            UserError: a value its lever refuses, naming the lever.
        """
        table = levers()
        return cls(
            **{
                name: table[name].parse(str(v).lower() if isinstance(v, bool) else str(v), name)
                for name, v in values.items()
                if name in table
            }
        )

    def label(self) -> str:
        """The strategy in one line, as tables and messages print it (the loss chunks only when on)."""
        chunks = f", base {self.quantize_base.upper()}" if self.quantize_base != "none" else ""
        chunks += f", loss in {self.loss_chunks} chunks" if self.loss_chunks else ""
        chunks += ", activations offloaded" if self.activation_offload else ""
        chunks += ", packed rows" if self.packing else ""
        in_backward = " in backward" if self.optimizer_in_backward else ""
        return (
            f"AC {self.activation_checkpointing}, {self.precision}{chunks}, ZeRO-{self.zero_stage}, micro-batch "
            f"{self.micro_batch_size} x accum {self.grad_accum_steps}, AdamW {self.adamw_label()}{in_backward}"
        )

    def adamw_label(self) -> str:
        """The AdamW column of tables: the implementation, or the low-bit states (stepped one by one); ``@host``
        when the optimizer is offloaded."""
        return LOW_BIT_STATE.get(self.optimizer_name, self.optimizer) + ("@host" if self.optimizer_offload else "")


def fallbacks(strategy: Strategy, pins: dict[str, Any]) -> dict[str, Any]:
    """The unpinned fallback levers ``strategy`` turns on (see ``Lever.fallback``), each set to its twin's value."""
    return {
        n: lever.searched[0]
        for n, lever in levers().items()
        if lever.fallback and n not in pins and getattr(strategy, n) != lever.searched[0]
    }


def levers() -> dict[str, Lever]:
    """Every lever of ``Strategy`` by field name, in enumeration order."""
    return {f.name: f.metadata["lever"] for f in dataclasses.fields(Strategy)}


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, CheckpointPolicy) else value


def parse_pins(values: dict[str, Any], where: Callable[[Lever], str]) -> dict[str, Any]:
    """Typed pins from user text, lever by lever (``None`` values are left out).

    Args:
        where: names the source of a value for messages, e.g. ``lambda lever: lever.flag``.
    """
    table = levers()
    return {name: table[name].parse(v, where(table[name])) for name, v in values.items() if v is not None}


def candidates(pins: dict[str, Any], choices: dict[str, tuple]) -> Iterator[dict[str, Any]]:
    """Every combination of the searched levers: a pinned value, else ``choices[name]`` (the planner's
    narrowing), else the lever's own ``searched``; levers with none of these are left to the caller."""
    names, pools = [], []
    for name, lever in levers().items():
        pool = (pins[name],) if name in pins else choices.get(name, lever.searched)
        if pool:
            names.append(name)
            pools.append(tuple(pool))

    def walk(i: int, acc: dict[str, Any]) -> Iterator[dict[str, Any]]:
        if i == len(names):
            yield dict(acc)
            return
        for v in pools[i]:
            acc[names[i]] = v
            yield from walk(i + 1, acc)

    yield from walk(0, {})
