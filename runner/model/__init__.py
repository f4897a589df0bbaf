"""The model a run trains: built from a preset config (no download) or a local path, LoRA through peft.

    build.py  `build_model(spec)`, the transformer block classes FSDP wraps, a LoRA base's width

Below training and export alike: both build the same module, so a checkpoint loads into what exported it.
"""
