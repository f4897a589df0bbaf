"""Preference pairs: a record of TRL's preference conventions as the two chats DPO, IPO, SimPO and ORPO score.

Two layouts, as TRL's DPOTrainer reads them, so a user's data set works unchanged:

- text: `{"prompt": str, "chosen": str, "rejected": str}`: the prompt a user turn, each answer the assistant's;
  without "prompt", TRL's implicit prompt: the text both answers start with (`implicit_prompt`);
- conversational: `{"chosen": [messages], "rejected": [messages]}` with an optional `"prompt": [messages]`
  put before each; without it, TRL's implicit prompt of dialogues: the turns both lists start with
  (`implicit_turns`); a text prompt is a user turn put before each, unless both lists already open with it
  (UltraFeedback-binarized's layout, whose shared turns are then the implicit prompt, as TRL takes them).

Each pair becomes two chats rendered with the tokenizer's chat template (runner/data/tokenizer.py). The targets are
the completion's assistant turns only, as TRL scores them: an assistant turn of the prompt (a multi-turn
conversation's earlier replies) is marked `PROMPT_TURN` and its tokens are not targets (runner/data/prepare.py
`unscore_prompt_turns`), so the summed log-prob of a chat is that of its completion alone. In the
tokenized store a pair is two consecutive records, chosen then rejected (runner/data/preference.py keeps them
together). The prompt field is `data.prompt_field` ("prompt"); `chosen` and `rejected` are TRL's names.
"""

from __future__ import annotations

from jobspec.errors import ConfigError
from jobspec.spec.models import DataSpec
from runner.data.records import PROMPT_TURN, as_message_list
from runner.data.tokenizer import Message

CHOSEN, REJECTED = "chosen", "rejected"


def check_objective(fmt: str, pairs: bool, where: object) -> None:
    """ConfigError when the record format and the objective disagree: pairs need a preference objective (dpo, ipo,
    simpo, orpo), which needs pairs."""
    if pairs and fmt != "preference":
        raise ConfigError(
            f"{where}: a preference objective (training.objective dpo, ipo, simpo or orpo) needs preference pairs "
            f"({{prompt, chosen, rejected}} texts, or chosen/rejected message lists), got a {fmt} record; point "
            "data.path at preference data or set training.objective: sft"
        )
    if not pairs and fmt == "preference":
        raise ConfigError(
            f"{where}: a preference pair ({CHOSEN!r}/{REJECTED!r}) trains with a preference objective; set "
            "training.objective: dpo, ipo, simpo or orpo, or give prompt/response or messages records for sft"
        )


def _kind(value: object) -> str:
    return "missing" if value is None else type(value).__name__


def implicit_prompt(chosen: str, rejected: str) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) of a text pair whose prompt is implicit, split as TRL's `extract_prompt` splits it
    (Anthropic HH's layout, `"\n\nHuman: ...\n\nAssistant: ..."` in both): the longest common prefix is the
    prompt, less a space it ends with, which stays with the answers; where one answer is the start of the other, the
    prompt stops a character short of it (TRL's loop ends there)."""
    shorter = min(len(chosen), len(rejected))
    n = next((i for i in range(shorter) if chosen[i] != rejected[i]), shorter)
    if n == shorter:
        n = max(shorter - 1, 0)
    elif n and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


def implicit_turns(chosen: list, rejected: list) -> tuple[list, list, list]:
    """(prompt, chosen, rejected) of two dialogues whose prompt is implicit, split as TRL's `extract_prompt` splits
    them: the turns both start with are the prompt; where one list is the start of the other, the prompt stops a turn
    short of it (TRL's loop ends there)."""
    shorter = min(len(chosen), len(rejected))
    n = next((i for i in range(shorter) if chosen[i] != rejected[i]), max(shorter - 1, 0))
    return chosen[:n], chosen[n:], rejected[n:]


def _prompt_turn(message: object) -> object:
    if isinstance(message, dict) and message.get("role") == "assistant":
        return {**message, PROMPT_TURN: True}
    return message


def pair_chats(record: dict, spec: DataSpec) -> tuple[list[Message], list[Message]]:
    """(chosen chat, rejected chat) of a preference record; ValueError naming the field that is wrong."""
    prompt_field = spec.prompt_field
    chosen, rejected = as_message_list(record.get(CHOSEN)), as_message_list(record.get(REJECTED))
    prompt = as_message_list(record.get(prompt_field))
    if isinstance(chosen, str) and isinstance(rejected, str):
        if prompt is None:  # TRL's implicit prompt: the text both answers start with
            prompt, chosen, rejected = implicit_prompt(chosen, rejected)
        if not isinstance(prompt, str):
            raise ValueError(
                f"{prompt_field!r} is {_kind(prompt)}: text pairs take a text {prompt_field!r} beside "
                f"{CHOSEN!r} and {REJECTED!r} (or none: the text both start with is the prompt)"
            )
        head: list[Message] = [{"role": "user", "content": prompt}] if prompt else []
        return [*head, {"role": "assistant", "content": chosen}], [*head, {"role": "assistant", "content": rejected}]
    if isinstance(chosen, list) and isinstance(rejected, list):
        if isinstance(prompt, str):  # UltraFeedback's layout: the prompt's text beside dialogues that may hold it
            firsts = chosen[:1] + rejected[:1]
            opens = [m.get("content") for m in firsts if isinstance(m, dict) and m.get("role") == "user"]
            prompt = [] if opens == [prompt, prompt] else [{"role": "user", "content": prompt}]
        if prompt is not None and not isinstance(prompt, list):
            raise ValueError(
                f"{prompt_field!r} is {_kind(prompt)}: with {CHOSEN!r} and {REJECTED!r} message lists it must be a "
                "message list or a text (or left out)"
            )
        if not prompt:  # TRL's implicit prompt of dialogues: the turns both start with
            prompt, chosen, rejected = implicit_turns(chosen, rejected)
        for name, messages in ((CHOSEN, chosen), (REJECTED, rejected)):
            if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages):
                raise ValueError(f"{name!r} holds no assistant message after the prompt: nothing to score")
        head = [_prompt_turn(m) for m in prompt]
        return head + chosen, head + rejected
    raise ValueError(
        f"{CHOSEN!r} is {_kind(chosen)} and {REJECTED!r} is {_kind(rejected)}: both must be strings (with a text "
        f"{prompt_field!r}) or both lists of {{role, content}} messages"
    )
