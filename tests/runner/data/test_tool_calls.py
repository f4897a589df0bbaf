"""Tool-calling chats (runner/data/tools.py): the record's tools and the replies' calls rendered by the chat
template, the assistant's turns (its calls included) the only targets, the same on every masking path, and every
malformed record refused with its line."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from jobspec.errors import ConfigError
from runner.data.dataset import encode_file, flatten
from runner.data.prepare import render_chunk
from runner.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from runner.data.tools import ToolChat, tool_chat
from tests.runner.train_helpers import save_test_tokenizer, tiny_spec, write_jsonl

SPECIALS = ("<|end|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>")
# A Hermes/Qwen-style template: the tools in a system turn, each call a <tool_call> line after the reply's content,
# a tool's result a user turn in <tool_response>.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|system|>You may call these functions:{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "<|end|>{% endif %}"
    "{%- for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}\n<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}<|end|>"
    "{% elif m['role'] == 'tool' %}<|user|><tool_response>{{ m['content'] }}</tool_response><|end|>"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)
# The same text, each reply and its end of turn in a generation block (transformers' own mask: path 1).
TOOLS_GENERATION = TOOLS_TEMPLATE.replace(
    "<|assistant|>{{ m['content'] }}", "<|assistant|>{% generation %}{{ m['content'] }}"
).replace("</tool_call>{% endfor %}<|end|>", "</tool_call>{% endfor %}<|end|>{% endgeneration %}")
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "parameters": CITY}


def weather_chat() -> list[dict]:
    return [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "Weather in Paris and Köln?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "c2", "name": "get_weather", "arguments": '{"city": "Köln"}'}]},  # bare, JSON text: normalized
        {"role": "tool", "name": "get_weather", "tool_call_id": "c1", "content": "22 C, sunny"},
        {"role": "tool", "name": "get_weather", "tool_call_id": "c2", "content": "18 C, rain"},
        {"role": "assistant", "content": "Paris 22 C and sunny; Köln 18 C with rain."},
    ]  # fmt: skip


REPLY_TEXTS = [
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Köln"}}</tool_call><|end|>',
    "Paris 22 C and sunny; Köln 18 C with rain.<|end|>",
]


def hf(tmp_path: Path, template: str) -> HFTokenizer:
    save_test_tokenizer(tmp_path, template, specials=SPECIALS)
    tok = load_tokenizer(str(tmp_path), 10_000)
    assert isinstance(tok, HFTokenizer)
    return tok


def target_texts(tok: HFTokenizer, ids: np.ndarray, flags: np.ndarray) -> list[str]:
    """The decoded runs of targets, in order."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], flags.astype(int), [0]))))
    return [tok.tok.decode(ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def test_a_tool_chat_is_normalized_as_the_templates_expect():
    chat = tool_chat(weather_chat(), json.dumps([WEATHER]))  # tools as JSON text, as many data sets store them
    assert isinstance(chat, ToolChat) and chat.tools == [{"type": "function", "function": WEATHER}]
    calls = chat[2]["tool_calls"]
    assert chat[2]["content"] == ""
    assert calls[1] == {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Köln"}},
                        "id": "c2"}  # fmt: skip
    again = pickle.loads(pickle.dumps(chat))  # to the tokenizing pool's workers
    assert isinstance(again, ToolChat) and again == chat and again.tools == chat.tools


@pytest.mark.parametrize("template", [TOOLS_TEMPLATE, TOOLS_GENERATION], ids=["markers-then-prefixes", "generation"])
def test_replies_and_their_calls_are_the_targets_and_tool_results_are_not(tmp_path, template):
    tok = hf(tmp_path, template)
    chat = tool_chat(weather_chat(), [WEATHER])
    ids, flags = flatten(tok.render(chat), 10_000)
    assert target_texts(tok, ids, flags) == REPLY_TEXTS
    text = tok.tok.decode(ids.tolist())
    assert text == tok.tok.apply_chat_template(list(chat), tools=chat.tools, tokenize=False)  # nothing lost or added
    assert '"description": "Current weather in a city"' in text and "<tool_response>18 C, rain" in text
    batch_ids, batch_flags = tok.render_batch([chat])[0]  # the batched path agrees
    assert batch_ids.tolist() == ids.tolist() and batch_flags.tolist() == flags.tolist()


def test_every_masking_path_gives_the_same_ids_and_targets(tmp_path):
    chats = [tool_chat(weather_chat(), [WEATHER]), tool_chat(weather_chat()[:2] + weather_chat()[-1:], [WEATHER])]
    got = {}
    for name, template in (("markers", TOOLS_TEMPLATE), ("generation", TOOLS_GENERATION)):
        tok = hf(tmp_path / name, template)
        got[name] = [(i.tolist(), f.tolist()) for i, f in tok.render_batch(chats)]
        tok.mask_from = "prefixes"  # path 3, which any incremental template takes
        got[f"{name}-prefixes"] = [(i.tolist(), f.tolist()) for i, f in tok.render_batch(chats)]
    assert len({json.dumps(v) for v in got.values()}) == 1, list(got)


def test_the_byte_tokenizer_and_its_export_render_tools_alike():
    tok = ByteTokenizer()
    chat = tool_chat(weather_chat(), [WEATHER])
    ids, flags = tok.render_ids(chat)
    assert [ids.tolist(), flags.tolist()] == [a.tolist() for a in flatten(tok.render(chat), 10_000)]
    exported = tok.to_hf()
    assert (
        exported.apply_chat_template(list(chat), tools=chat.tools, tokenize=True, return_dict=True)["input_ids"]
        == ids.tolist()
    )  # what an export ships renders the ids the model was trained on
    reply = tok.decode(ids[flags])
    assert reply.startswith('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    assert "22 C, sunny" not in reply and "Current weather" not in reply  # results and tools are prompt
    assert (ids == ByteTokenizer.TOOL).sum() == 2


def test_a_template_that_cannot_show_tools_is_refused_before_training(tmp_path):
    tok = hf(tmp_path, "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}")
    with pytest.raises(ConfigError, match="does not render tools") as err:
        tok.render(tool_chat(weather_chat(), [WEATHER]))
    assert err.value.exit_code == 2
    with pytest.raises(ConfigError, match="does not render tool_calls"):
        tok.render(tool_chat(weather_chat(), None))


def test_a_tool_chat_trains_through_the_data_pipeline(tmp_path):
    plain = [*weather_chat()[:2], {"role": "assistant", "content": "One moment."}]  # no tools: the plain path
    rows = [*[{"messages": weather_chat(), "tools": [WEATHER]}] * 3, {"messages": plain}]
    data = write_jsonl(tmp_path / "tools.jsonl", rows)
    spec = tiny_spec(tmp_path / "run", data={"path": str(data), "max_seq_len": 512})
    streams = encode_file(data, spec.data, ByteTokenizer())
    assert len(streams) == 4
    ids, flags = render_chunk(ByteTokenizer(), [tool_chat(weather_chat(), [WEATHER])], 10_000)[:2]
    assert streams[0][0].tolist() == ids.tolist() and streams[0][1].tolist() == flags.tolist()


BAD = [
    ({"role": "user", "content": "x", "tool_calls": [{"name": "f", "arguments": {}}]}, "only an assistant message"),
    ({"role": "assistant", "tool_calls": "get_weather(Paris)"}, "tool_calls must be a list"),
    ({"role": "assistant", "tool_calls": []}, "tool_calls must be a list of 1"),
    ({"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}, "a function needs a name"),
    ({"role": "assistant", "tool_calls": [{"name": "f\nrole: system", "arguments": {}}]}, "printable string"),
    ({"role": "assistant", "tool_calls": [{"name": "f", "arguments": "{city: Paris"}]}, "arguments is a string but"),
    ({"role": "assistant", "tool_calls": [{"name": "f", "arguments": [1, 2]}]}, "arguments must be an object"),
    ({"role": "tool", "content": {"temp": 22}}, "the tool's result as a string"),
    ({"role": "tool", "content": "22", "tool_call_id": 7}, "tool_call_id must be a string"),
]


@pytest.mark.parametrize(("message", "match"), BAD, ids=[m for _, m in BAD])
def test_a_malformed_tool_message_is_refused_with_its_line(tmp_path, message, match):
    rows = [{"messages": weather_chat(), "tools": [WEATHER]},
            {"messages": [{"role": "user", "content": "hi"}, message]}]  # fmt: skip
    data = write_jsonl(tmp_path / "tools.jsonl", rows)
    spec = tiny_spec(tmp_path / "run", data={"path": str(data), "max_seq_len": 512})
    with pytest.raises(ConfigError, match=match) as err:
        encode_file(data, spec.data, ByteTokenizer())
    assert "tools.jsonl:2" in str(err.value) and err.value.exit_code == 2


@pytest.mark.parametrize(
    ("tools", "match"),
    [
        ({"name": "f"}, "must be a list of 1 to"),
        ("[{]", "not JSON"),
        ([{"type": "retrieval"}], "only function tools"),
        ([{"type": "function", "function": {"description": "no name"}}], "a function needs a name"),
        ([WEATHER] * 257, "must be a list of 1 to 256"),
    ],
    ids=["not-a-list", "bad-json", "not-a-function", "no-name", "too-many"],
)
def test_malformed_tools_are_refused_with_their_line(tmp_path, tools, match):
    data = write_jsonl(tmp_path / "tools.jsonl", [{"messages": weather_chat(), "tools": tools}])
    spec = tiny_spec(tmp_path / "run", data={"path": str(data), "max_seq_len": 512})
    with pytest.raises(ConfigError, match=match) as err:
        encode_file(data, spec.data, ByteTokenizer())
    assert "tools.jsonl:1" in str(err.value)


def test_preference_pairs_and_kto_records_carry_their_tools(tmp_path):
    """TRL's preference and KTO records take a `tools` column too: both chats of a pair render them, and the
    completion's calls are its targets."""
    from runner.data.dataset import record_chats
    from runner.data.unpaired import record_chats as kto_chats

    spec = tiny_spec(tmp_path / "run").data
    calls = weather_chat()[2]
    record = {"prompt": weather_chat()[:2], "chosen": [calls], "tools": [WEATHER],
              "rejected": [{"role": "assistant", "content": "I cannot look that up."}]}  # fmt: skip
    pair = [chat for chat, _, _ in record_chats(record, "preference", spec, 10**6, 10**4, "pairs.jsonl:1")]
    kto = kto_chats({"prompt": weather_chat()[:2], "completion": [calls], "label": True, "tools": [WEATHER]}, spec)
    tok = ByteTokenizer()
    for chat in [*pair, *kto]:
        assert isinstance(chat, ToolChat) and chat.tools == [{"type": "function", "function": WEATHER}]
        ids, _ = tok.render_ids(chat)
        assert tok.decode(ids).startswith("tools: ")
    chosen_ids, chosen_flags = tok.render_ids(pair[0])
    assert tok.decode(chosen_ids[chosen_flags]).startswith('<tool_call>{"name": "get_weather"')
