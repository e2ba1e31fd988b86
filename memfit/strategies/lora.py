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

A mixture of experts' experts are 3-D weights (experts x out x in), not Linear modules. Each such frozen stack
becomes NF4 tensors of whole experts behind a parametrization (``_Dequantized``): reading ``experts.gate_up_proj``
dequantizes the stack, group by group, into a tensor the model's own code (transformers' grouped matmul) uses
as it would the bf16 stack. Autograd would keep that tensor for backward in every layer; the experts' forward
saves the NF4 groups in its place and dequantizes them again in backward (``_nf4_saved_tensors_hooks``). A stack that
carries adapters (``lora.target_parameters``) stays as it is: PEFT adds its own parametrization there.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.utils.parametrize as parametrize
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


def ties_embeddings(model: torch.nn.Module) -> bool:
    """Whether the output head's weight is the input embeddings' (SmolLM2, Llama-3.2-1B, Gemma)."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embeddings is not None and head.weight is embeddings.weight


def check_trained_whole(model: torch.nn.Module, names: list[str], targets: list[str]) -> None:
    """Each of ``lora.modules_to_save`` names modules of ``model`` (by their last name components, as PEFT matches
    them) that hold no adapted module: PEFT skips a name that matches nothing, and refuses one that is adapted.

    Raises:
        UserError: naming the first that fails, with the modules it could name.
    """
    modules = dict(model.named_modules())
    for name in names:
        found = [full for full in modules if full and _names(full, name)]
        if not found:
            leaves = {
                full.rsplit(".", 1)[-1]
                for full, m in modules.items()
                if full and not list(m.children()) and any(True for _ in m.parameters())
            }
            raise UserError(
                f"lora.modules_to_save: '{name}' is no module of this model{did_you_mean(name, leaves)}; e.g. "
                f"{', '.join(sorted(leaves))}"
            )
        inside = [sub for sub in modules if any(sub == f or sub.startswith(f"{f}.") for f in found)]
        adapted = [sub.rsplit(".", 1)[-1] for sub in inside if sub.rsplit(".", 1)[-1] in targets]
        if adapted:
            what = (
                "gets adapters" if adapted[0] == name.rsplit(".", 1)[-1] else f"holds {adapted[0]}, which gets adapters"
            )
            raise UserError(
                f"lora.modules_to_save: '{name}' {what} (lora.target_modules): a module is adapted or trained whole, "
                "not both; name it in one of the two"
            )


def _embedding_modules(model: torch.nn.Module, names: list[str]) -> list[tuple[str, torch.nn.Module]]:
    """The input embeddings or output head each of ``names`` names (as ``lora.modules_to_save`` does), with the name."""
    ends = [m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
    return [(n, m) for n in names for full, m in model.named_modules() if any(m is e for e in ends) and _names(full, n)]


def check_trainable_tokens(model: torch.nn.Module, tokens: list[int], trained_whole: list[str]) -> None:
    """``lora.trainable_tokens`` are rows of the input embeddings, which are not trained whole as well.

    Raises:
        UserError: for a token id past the vocabulary, or the embeddings named in ``lora.modules_to_save`` too.
    """
    if not tokens:
        return
    embeddings = model.get_input_embeddings()
    rows = embeddings.weight.shape[0]
    if max(tokens) >= rows:
        raise UserError(
            f"lora.trainable_tokens: token id {max(tokens)} is past this model's vocabulary of {rows} embedding rows; "
            f"give ids below {rows}"
        )
    whole = _embedding_modules(model, trained_whole)
    if whole and (whole[0][1] is embeddings or ties_embeddings(model)):
        raise UserError(
            f"lora.trainable_tokens trains rows of the input embeddings, and lora.modules_to_save '{whole[0][0]}' "
            "trains them whole: keep one of the two"
        )


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, precision: Precision):
    """Wrap ``model`` (built in ``precision.param_dtype``) with PEFT LoRA adapters; the frozen weights are then
    cast to ``precision.frozen_dtype``.

    Raises:
        UserError: when a target module is not a Linear layer of this model.
    """
    available = linear_module_names(model)
    targets = target_names(model, cfg.target_modules)
    embeddings = {full.rsplit(".", 1)[-1] for full, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    for target in targets:
        if target in embeddings:  # PEFT would put low-rank adapters on it; what users mean is to train it
            raise UserError(
                f"lora.target_modules: '{target}' is the embeddings, not a Linear module: to train them, name it in "
                "lora.modules_to_save (trained whole) or give lora.trainable_tokens (only those rows)"
            )
        if target not in available:
            raise UserError(
                f"lora.target_modules: '{target}' is not a Linear module of this model"
                f"{did_you_mean(target, available)}; available: {', '.join(sorted(available))}, or {ALL_LINEAR} "
                "(every one but the output head)"
            )
    check_target_parameters(model, cfg.target_parameters)
    check_rank(model, cfg.rank, targets, cfg.target_parameters)
    check_trained_whole(model, cfg.modules_to_save, targets)
    check_trainable_tokens(model, cfg.trainable_tokens, cfg.modules_to_save)
    peft_config = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        target_parameters=list(cfg.target_parameters) or None,
        modules_to_save=list(cfg.modules_to_save) or None,  # copies: PEFT rewrites the lists it is given
        trainable_token_indices=list(dict.fromkeys(cfg.trainable_tokens)) or None,  # PEFT keeps a repeated id twice
        task_type="CAUSAL_LM",
        # embeddings trained whole stay the output head's weight where the model ties them; PEFT would otherwise
        # train a copy for one of the two and leave the other as it was (trained rows it ties itself). Given only
        # then: PEFT 0.17 has no such field
        **(
            {"ensure_weight_tying": True}
            if ties_embeddings(model) and _embedding_modules(model, cfg.modules_to_save)
            else {}
        ),
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
    """Store the frozen Linear weights and expert stacks of ``model``'s decoder layers as ``kind`` (``none`` leaves
    them); returns how many were quantized. A weight whose size (an expert's, in a stack) is not a whole number of
    64-value blocks stays as it is, and so does a stack that carries adapters (PEFT's ``target_parameters``).

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
    adapted = {(id(m.get_base_layer()), m.parameter_name) for m in model.modules() if hasattr(m, "parameter_name")}
    for layer in decoder_layers(model):
        for module in list(layer.modules()):  # not the parametrizations added on the way
            weight = getattr(module, "weight", None)
            if isinstance(module, torch.nn.Linear) and not weight.requires_grad and weight.numel() % NF4_BLOCK == 0:
                module.weight = torch.nn.Parameter(_nf4(weight, to_nf4), requires_grad=False)
                count += 1
            for name, stack in list(module.named_parameters(recurse=False)):
                if _expert_stack(stack) and (id(module), name) not in adapted:
                    _quantize_stack(module, name, stack, to_nf4)
                    count += 1
    return count


def _nf4(weight: torch.Tensor, to_nf4) -> torch.Tensor:
    """``weight`` (2-D) as an NF4 tensor, in blocks of 64 values under the largest scaler block that divides them."""
    blocks = weight.numel() // NF4_BLOCK
    scaler_block = next(b for b in NF4_SCALER_BLOCKS if blocks % b == 0)
    nf4 = _fake_nf4(weight) if is_fake(weight) else None
    if nf4 is None:
        nf4 = to_nf4(weight.detach(), NF4_BLOCK, scaler_block)
        _remember_layout(weight, nf4)
    return nf4


def _expert_stack(p: torch.Tensor) -> bool:
    """A frozen 3-D weight (experts x out x in: a mixture of experts' stacked projections), each expert of whole
    64-value blocks."""
    return p.dim() == 3 and not p.requires_grad and p.is_floating_point() and p[0].numel() % NF4_BLOCK == 0


NF4_GROUP_VALUES = 1 << 26
"""Values per NF4 tensor of an expert stack, at most (or one expert where an expert holds more): torchao's
dequantization holds two 64-bit codes per byte of a tensor, 4x its bf16 size, while it runs; a stack dequantized
group by group holds that for one group (512 MiB at most beside one expert's), not for the whole stack (7.5 GB
for a Mixtral-8x7B layer's gate_up_proj), and a trace builds a few NF4 tensors a stack, not one per expert (128 a
Qwen3-30B-A3B stack: its plan took 189 s with one per expert, 16.5 s with groups)."""


class _Dequantized(torch.nn.Module):
    """The parametrization of a quantized expert stack, held as NF4 tensors of whole experts (``NF4_GROUP_VALUES``):
    reading ``module.<name>`` dequantizes them, group by group, into a tensor of the stack's shape and dtype. That
    tensor is marked with its source, so that autograd saves the NF4 groups for backward in its place
    (``_nf4_saved_tensors_hooks``) and dequantizes them there."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, to_nf4):
        super().__init__()
        self.shape, self.dtype, self.to_nf4 = tuple(shape), dtype, to_nf4
        experts, out, inner = self.shape
        self.group = max(1, min(experts, NF4_GROUP_VALUES // (out * inner)))

    def right_inverse(self, stack: torch.Tensor) -> tuple[torch.Tensor, ...]:
        groups = stack.detach().split(self.group)
        return tuple(_nf4(g.reshape(-1, g.shape[-1]), self.to_nf4) for g in groups)

    def forward(self, *groups: torch.Tensor) -> torch.Tensor:
        stack = self._dequantized(groups, self.shape[0])
        stack._memfit_nf4 = (groups, self)  # the _base of every view of it (an expert, a transpose)
        return stack

    def _dequantized(self, groups: tuple[torch.Tensor, ...], experts: int) -> torch.Tensor:
        """``groups``, consecutive, dequantized into one tensor of ``experts`` of the stack's experts."""
        out = torch.empty((experts, *self.shape[1:]), dtype=self.dtype, device=groups[0].device)
        for held, group in zip(out.split(self.group), groups):
            held.copy_(group.to(self.dtype).view(held.shape))
        return out

    def view_of(self, groups: tuple[torch.Tensor, ...], size, stride, offset: int) -> torch.Tensor:
        """The view ``(size, stride, offset)`` of the stack that autograd saved, dequantized from the groups it
        reads alone: one expert's weight (transformers' eager experts loop saves each expert's) costs its group,
        not the whole stack (a Mixtral-8x7B layer's gate_up_proj: 235 MB, not 1.9 GB, once per expert)."""
        if not all(size):  # an empty view reads no expert
            return torch.empty_strided(size, stride, dtype=self.dtype, device=groups[0].device)
        per_group = self.group * self.shape[1] * self.shape[2]
        last = offset + sum((n - 1) * s for n, s in zip(size, stride))
        first_group, last_group = offset // per_group, last // per_group
        experts = min(self.shape[0], (last_group + 1) * self.group) - first_group * self.group
        held = self._dequantized(groups[first_group : last_group + 1], experts)
        return held.as_strided(size, stride, offset - first_group * per_group)


def _outer_saved_tensors_hooks() -> tuple | None:
    """The saved-tensor hooks open where a module runs (activation checkpointing's, activation offloading's, the
    planner's tracker's), which hooks opened inside it would otherwise hide: torch keeps only the innermost."""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, TypeError, RuntimeError):  # a private API: a torch without it has none to pass on to
        return None


def _nf4_saved_tensors_hooks() -> torch.autograd.graph.saved_tensors_hooks:
    """Hooks under which every dequantized stack that autograd saves for backward (the weight of a matmul whose input
    needs a gradient) is saved as its NF4 groups and dequantized again when backward reads it: a layer's experts
    exist at full width only while its matmuls run, as an NF4 Linear's weight does. Every other saved tensor goes to
    the hooks open outside (so that checkpointing drops it, offloading moves it, the planner counts it)."""
    outer_pack, outer_unpack = _outer_saved_tensors_hooks() or (None, None)

    def pack(t: torch.Tensor):
        root = t if t._base is None else t._base
        source = getattr(root, "_memfit_nf4", None)
        if source is not None:
            return True, (source, t.size(), t.stride(), t.storage_offset())
        return False, outer_pack(t) if outer_pack else t

    def unpack(packed):
        nf4, value = packed
        if nf4:
            (groups, stack), size, stride, offset = value
            return stack.view_of(groups, size, stride, offset)
        return outer_unpack(value) if outer_unpack else value

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _open_nf4_hooks(module: torch.nn.Module, args) -> None:
    """Before an experts module's forward: its saved tensors under ``_nf4_saved_tensors_hooks``, and each stack
    dequantized once however often the forward reads it (transformers' eager loop reads it once per expert)."""
    opened = contextlib.ExitStack()
    opened.enter_context(parametrize.cached())
    opened.enter_context(_nf4_saved_tensors_hooks())
    module._nf4_hooks.append(opened)


def _close_nf4_hooks(module: torch.nn.Module, args, output) -> None:
    module._nf4_hooks.pop().close()


def _quantize_stack(module: torch.nn.Module, name: str, stack: torch.Tensor, to_nf4) -> None:
    """Store ``module.<name>`` (an expert stack) as NF4 groups of experts behind a ``_Dequantized`` parametrization, the
    module's forward under ``_nf4_saved_tensors_hooks`` (module hooks, so that a copy of the module keeps them)."""
    parametrize.register_parametrization(module, name, _Dequantized(stack.shape, stack.dtype, to_nf4), unsafe=True)
    if not hasattr(module, "_nf4_hooks"):
        module._nf4_hooks = []
        module.register_forward_pre_hook(_open_nf4_hooks)
        module.register_forward_hook(_close_nf4_hooks, always_call=True)


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
