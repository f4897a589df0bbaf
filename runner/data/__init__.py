"""Training data: records from files -> token rows -> micro-batches, in an order a resume repeats.

    records.py    records from JSON lines, a JSON array, Parquet, a `datasets` directory or a hub id
    tokenizer.py  the byte-level tokenizer of the presets and transformers' for `model.path`
    dataset.py    records -> token rows with prompt-masked labels; the order steps consume them
    loader.py     micro-batches collated ahead of the loop by DataLoader workers
    make_sft.py   regenerates the bundled synthetic set (`sft_synthetic.jsonl`)
"""
