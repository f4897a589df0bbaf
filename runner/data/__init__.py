"""Training data: records from files -> token rows -> micro-batches, in an order a resume repeats.

records.py    records from JSON lines, a JSON array, Parquet, a `datasets` directory or a hub id
limits.py     the bounds on a record (size, nesting, numbers) and JSON parsing that keeps to them
files.py      data files as regular files, opened without blocking; a datasets directory's files inside it
tables.py     Arrow batches (Parquet, datasets) as records, in memory that follows the batch
tokenizer.py  the byte-level tokenizer of the presets and transformers' for `model.path`
dataset.py    records -> token rows with prompt-masked labels; the order steps consume them
pairs.py      a preference record (TRL's conventions) as its chosen and rejected chats
preference.py preference pairs as rows kept together: chosen then rejected in one micro-batch
tokens.py     the tokenized records stored flat (~3 bytes a token) and the rows over them
loader.py     micro-batches collated ahead of the loop by DataLoader workers
make_sft.py   regenerates the bundled synthetic set (`sft_synthetic.jsonl`)
"""
