"""memfit: fit LLM fine-tuning into GPU memory, and show where the memory went."""

__version__ = "0.1.0"
