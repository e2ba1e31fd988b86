"""Which parameter groups FSDP2 holds whole at each point of a ZeRO-3 step (the planner's ZeRO-3 rule reads this).

    torchrun --nproc_per_node 2 benchmarks/fsdp2_gathered_layers.py full    # or: lora, chunked

A 4-layer random Llama, ``fully_shard`` on every layer (``reshard_after_forward=True``) and on the root (False), as
``memfit.distributed.engines`` shards it, on gloo. Rank 0 prints, for the root group and each layer, 1 where its
parameters are unsharded plus 10 where an all-gather's output of it is still allocated (in flight, or kept after its
copy-out), at each layer's forward (after FSDP's pre-forward), at every all-gather's copy-out, at the start of
backward (the loss's gradient), at the gradient of the model's output (the root's pre-backward: the head's backward
follows), at the gradient of each layer's output (just before that layer's backward), and after backward. ``chunked``
computes the loss inside the model's forward, as ``strategy.loss_chunks`` does: the model's output is the loss.
"""

from __future__ import annotations

import sys
import weakref

import torch
import torch.distributed as dist
import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
from peft import LoraConfig, get_peft_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "full"
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg)
    if what == "lora":
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    layers = model.get_decoder().layers
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    groups = [model._get_fsdp_state()._fsdp_param_group] + [
        layer._get_fsdp_state()._fsdp_param_group for layer in layers
    ]
    outputs: dict[int, list] = {}  # group index -> weak references to its all-gather outputs

    def say(where: str):
        def hook(*_):
            if dist.get_rank() == 0:
                held = [int(g.is_unsharded) + 10 * len(_alive(g, outputs.get(i, []))) for i, g in enumerate(groups)]
                print(f"{what:7} {where:46} root {held[0]:2}  layers {held[1:]}", flush=True)

        return hook

    wait_for_unshard, copy_out = param_group.FSDPParamGroup.wait_for_unshard, param_group.foreach_all_gather_copy_out

    def waiting(group):
        result = group._all_gather_result
        if result is not None:
            outputs.setdefault(groups.index(group), []).append(weakref.ref(result.all_gather_output))
        return wait_for_unshard(group)

    def copying(*args, **kwargs):
        say("an all-gather's copy-out starts")()
        return copy_out(*args, **kwargs)

    param_group.FSDPParamGroup.wait_for_unshard, param_group.foreach_all_gather_copy_out = waiting, copying

    def on_output(i: int):
        def hook(module, args, out):
            (out[0] if isinstance(out, tuple) else out).register_hook(say(f"gradient of layer {i}'s output"))

        return hook

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(say(f"layer {i} forward (after FSDP's pre-forward)"))
        layer.register_forward_hook(on_output(i))
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    if what == "chunked":  # the loss inside the model's forward, as memfit's ChunkedLoss computes it
        head = model.get_output_embeddings()
        project = head.forward
        head.forward = lambda h: torch.nn.functional.cross_entropy(
            project(h).float().view(-1, cfg.vocab_size), ids.view(-1), reduction="sum"
        )
        loss = model(input_ids=ids).logits
        loss.register_hook(say("the loss's gradient (the model's output)"))
    else:
        logits = model(input_ids=ids).logits
        logits.register_hook(say("logits' gradient (the model's output)"))
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, cfg.vocab_size), ids.view(-1))
        loss.register_hook(say("the loss's gradient (backward starts)"))
    say("forward done")()
    loss.backward()
    say("after backward")()
    dist.destroy_process_group()


def _alive(group, refs: list) -> set[int]:
    """The group's all-gather outputs still allocated: the one in flight (issued, not yet copied out), and those
    copied out that something still holds."""
    pending = group._all_gather_result
    alive = {id(ref()) for ref in refs if ref() is not None}
    return alive | ({id(pending.all_gather_output)} if pending is not None else set())


if __name__ == "__main__":
    main()
