"""No host synchronisation inside a training step that is not needed (issue 42): a step that logs nothing reads
nothing back from the device, so the host queues the next work while the GPU runs the last.

On the CPU a host sync cannot be seen as a wait; what causes one can: every read of a device value by the host goes
through `aten._local_scalar_dense` (`.item()`, `float()`, `bool()`, `if tensor:`, `.all()` in a condition, `.tolist()`)
or an op whose output size depends on the values (`nonzero`, `masked_select`, `unique`). A dispatch mode counts them
during one step of the runner's own Recipe (`train_step`, the OOM guard, the loss head, the update), after two warm-up
steps. The GPU's view (`torch.cuda.set_sync_debug_mode`) is the gpu test's.

Found so far and removed: transformers' search for packed sequences (`masking_utils.find_packed_sequence_indices`)
read `.all()` of the position ids on every forward (runner/internals/states.py `packed_search`); the loss head
compared the incoming gradient of per-token losses on the host in every backward (runner/train/loss.py).
"""

from __future__ import annotations

import collections
import traceback

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from tests.runner.train.test_dpo import dpo, text_pairs
from tests.runner.train_helpers import tiny_spec, write_jsonl

READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique", "aten.unique",
         "aten.is_nonzero", "aten.equal")  # fmt: skip


class HostReads(TorchDispatchMode):
    """Each op that reads device values back to the host, with the runner's or transformers' line that asked."""

    def __init__(self) -> None:
        super().__init__()
        self.found: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(READS):
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
            self.found[f"{name} at {frames[-1].filename}:{frames[-1].lineno}"] += 1
        return func(*args, **(kwargs or {}))


def reads_in_a_step(spec) -> collections.Counter[str]:
    from runner.train.recipe import Recipe

    recipe = Recipe(spec)
    try:
        recipe.setup()
        recipe.train_step(0)
        recipe.train_step(1)
        with HostReads() as reads:
            recipe.train_step(2)
    finally:
        recipe.cleanup()
    return reads.found


STEP = {"log_every": 100, "steps": 6, "global_batch": 8, "micro_batch": 4, "precision": "bf16", "warmup_steps": 1}


@pytest.mark.parametrize(
    ("preset", "sections"),
    [("llama-tiny", {}), ("tiny", {}),
     ("llama-tiny", {"model": {"lora": {"rank": 4, "targets": ["q_proj", "v_proj"]}}}),
     ("tiny", {"memory": {"tier": "zero2"}}), ("llama-tiny", {"data": {"packing": True}})],
    ids=["llama", "gpt2", "llama-lora", "gpt2-zero2", "llama-packed"],
)  # fmt: skip
def test_a_step_that_logs_nothing_reads_nothing_back_from_the_device(tmp_path, preset, sections):
    model = {"preset": preset, **sections.pop("model", {})}
    data = {"max_seq_len": 64, **sections.pop("data", {})}
    spec = tiny_spec(tmp_path / "run", model=model, training=STEP, data=data, **sections)
    assert reads_in_a_step(spec) == {}


def test_a_preference_step_reads_nothing_back_either(tmp_path):
    spec = dpo(tmp_path, write_jsonl(tmp_path / "pairs.jsonl", text_pairs()), log_every=100, precision="bf16")
    assert reads_in_a_step(spec) == {}


def test_the_counter_sees_a_read(tmp_path):
    """The dispatch mode finds what it is there to find: an `.item()` inside the step."""
    from runner.train import step

    spec = tiny_spec(tmp_path / "run", model={"preset": "llama-tiny"}, training=STEP, data={"max_seq_len": 64})
    original = step.summed_loss

    def reading(*args, **kwargs):
        out = original(*args, **kwargs)
        out.item()
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(step, "summed_loss", reading)
        found = reads_in_a_step(spec)
    assert sum(found.values()) == 2 and all("_local_scalar_dense" in k for k in found), found  # two micro-batches


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_on_a_gpu_a_step_that_logs_nothing_synchronises_nothing(tmp_path):
    """The GPU's own view: torch's sync debug mode warns at every host synchronisation CUDA does (a read back, a
    blocking copy, a synchronize) during one non-logged step of the runner at tier fast, bf16; each is printed."""
    import warnings

    import torch

    from runner.train.recipe import Recipe

    spec = tiny_spec(tmp_path / "run", model={"preset": "llama-tiny"}, training=STEP, data={"max_seq_len": 256},
                     hardware={"vendor": "cuda", "gpus": 1})  # fmt: skip
    recipe = Recipe(spec)
    try:
        recipe.setup()
        recipe.train_step(0)
        recipe.train_step(1)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                recipe.train_step(2)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        recipe.cleanup()
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
    print(f"host syncs in a non-logged step: {len(syncs)}", *syncs, sep="\n  ")
    assert syncs == []
