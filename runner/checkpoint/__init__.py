"""Checkpoints: written so that no crash loses the last good one, read back only when they check out.

    store.py     save and load (DCP, sharded when the model is), atomically, with a DONE marker
    verify.py    whether a checkpoint can be trusted before it is loaded; the newest intact one
    steps.py     the step-N directories of a run directory, found without torch (the supervisor's first look)
    manifest.py  every file's size and CRC-32, written at save and checked before a resume
    unpickle.py  DCP's pickles read without running code: restricted `.metadata`, weights-only byte items
    rng.py       each rank's RNG state, read with weights_only and checked for shape
    torchzip.py  torch.save zips checked before torch.load inflates anything (stored entries only)
    files.py     regular files only (no link, FIFO, device), every read bounded
    storage.py   room on the volume for the next checkpoint; write errors that retrying cannot fix
    lease.py     one writer per run directory (a lease file rank 0 renews)
    lineage.py   which checkpoints a run may continue (same job, model, data and global batch)
    stores.py    the object stores behind s3:// and gs:// (s3fs, gcsfs): conditional writes, pinned reads
    remote.py    checkpoints in a bucket: staged locally, published whole (manifest, then DONE), fetched and verified
    run_files.py the run's metrics and OOM-ladder state kept beside the steps, for a pod created again

The volume is not trusted: whatever its files hold, reading a checkpoint runs no code and cannot hang.
"""
