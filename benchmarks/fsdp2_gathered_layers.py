"""Which decoder layers FSDP2 holds gathered at each point of a ZeRO-3 step (the planner's ZeRO-3 rule reads this).

    torchrun --nproc_per_node 2 benchmarks/fsdp2_gathered_layers.py full    # or: lora

A 4-layer random Llama, ``fully_shard`` on every layer (``reshard_after_forward=True``) and on the root (False), as
``memfit.distributed.engines`` shards it, on gloo. Rank 0 prints, per layer, 1 where its parameters are gathered, 10
where an all-gather of them is in flight (its output already allocated), at each layer's forward, at the start of
backward (the loss's gradient), at the logits' gradient (the root's pre-backward: the head's backward follows), at the
gradient of each layer's output (just before that layer's backward), and after backward.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
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

    def say(where: str):
        def hook(*_):
            if dist.get_rank() == 0:
                groups = [layer._get_fsdp_state()._fsdp_param_group for layer in layers]
                held = [
                    int(g.is_unsharded) + 10 * int(getattr(g, "_all_gather_result", None) is not None) for g in groups
                ]
                print(f"{what:4} {where:40} {held}", flush=True)

        return hook

    def on_output(i: int):
        def hook(module, args, out):
            (out[0] if isinstance(out, tuple) else out).register_hook(say(f"gradient of layer {i}'s output"))

        return hook

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(say(f"layer {i} forward starts"))
        layer.register_forward_hook(on_output(i))
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    logits = model(input_ids=ids).logits
    logits.register_hook(say("logits' gradient (the head's backward next)"))
    loss = torch.nn.functional.cross_entropy(logits.float().view(-1, cfg.vocab_size), ids.view(-1))
    loss.register_hook(say("the loss's gradient (backward starts)"))
    loss.backward()
    say("after backward")()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
