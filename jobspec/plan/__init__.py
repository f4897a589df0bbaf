"""Before submit: how much memory and time a spec takes, tier by tier. Read in this order:

    widths.py       the bytes a value takes in each role (weights, gradients, moments, 16-bit copies)
    adapters.py     LoRA's targets per layer kind and the trainable parameters they add
    activations.py  what a step saves for backward per layer and token, and the loss head's chunks
    fsdp_peak.py    the FSDP2 tiers' peak moment and what is gathered then
    memory.py       the memory model: bytes per GPU for a shape, tier, sequence length and micro-batch
    throughput.py   FLOPs per token, the GPU's peak, step time and duration
    job_length.py   optimizer steps and tokens per step, from the spec (and the data when it is here)
    calibration.py  what earlier runs measured (their metrics.jsonl), scaled into the model
    planner.py      `jobspec plan`: a spec -> a `PlanReport` per tier; spec -> model shape, once
    output.py       the table and notes `jobspec plan` prints
    compare.py      `jobspec plan --gpus any`: the same job on every GPU type of the catalogue
    traced.py       `jobspec plan --trace`: the runner's own step traced in a process of its own (runner extra)

Shared with the runner (in the pod it sizes from the same model), so nothing here imports torch.
"""
