"""LoRA through PEFT: adapters on the named Linear modules, base weights frozen.

The frozen base is stored in the precision's ``frozen_dtype`` (bf16 under bf16-mixed: a weight nobody trains
needs no fp32 master copy), the adapters in its ``param_dtype`` (fp32 under bf16-mixed), as the common PEFT /
HF Trainer / torchtune recipe does. Under autocast the adapters' matmuls run in the compute dtype; PEFT's own
cast of each adapted input to the adapter dtype is turned off, since autocast casts it already and an fp32
copy of the input is only a temporary of the size of the activations.

``lora.quantize_base=nf4`` (QLoRA, ``quantize_base``) then stores every frozen Linear weight of the decoder layers,
adapted or not, as torchao's ``NF4Tensor``: 4-bit NormalFloat codes in blocks of 64 values, each block's
absolute maximum quantized to int8 against one bf16 scale per ``scaler block`` of such maxima (256, or the
largest power of two that divides the block count). The embeddings, norms and output head stay as they were.
A matmul dequantizes its weight to the input's dtype for that matmul (and again in backward), so a layer's
weight exists at full width only while it is used.
"""

from __future__ import annotations

import warnings

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from torch._subclasses.fake_tensor import is_fake

from memfit.config.schema import LoraConfig
from memfit.errors import UserError, did_you_mean, first_line
from memfit.models.load import decoder_layers
from memfit.strategies.precision import Precision


def linear_module_names(model: torch.nn.Module) -> set[str]:
    """The last name component of every ``nn.Linear`` in the model (q_proj, down_proj, lm_head, ...)."""
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


ALL_LINEAR = "all-linear"
"""PEFT's name for every Linear module but the output head."""


def target_names(model: torch.nn.Module, names: list[str]) -> list[str]:
    """``lora.target_modules`` with ``all-linear`` (as PEFT reads it) spelled out: every Linear module's name but
    the output head's."""
    if ALL_LINEAR not in names:
        return list(names)
    head = model.get_output_embeddings()
    heads = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if m is head}
    linear = sorted(linear_module_names(model) - heads)
    return list(dict.fromkeys(n for name in names for n in (linear if name == ALL_LINEAR else [name])))


def adaptable_weights(model: torch.nn.Module) -> set[str]:
    """``<module>.<weight>`` of every weight of 3 or more dimensions (a mixture of experts' stacked experts:
    ``experts.gate_up_proj``), which ``lora.target_parameters`` may name."""
    return {".".join(name.split(".")[-2:]) for name, p in model.named_parameters() if p.dim() >= 3}


def _names(name: str, target: str) -> bool:
    """Whether ``target`` names the weight ``name``: its last name components, as PEFT's target_parameters match."""
    return name == target or name.endswith(f".{target}")


def check_target_parameters(model: torch.nn.Module, names: list[str]) -> None:
    """Each of ``lora.target_parameters`` names some weight's last name components, as PEFT matches them.

    Raises:
        UserError: naming the first that names none, with the weights it could name.
    """
    held = [name for name, _ in model.named_parameters()]
    for target in names:
        if not any(_names(name, target) for name in held):
            weights = adaptable_weights(model)
            where = f"; available: {', '.join(sorted(weights))}" if weights else " (it has no 3-D expert weights)"
            raise UserError(
                f"lora.target_parameters: '{target}' is no weight of this model{did_you_mean(target, weights)}{where}"
            )


def check_rank(model: torch.nn.Module, rank: int, modules: list[str], parameters: list[str]) -> None:
    """A rank above every adapted weight's smaller side adds memory and compute, not capacity: an update ``B @ A``
    of an ``out x in`` weight has rank at most ``min(out, in)``. PEFT takes it (a plan of rank 100,000 on Llama-2-7B
    traced for a minute before saying nothing fits).

    Raises:
        UserError: naming the largest rank that some adapted weight can use.
    """
    sides = [
        min(m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in modules
    ]
    sides += [
        min(p.shape[-2:])
        for name, p in model.named_parameters()
        if p.dim() >= 2 and any(_names(name, t) for t in parameters)
    ]
    widest = max(sides, default=rank)
    if rank > widest:
        raise UserError(
            f"lora.rank {rank} is above every adapted weight's smaller side (at most {widest} here): an update of such "
            f"a weight has rank at most that, so a larger one adds memory, not capacity; give lora.rank <= {widest}"
        )


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, precision: Precision):
    """Wrap ``model`` (built in ``precision.param_dtype``) with PEFT LoRA adapters; the frozen weights are then
    cast to ``precision.frozen_dtype``.

    Raises:
        UserError: when a target module is not a Linear layer of this model.
    """
    available = linear_module_names(model)
    targets = target_names(model, cfg.target_modules)
    for target in targets:
        if target not in available:
            raise UserError(
                f"lora.target_modules: '{target}' is not a Linear module of this model"
                f"{did_you_mean(target, available)}; available: {', '.join(sorted(available))}, or {ALL_LINEAR} "
                "(every one but the output head)"
            )
    check_target_parameters(model, cfg.target_parameters)
    check_rank(model, cfg.rank, targets, cfg.target_parameters)
    peft_config = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        target_parameters=list(cfg.target_parameters) or None,
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():  # PEFT asks transformers a deprecated question; not ours to fix
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        # adapters in the base weights' dtype: PEFT would upcast them to fp32 under bf16 weights, and cast each
        # adapted input to fp32 (saved for backward): +7 to 13 GiB on a Llama-2-7B LoRA step (bf16-pure, 4 x 1024)
        peft_model = get_peft_model(model, peft_config, autocast_adapter_dtype=False)
    _adapters_in_base_dtype(peft_model)
    for p in peft_model.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype != precision.frozen_dtype:
            p.data = p.data.to(precision.frozen_dtype)  # the same Parameter: tied weights stay tied
    for m in peft_model.modules():
        if hasattr(m, "cast_input_dtype_enabled"):  # a PEFT tuner layer
            m.cast_input_dtype_enabled = False
    return peft_model


def _adapters_in_base_dtype(model: torch.nn.Module) -> None:
    """Give each adapter its base weight's dtype, as PEFT does, also where PEFT does not: adapters built on the meta
    device (the planner's, which builds no real tensors) stay in the default dtype there."""
    for m in model.modules():
        if not isinstance(m, BaseTunerLayer):
            continue
        base = m.get_base_layer()
        held = {id(p) for p in base.parameters()}
        dtype = next((p.dtype for p in base.parameters() if p.is_floating_point()), None)
        for p in m.parameters():
            if dtype is not None and id(p) not in held and p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


NF4_BLOCK = 64
"""Values per NF4 code block (torchao's and QLoRA's default)."""
NF4_SCALER_BLOCKS = (256, 128, 64, 32, 16, 8, 4, 2, 1)


def quantize_base(model: torch.nn.Module, kind: str) -> int:
    """Store the frozen Linear weights of ``model``'s decoder layers as ``kind`` (``none`` leaves them); returns
    how many were quantized. A weight whose size is not a whole number of 64-value blocks stays as it is.

    Raises:
        UserError: for nf4 when torchao is not installed (the ``lowbit`` extra).
    """
    if kind == "none":
        return 0
    try:
        from torchao.quantization import to_nf4
    except ImportError as e:
        raise UserError(
            f"lora.quantize_base {kind} needs torchao: pip install 'memfit[lowbit]' (or torchao); {first_line(e)}"
        ) from None
    count = 0
    for layer in decoder_layers(model):
        for module in layer.modules():
            weight = getattr(module, "weight", None)
            if not isinstance(module, torch.nn.Linear) or weight.requires_grad or weight.numel() % NF4_BLOCK:
                continue
            blocks = weight.numel() // NF4_BLOCK
            scaler_block = next(b for b in NF4_SCALER_BLOCKS if blocks % b == 0)
            nf4 = _fake_nf4(weight) if is_fake(weight) else None
            if nf4 is None:
                nf4 = to_nf4(weight.detach(), NF4_BLOCK, scaler_block)
                _remember_layout(weight, nf4)
            module.weight = torch.nn.Parameter(nf4, requires_grad=False)
            count += 1
    return count


_NF4_LAYOUTS: dict[tuple, tuple] = {}
"""What ``to_nf4`` builds from a weight of one shape, stride and dtype: the NF4 tensor's class, its flatten context,
and each inner tensor's size, stride, storage offset, dtype and storage bytes (every inner tensor has a storage of its
own; the quantization factor of a small weight is a strided view of a larger one)."""


def _layout_key(weight: torch.Tensor) -> tuple:
    return tuple(weight.shape), weight.stride(), weight.dtype


def _remember_layout(weight: torch.Tensor, nf4: torch.Tensor) -> None:
    if is_fake(weight):
        names, ctx = nf4.__tensor_flatten__()
        inner = {}
        for n in names:
            t = getattr(nf4, n)
            inner[n] = (t.shape, t.stride(), t.storage_offset(), t.dtype, t.untyped_storage().nbytes())
        _NF4_LAYOUTS[_layout_key(weight)] = (type(nf4), ctx, inner, nf4.shape, nf4.stride())


def _fake_nf4(weight: torch.Tensor) -> torch.Tensor | None:
    """The NF4 tensor of a fake ``weight`` (a planner's trace), built from fresh inner tensors of the sizes its first
    weight of that shape quantized to (None until one has): the same storages, without running torchao's quantizer
    op by op on fake tensors again (over a hundred chunked passes per weight: 70% of a cold 70B QLoRA search, by
    cProfile)."""
    layout = _NF4_LAYOUTS.get(_layout_key(weight))
    if layout is None:
        return None
    cls, ctx, inner, size, stride = layout
    tensors = {}
    for n, (shape, strides, offset, dtype, nbytes) in inner.items():
        storage = torch.empty(nbytes // dtype.itemsize, dtype=dtype, device=weight.device)
        tensors[n] = storage.as_strided(shape, strides, offset)  # a view where torchao's is one (a strided factor)
    return cls.__tensor_unflatten__(tensors, ctx, size, stride)
