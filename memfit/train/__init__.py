"""The fine-tuning run: the loop, its data, checkpoints (one process and sharded), export and run directory."""
