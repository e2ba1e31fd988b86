"""Memory strategies: activation checkpointing, precision, LoRA, optimizer implementation, allocator."""
