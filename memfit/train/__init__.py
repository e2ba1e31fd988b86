"""The fine-tuning loop, its data and its checkpoints."""
