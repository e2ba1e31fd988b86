"""Building and loading models: HF checkpoints, the embedded SmolLM2, named presets."""
