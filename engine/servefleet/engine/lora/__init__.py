"""LoRA adapters on a shared base model: read (`adapter`), held (`registry`), applied
per step (`batch`)."""
