"""Reward functions for examples/objectives/grpo_cpu.yaml, called as TRL's GRPOTrainer calls them: keyword arguments
`prompts`, `completions` (texts, or [{"role": "assistant", "content": ...}] for a chat prompt), `completion_ids` and
every other column of the records (here `topic`); one float (or None: not applicable) per completion."""


def _text(completion):
    return completion if isinstance(completion, str) else completion[-1]["content"]


def plain_words(completions, **columns):
    """The share of the completion's characters that are letters or spaces: 0 for noise, 1 for plain words."""
    texts = [_text(c) for c in completions]
    return [sum(ch.isalpha() or ch == " " for ch in t) / max(len(t), 1) for t in texts]


def mentions_topic(completions, topic, **columns):
    """1 when the completion names the record's topic, else 0."""
    return [float(t.lower() in _text(c).lower()) for c, t in zip(completions, topic, strict=True)]
