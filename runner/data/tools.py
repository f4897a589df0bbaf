"""Tool-calling chats: a record's `tools` (the functions the model may call) and its messages' `tool_calls` and
`role: tool` results, in the conventions of transformers' chat templates and TRL's SFTTrainer:

    {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "name": "get_weather", "content": "22 C, sunny"},
        {"role": "assistant", "content": "It is 22 C and sunny in Paris."}],
     "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]}

`tool_chat(messages, tools)` checks such a chat and returns it as a `ToolChat`: the messages, normalized, carrying the
record's tools. Normalized as the templates expect them: every call `{"type": "function", "function": {"name",
"arguments"}}` (a bare `{"name", "arguments"}` is wrapped), `arguments` an object (a JSON string, as many data sets
store it, is parsed: a template would otherwise quote it twice), an assistant message with calls and no content gets
content "", a tool result keeps its `name` and `tool_call_id`; `tools` may be a list or its JSON text, each tool a
`{"type": "function", "function": {...}}` or the bare function. The tokenizer renders the chat with `tools=`
(runner/data/tokenizer.py): the assistant's turns, its tool calls included, are the targets; tool results, like every
other message, are prompt. The record is data someone else wrote: counts, names and nesting are bounded, and every
fault is a ValueError that names the message and the fix (the caller adds the file and line).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from jobspec.untrusted import json_loads

TOOLS_FIELD = "tools"  # TRL's column name for the functions of a chat
MAX_TOOLS = 256  # functions a record may offer
MAX_CALLS = 64  # calls in one assistant message
MAX_NAME = 256  # characters of a function name


class ToolChat(list):
    """A chat's messages (a list, as every chat) and the tools its template renders with them (`tools`; None: the
    record offers none, its messages hold calls or results)."""

    def __init__(self, messages: Sequence[dict[str, Any]] = (), tools: list[dict[str, Any]] | None = None):
        super().__init__(messages)
        self.tools = tools

    def __reduce__(self) -> tuple[Any, ...]:  # to the tokenizing pool's workers with its tools (runner/data/prepare.py)
        return ToolChat, (list(self), self.tools)

    def like(self, messages: Sequence[dict[str, Any]]) -> ToolChat:
        """Other messages (a clipped copy) with the same tools."""
        return ToolChat(messages, self.tools)


def has_tools(messages: object, tools: object) -> bool:
    """Whether a chat record takes the tool path: tools offered, or a message that calls or answers one."""
    if tools is not None:
        return True
    return isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("tool_calls") is not None or m.get("role") == "tool") for m in messages
    )


def with_tools(messages: list[Any], record: object) -> list[Any]:
    """A chat of `record` (SFT messages, a preference pair's or a KTO record's chat) as a ToolChat when the record
    offers tools or the chat calls or answers one (`tool_chat`); else the messages as they are."""
    tools = record.get(TOOLS_FIELD) if isinstance(record, dict) else None
    return tool_chat(messages, tools) if has_tools(messages, tools) else messages


def tool_chat(messages: list[Any], tools: object) -> ToolChat:
    """The chat normalized as the module docstring says, with its tools; ValueError naming what is wrong."""
    offered = _tools(tools) if tools is not None else None
    return ToolChat([_message(m, i) for i, m in enumerate(messages)], offered)


def tool_call_text(call: dict[str, Any]) -> str:
    """A call as the byte tokenizer and a template-less tokenizer write it into the reply (the exported template's
    `<tool_call>{{ c.function | tojson }}</tool_call>`: transformers' tojson is json.dumps with ensure_ascii off)."""
    return "<tool_call>" + json.dumps(call["function"], ensure_ascii=False) + "</tool_call>"


def tools_text(tools: list[dict[str, Any]]) -> str:
    """The tools as the byte tokenizer and a template-less tokenizer write them before the chat."""
    return "tools: " + json.dumps(tools, ensure_ascii=False)


def _tools(value: object) -> list[dict[str, Any]]:
    if isinstance(value, str):  # a column of JSON text (glaive, xLAM and others store it so)
        try:
            value = json_loads(value)
        except ValueError as err:
            raise ValueError(f"{TOOLS_FIELD!r} is a string but not JSON ({err}): give a list of functions") from None
    if not isinstance(value, list) or not 0 < len(value) <= MAX_TOOLS:
        raise ValueError(f"{TOOLS_FIELD!r} must be a list of 1 to {MAX_TOOLS} functions, "
                         f"got {_shown(value)}")  # fmt: skip
    out = []
    for k, tool in enumerate(value):
        where = f"{TOOLS_FIELD}[{k}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{where} must be an object ({{type: function, function: {{name, ...}}}}), got "
                             f"{_shown(tool)}")  # fmt: skip
        function = tool.get("function", tool) if tool.get("type", "function") == "function" else None
        if not isinstance(function, dict):
            raise ValueError(f"{where}: only function tools are rendered ({{type: function, function: {{name, "
                             f"description, parameters}}}}), got {_shown(tool)}")  # fmt: skip
        _name(function.get("name"), where)
        out.append({"type": "function", "function": function})
    return out


def _message(m: object, i: int) -> dict[str, Any]:
    where = f"message {i}"
    if not isinstance(m, dict):
        raise ValueError(f"{where} must be an object {{role, content}}, got {_shown(m)}")
    role, content = m.get("role"), m.get("content")
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise ValueError(f"{where}: only an assistant message makes tool calls, this one is {role!r}")
        if not isinstance(calls, list) or not 0 < len(calls) <= MAX_CALLS:
            raise ValueError(f"{where}: tool_calls must be a list of 1 to {MAX_CALLS} calls, got {_shown(calls)}")
        out = {**m, "content": "" if content is None else content,
               "tool_calls": [_call(c, f"{where} tool_calls[{k}]") for k, c in enumerate(calls)]}  # fmt: skip
    else:
        out = dict(m)
    if role == "tool":
        if not isinstance(content, str):
            raise ValueError(f"{where}: a tool message's content is the tool's result as a string, got "
                             f"{_shown(content)}")  # fmt: skip
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise ValueError(f"{where}: {key} must be a string, got {_shown(m[key])}")
    return out


def _call(call: object, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise ValueError(f"{where} must be an object {{type: function, function: {{name, arguments}}}}, got "
                         f"{_shown(call)}")  # fmt: skip
    function = call.get("function", call)
    if not isinstance(function, dict):
        raise ValueError(f"{where}: function must be an object {{name, arguments}}, got {_shown(function)}")
    name, args = _name(function.get("name"), where), function.get("arguments")
    if isinstance(args, str):  # JSON text, as many data sets store it: the templates expect the object
        try:
            args = json_loads(args) if args.strip() else {}
        except ValueError as err:
            raise ValueError(f"{where}: arguments is a string but not JSON ({err}); give the arguments as an "
                             "object") from None  # fmt: skip
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ValueError(f"{where}: arguments must be an object of the call's arguments, got {_shown(args)}")
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _name(value: object, where: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME or not value.isprintable():
        raise ValueError(f"{where}: a function needs a name, a printable string of 1 to {MAX_NAME} characters, got "
                         f"{_shown(value)}")  # fmt: skip
    return value


def _shown(value: object) -> str:
    return f"{type(value).__name__} {value!r:.60}"
