"""Read one YAML document within bounds: size, nodes, depth, text and number length.

A few hundred bytes of YAML can stand for billions of values through aliases ("billion
laughs"), nest deep enough to crash a recursive parser (libyaml's composer overflows the C
stack), spell an integer of thousands of digits, or hold one string of a million characters
that every later regular expression, secret scan and error message would have to read. None of it
reaches the models: the text is parsed once (libyaml's event parser when present) and composed here
without recursion, counting every node an alias stands for and measuring every scalar before
anything reads it (PyYAML's own type resolution runs regular expressions on it). The node graph
keeps the line marks. Numbers are YAML 1.2's: `4090:2` or `1:30` is text, not YAML 1.1's base-60 integer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import yaml
from yaml.composer import ComposerError

MAX_BYTES = 1024 * 1024  # a spec is a page of settings; the ConfigMap that carries it holds 1 MiB
MAX_NODES = 50_000  # scalars and collections, an alias counting as every node it stands for
MAX_DEPTH = 64  # nested collections (a real spec nests 4 deep)
MAX_NUMBER_CHARS = 100  # a YAML int or float longer than this is not a setting
MAX_INT = 2**63 - 1  # the API server stores 64-bit integers
# The longest text any setting takes (an env value, an annotation; every field has its own, lower or equal,
# limit in jobspec.spec.models), and the longest key: a Kubernetes label key, 253-character prefix + '/' + 63.
MAX_STRING_CHARS = 16 * 1024
MAX_KEY_CHARS = 253 + 1 + 63



@dataclass(frozen=True)
class Bounds:
    """What one kind of document may hold: a spec (SPEC, the constants above), or a kubeconfig (KUBECONFIG: larger
    certificates and merged contexts, the same protection against aliases and depth)."""

    bytes: int = MAX_BYTES
    nodes: int = MAX_NODES
    depth: int = MAX_DEPTH
    string_chars: int = MAX_STRING_CHARS
    key_chars: int = MAX_KEY_CHARS
    what: str = "a spec"


SPEC = Bounds()
# A kubeconfig embeds base64 certificates and keys (a few KiB each; a chain more) and may merge many clusters; no real
# one nests past a few levels or needs an alias to repeat thousands of values.
KUBECONFIG = Bounds(bytes=8 * 1024 * 1024, nodes=200_000, depth=32, string_chars=1024 * 1024, key_chars=1024,
                    what="a kubeconfig")  # fmt: skip

Loader: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml parses ~10x faster

_INT, _FLOAT, _STR = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:str"


@dataclass
class YamlLimit(Exception):
    """A bound was crossed; `line` is 1-based, `path` the dotted place in the document."""

    message: str
    line: int | None
    path: str
    hint: str


def check_size(size: int, bounds: Bounds = SPEC) -> None:
    if size > bounds.bytes:
        raise YamlLimit(
            f"more than {bounds.bytes // 1024**2} MiB of YAML ({size:,} bytes): {bounds.what} is a page of settings",
            None,
            "",
            "keep data and long config in files the job reads (data.path), not in the spec",
        )


def load(text: str) -> tuple[Any, yaml.Node | None]:
    """(data, root node) of one YAML document. Raises yaml.YAMLError or YamlLimit."""
    root = compose(text)
    return construct(root), root


def compose(text: str, bounds: Bounds = SPEC) -> yaml.Node | None:
    """The node graph of one YAML document (None for an empty one), within the bounds."""
    check_size(len(text) if len(text) > bounds.bytes else len(text.encode("utf-8", "surrogatepass")), bounds)
    loader = Loader(text)
    try:
        return _compose(loader, bounds)
    finally:
        loader.dispose()


def construct(root: yaml.Node | None) -> Any:
    """Python data of a composed document (safe types only)."""
    if root is None:
        return None
    loader = Loader("")
    try:
        return loader.construct_document(root)
    except (ValueError, OverflowError) as err:  # e.g. a timestamp like 2024-02-30
        raise yaml.YAMLError(f"a value cannot be read: {err}") from None
    finally:
        loader.dispose()


class _Frame:
    __slots__ = ("anchor", "count", "height", "key", "node")

    def __init__(self, node: yaml.CollectionNode, anchor: str | None) -> None:
        self.node, self.key, self.count, self.height, self.anchor = node, None, 0, 0, anchor

    def step(self) -> str:
        if isinstance(self.node, yaml.SequenceNode):
            return str(len(self.node.value))
        return str(self.key.value) if isinstance(self.key, yaml.ScalarNode) else "?"

    def is_key_next(self) -> bool:
        """The next node in this collection is a mapping key."""
        return isinstance(self.node, yaml.MappingNode) and self.key is None


def _check_length(text: str, *, key: bool, where: tuple[int | None, str], bounds: Bounds = SPEC) -> None:
    """Refuse a scalar longer than any setting, before a regular expression reads it. Never quotes it."""
    limit = bounds.key_chars if key else bounds.string_chars
    if len(text) > limit:
        what = "a key" if key else "a text"
        raise YamlLimit(
            f"{what} of {len(text):,} characters: longer than any {'key' if key else 'setting'} "
            f"takes (at most {limit:,})",
            *where,
            "keep long content in a file the job reads (data.path, a Secret), not in the spec",
        )


def _compose(loader: Any, bounds: Bounds = SPEC) -> yaml.Node | None:
    """PyYAML's Composer.get_single_node, iterative and counted."""
    anchors: dict[str, tuple[yaml.Node, int, int]] = {}  # name -> (node, nodes it stands for, height)
    stack: list[_Frame] = []
    total = 0
    root: yaml.Node | None = None

    def where(mark: Any, key: bool = False) -> tuple[int | None, str]:
        """(line, path) at `mark`; for a `key`, the path of its mapping (the key is not written yet)."""
        steps = [f.step() for f in (stack[:-1] if key else stack)]
        path = ".".join(steps if len(steps) <= 6 else [*steps[:6], "..."])
        return (mark.line + 1 if mark else None), path

    def next_event(peek: bool = False) -> yaml.Event:
        # libyaml refuses 1000 levels of flow nesting itself, and its scanner reads up to 1024 characters
        # ahead of the events (a simple key's lookahead): `[[[...` on one line crosses 1000 levels before
        # the stack below reaches MAX_DEPTH. The same problem, said the same way (and never a "YAML error"
        # that --set would take for text).
        try:
            return loader.peek_event() if peek else loader.get_event()
        except yaml.MarkedYAMLError as err:
            if "maximum nesting depth" in str(err.problem):
                raise _too_deep(*where(err.problem_mark), bounds) from None
            raise

    next_event()  # StreamStart
    if isinstance(next_event(peek=True), yaml.StreamEndEvent):
        next_event()
        return None
    next_event()  # DocumentStart

    def add(node: yaml.Node, size: int, height: int, mark: Any, new: int) -> None:
        """Attach `node` (standing for `size` nodes, `height` levels) to its parent; `new` nodes are counted."""
        nonlocal total, root
        total += new
        if total > bounds.nodes:
            raise YamlLimit(
                f"more than {bounds.nodes:,} values once aliases are expanded (an alias counts every value it repeats)",
                *where(mark),
                "a real spec has a few hundred values; write the list out or use fewer aliases",
            )
        if len(stack) + height > bounds.depth:  # an alias brings the depth of what it repeats
            raise _too_deep(*where(mark), bounds)
        if not stack:
            root = node
            return
        top = stack[-1]
        if isinstance(top.node, yaml.SequenceNode):
            top.node.value.append(node)
        elif top.key is None:
            top.key = node
        else:
            top.node.value.append((top.key, node))
            top.key = None
        top.count += size
        top.height = max(top.height, height)

    while True:
        event = next_event()
        anchor = getattr(event, "anchor", None)
        if anchor is not None and anchor in anchors and not isinstance(event, yaml.AliasEvent):
            first = anchors[anchor][0].start_mark.line + 1
            raise ComposerError(None, None, f"duplicate anchor &{anchor} (first on line {first})", event.start_mark)
        if isinstance(event, yaml.AliasEvent):
            if anchor not in anchors:
                inside = any(f.anchor == anchor for f in stack)
                problem = f"alias *{anchor} is used inside its own anchor" if inside else f"undefined alias *{anchor}"
                raise ComposerError(None, None, problem, event.start_mark)
            node, size, height = anchors[anchor]
            add(node, size, height, event.start_mark, new=size)  # an alias repeats every node under it
        elif isinstance(event, yaml.ScalarEvent):
            key = bool(stack) and stack[-1].is_key_next()
            _check_length(event.value, key=key, where=where(event.start_mark, key), bounds=bounds)
            tag = event.tag
            if tag is None or tag == "!":
                tag = loader.resolve(yaml.ScalarNode, event.value, event.implicit)
                if tag in (_INT, _FLOAT) and ":" in event.value:  # YAML 1.1's base 60: `gpus: 4090:2` was 245402
                    tag = _STR
            if tag in (_INT, _FLOAT) and len(event.value) > MAX_NUMBER_CHARS:
                kind = "an integer" if tag == _INT else "a number"
                raise YamlLimit(
                    f"{kind} of {len(event.value):,} characters: too large for any setting",
                    *where(event.start_mark),
                    f"numbers in a spec are at most {MAX_NUMBER_CHARS} characters; quote it if it is text",
                )
            node = yaml.ScalarNode(tag, event.value, event.start_mark, event.end_mark, style=event.style)
            if anchor is not None:
                anchors[anchor] = (node, 1, 0)
            add(node, 1, 0, event.start_mark, new=1)
        elif isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            seq = isinstance(event, yaml.SequenceStartEvent)
            kind = yaml.SequenceNode if seq else yaml.MappingNode
            tag = event.tag
            if tag is None or tag == "!":
                tag = loader.resolve(kind, None, event.implicit)
            node = kind(tag, [], event.start_mark, None, flow_style=event.flow_style)
            stack.append(_Frame(node, anchor))
            if len(stack) > bounds.depth:  # checked on the way in: the closing events may never come
                raise _too_deep(*where(event.start_mark), bounds)
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            frame = stack.pop()
            frame.node.end_mark = event.end_mark
            size, height = frame.count + 1, frame.height + 1
            if frame.anchor is not None:  # registered when complete: an alias inside it is refused above
                anchors[frame.anchor] = (frame.node, size, height)
            add(frame.node, size, height, frame.node.start_mark, new=1)  # its children are counted
        elif isinstance(event, yaml.DocumentEndEvent):
            break
    if not isinstance(next_event(peek=True), yaml.StreamEndEvent):
        other = next_event()
        raise ComposerError(None, None, f"a second document (`---`): {bounds.what} is a single document",
                            other.start_mark)  # fmt: skip
    return root


def _too_deep(line: int | None, path: str, bounds: Bounds = SPEC) -> YamlLimit:
    return YamlLimit(f"nested more than {bounds.depth} levels deep", line, path,
                     f"{bounds.what} nests a few levels; flatten this")  # fmt: skip


def out_of_range(data: Any) -> list[tuple[tuple[str | int, ...], str]]:
    """(path, problem) for every integer beyond 64 bits and every float that is not finite."""
    found: list[tuple[tuple[str | int, ...], str]] = []
    todo: list[tuple[tuple[str | int, ...], Any]] = [((), data)]
    while todo:  # iterative: --set key paths may nest deeper than the recursion limit
        loc, value = todo.pop()
        if isinstance(value, dict):
            todo += [((*loc, k if isinstance(k, (str, int)) else str(k)), v) for k, v in value.items()]
        elif isinstance(value, list):
            todo += [((*loc, i), v) for i, v in enumerate(value)]
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int) and abs(value) > MAX_INT:
            found.append((loc, f"integer out of range: at most {MAX_INT} (64 bits)"))
        elif isinstance(value, float) and not math.isfinite(value):
            found.append((loc, "not a finite number"))
    return found
