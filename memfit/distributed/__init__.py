"""Multi-process training: torchrun launch, the process group, FSDP2 / DDP / ZeRO-1 / DeepSpeed engines."""
