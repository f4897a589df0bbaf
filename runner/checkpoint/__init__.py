"""Checkpoints: written so that no crash loses the last good one, read back only when they check out.

    store.py     save and load (DCP, sharded when the model is), atomically, with a DONE marker; RNG state
    manifest.py  every file's size and CRC-32, written at save and checked before a resume
    storage.py   room on the volume for the next checkpoint; write errors that retrying cannot fix
    lease.py     one writer per run directory (a lease file rank 0 renews)
    lineage.py   which checkpoints a run may continue (same job, model, data and global batch)
"""
