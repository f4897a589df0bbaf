"""The bytes one value takes in each role the memory model counts: the constants every part of it shares
(jobspec/plan/adapters.py, activations.py, fsdp_peak.py, memory.py)."""

# Trainable parameters are fp32 with AdamW's m and v (fp32): 4 + 4 (gradient) + 8. A frozen LoRA base is
# held at the training width (2 bytes); its adapters are fp32.
MASTER_BYTES = 4
FROZEN_BYTES = 2
GRAD_BYTES = 4
ADAM_BYTES = 8
HALF_BYTES = 2  # a 16-bit copy: autocast's weight casts, FSDP2's gathered parameters
