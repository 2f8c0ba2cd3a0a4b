"""Llama-family decoder (``llama``), its config and presets (``config``),
loaders for GGUF / HF checkpoints with an orbax cache (``loaders``) and the
tokenizer wrapper (``tokenizer``)."""
