"""Online reinforcement learning: GRPO's rollouts, sampled by the model in the pod and scored by reward functions.

Read in this order:
- runner/data/prompts.py (the data layer): TRL's prompt-only records, their generation-prompt ids and columns;
- rewards.py: the reward functions of `training.grpo.rewards` (built in, or a Python file the spec names);
- sampling.py: a generator per completion, so a step's completions do not depend on how it was batched;
- rollout.py: a step's groups of completions, their advantages and TRL's metrics, as micro-batches;
- runner/train/grpo.py (the train layer): the loss on those micro-batches, TRL's GRPO loss.
"""
