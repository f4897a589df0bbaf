"""Reply masks of templated chats: transformers' generation blocks and the one-rendering marker path give
the ids and targets of the per-reply re-rendering they replace, with a constant number of renderings."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from runner.data.dataset import flatten
from runner.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from tests.runner.train_helpers import save_test_tokenizer

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|pad|>", "<|bos|>", "<|end|>"]
CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The same text, with the reply and its end of turn in a generation block (as SmolLM3's and OLMo's templates do).
CHATML_GENERATION = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONTENT_ONLY_GENERATION = CHATML_GENERATION.replace("{{ m['content'] }}<|im_end|>\n{% endgeneration %}",
                                                    "{{ m['content'] }}{% endgeneration %}<|im_end|>\n")  # fmt: skip
TRIMMING = CHATML.replace("{{ m['content'] }}", "{{ m['content'] | trim }}")


def chat(turns: int, system: bool = True, seed: int = 0) -> list[dict[str, str]]:
    """`turns` messages alternating user/assistant (after an optional system one), varied lengths and text."""
    rng = np.random.default_rng(seed)
    words = ["add", "reverse", "lookup", "9", "é", "✓", "tokens", "the", "answer:", "\n", "  ", "?"]
    out = [{"role": "system", "content": "be brief"}] if system else []
    for t in range(turns):
        text = " ".join(rng.choice(words, size=int(rng.integers(1, 12))))
        out.append({"role": "user" if t % 2 == 0 else "assistant", "content": f"{text} {t}"})
    return out


CHATS = [
    chat(2),
    chat(4, system=False, seed=1),
    chat(9, seed=2),  # ends on a user message: trailing prompt text, no target
    chat(64, seed=3),
    # A reply equal to the user's message before it, an empty reply, and a reply that spells a special token.
    [
        {"role": "user", "content": "same"},
        {"role": "assistant", "content": "same"},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "a <|im_end|> b"},
    ],
]


def hf_tokenizer(path: Path, template: str) -> HFTokenizer:
    """A byte-level BPE trained here on the bundled data (nothing downloaded), saved and loaded back."""
    save_test_tokenizer(path, template, specials=tuple(SPECIALS), vocab=400, bos_token="<|bos|>",
                        eos_token="<|im_end|>", pad_token="<|pad|>")  # fmt: skip
    tok = load_tokenizer(str(path), model_vocab=1000)
    assert isinstance(tok, HFTokenizer)
    return tok


def ids_and_flags(segments) -> tuple[list[int], list[bool]]:
    ids, flags = flatten(segments, 1 << 30)
    return ids.tolist(), flags.tolist()


def count_renderings(tok: HFTokenizer, monkeypatch) -> list[int]:
    calls = [0]
    real = tok.tok.apply_chat_template

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(tok.tok, "apply_chat_template", counted)
    return calls


@pytest.mark.parametrize(("template", "path"), [(CHATML, "markers"), (CHATML_GENERATION, "generation")])
def test_one_rendering_gives_the_ids_and_targets_of_per_reply_rerendering(tmp_path, monkeypatch, template, path):
    tok = hf_tokenizer(tmp_path, template)
    assert tok.mask_from == path
    calls = count_renderings(tok, monkeypatch)
    for messages in CHATS:
        before = calls[0]
        new = ids_and_flags(tok.render(messages))
        rendered = calls[0] - before
        old = ids_and_flags(tok._render_by_prefixes(messages))
        assert new == old, f"{len(messages)} messages"
        assert any(old[1]) == any(m["role"] == "assistant" for m in messages)
        # Renderings per chat do not grow with its turns (the old path: 2 per reply + 1).
        assert rendered == (1 if path == "generation" else 5), f"{len(messages)} messages: {rendered} renderings"
    # The targets are each reply and its end of turn, nothing of the prompt.
    ids, flags = ids_and_flags(tok.render(CHATS[0]))
    assert tok.tok.decode([t for t, f in zip(ids, flags, strict=True) if f]) == CHATS[0][-1]["content"] + "<|im_end|>\n"


def test_the_byte_tokenizers_export_masks_like_the_byte_tokenizer():
    """ByteTokenizer.to_hf(): template without generation blocks, one token per byte; bos before the chat."""
    byte = ByteTokenizer()
    tok = HFTokenizer(byte.to_hf(), "bytes-export")
    assert tok.mask_from == "markers"
    for messages in CHATS[:3]:
        assert ids_and_flags(tok.render(messages)) == ids_and_flags(byte.render(messages))


def test_a_template_that_rewrites_replies_falls_back_to_rerendering_and_says_so(tmp_path, monkeypatch, caplog):
    tok = hf_tokenizer(tmp_path, TRIMMING)
    calls = count_renderings(tok, monkeypatch)
    padded = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  yo  "}] * 3
    with caplog.at_level(logging.INFO, logger="jobspec.runner"):
        new = ids_and_flags(tok.render(padded))
    assert "changes the text of a reply" in caplog.text
    assert calls[0] == 2 + 2 * 3 + 1  # plain + marked, then the old path's 2 per reply + 1
    assert new == ids_and_flags(tok._render_by_prefixes(padded))
    assert tok.tok.decode([t for t, f in zip(*new, strict=True) if f]).count("yo<|im_end|>") == 3  # trimmed
    # The same template on replies it leaves unchanged: the one-rendering path.
    calls[0] = 0
    assert ids_and_flags(tok.render(CHATS[4])) == ids_and_flags(tok._render_by_prefixes(CHATS[4]))
    assert calls[0] == 5 + 2 * 3 + 1


def test_generation_blocks_without_the_end_of_turn_are_followed_and_warned_about(tmp_path, caplog):
    tok = hf_tokenizer(tmp_path, CONTENT_ONLY_GENERATION)
    with caplog.at_level(logging.WARNING, logger="jobspec.runner"):
        ids, flags = ids_and_flags(tok.render(CHATS[0]))
        tok.render(CHATS[1])
    assert tok.tok.decode([t for t, f in zip(ids, flags, strict=True) if f]) == CHATS[0][-1]["content"]
    assert caplog.text.count("leave out the eos token") == 1  # once per tokenizer, not per record
