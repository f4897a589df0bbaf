"""What exists, before any spec: the vocabulary a spec names. Pure data and arithmetic, no I/O.

    presets.py  model architectures built from config (`gpt2-medium`, `llama-7b`, ...): their shapes
    gpus.py     GPU types people type (`H100`, `RTX3080-20GB`): memory, vendor, 16-bit peak
    tiers.py    the memory tier ladder (`fast` ... `minimal`) and the micro-batches a batch allows
"""
