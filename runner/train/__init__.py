"""Training one rank, top to bottom (torchtune's recipe shape). Read in this order:

    recipe.py   `Recipe(spec)`: `setup()`, `train()`, `cleanup()`
    stepdown.py the in-process tier step-down, each phase logged
    outputs.py  the train records, the summary, the export and its benchmarks
    step.py     one optimizer step, evaluation, the LR schedule, the stop flag
    update.py   the end of a step as a transaction: exchange, clipping and the optimizer step, recoverable from
                an OOM at any op on any rank
    loss.py     the chunked cross-entropy inside the output layer: the (tokens x vocab) fp32 logits never whole
    dpo.py      sigmoid DPO as TRL computes it, and TRL's metric names
    objectives.py  the preference objectives (dpo, ipo, simpo, orpo): a micro-batch of pairs -> loss and metrics
    kto.py      KTO on unpaired records and their KL rows, as TRL's KTOTrainer computes it
    reference.py   DPO's reference log-probs: one pass of the starting model, cached beside the data
    engine.py   accelerate for one plan: DDP for `fast`, FSDP2 for the other tiers, mixed precision
    offload.py  `zero2_offload`'s optimizer: Adam's states and step on the host (torchao)
    handoff.py  the trained state handed to the next tier in memory
    trace.py    the memory oracle: this step on FakeTensors under torch's memory tracker (`jobspec plan --trace`)
"""
