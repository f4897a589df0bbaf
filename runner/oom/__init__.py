"""Out-of-memory recovery, in one place. Read in this order:

    detect.py    is it an OOM (`is_oom`), run a step with the OOM as a flag (`guarded`), free memory
                 after the failed step (`release_memory`), the next divisor down (`next_micro_batch`)
    shrink.py    the loop's side: ranks agree on the OOM after every micro-step (`agreement`,
                 `raise_agreed`), redo the same step at a smaller micro-batch (`run_step`), FSDP reset,
                 and `RecipeGuard`, which hands a micro-batch-1 OOM to the ladder (`TierOOM`)
    ladder.py    the tier ladder's persisted state (`tier_state.json`): failed tiers, micro-batch caps,
                 the next tier, the termination message
    relaunch.py  the supervisor's fallback: a new worker process at the next tier (exit 75)
    faults.py    `JOBSPEC_FAULT_OOM`: real `torch.OutOfMemoryError`s on chosen steps, tiers, micro-batches,
                 ranks, and in the planner's probe steps
    anywhere.py  `op=N`: the dispatch mode that raises one before the N-th allocating op of a step, an
                 evaluation, a checkpoint or a probe step, wherever that op is (bench/oom_anywhere.py sweeps it)

The recipe (runner/train/recipe.py) steps down a tier in process (runner/train/stepdown.py) when every rank agreed
on the OOM, and leaves it to relaunch.py otherwise. The end of a step (clipping, the optimizer step) is
runner/train/update.py's transaction; evaluation (runner/train/step.py `Stepper.evaluate`) and checkpoints
(runner/checkpoint/store.py `CheckpointOOM`) agree on an OOM the same way. The planner's probe search
(runner/sizing/plan.py `verify_micro_batch`) is the same machinery before training starts.
"""
