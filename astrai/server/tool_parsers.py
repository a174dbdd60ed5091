"""Tool calls in model output: one parser per model family's format, for whole texts and streams.

Every format writes calls as JSON objects {"name": ..., "arguments": {...}} wrapped in its own
markers: Hermes and Qwen2.5 in <tool_call> tags, Llama 3.x bare (or after <|python_tag|>) with
"parameters", Mistral as an array after [TOOL_CALLS]. A parser only knows where its calls begin
and how to force one with a grammar; one JSON scanner reads the calls of the whole text and of a
stream alike, so a streamed call concatenates to the call parsed from the whole text.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from astrai.inference.constraints import Constraint

# JSON laid out as json.dumps does, like astrai's other JSON constraints: whitespace the grammar
# leaves free is where a random-weight (or a confused) model wanders off.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the JSON object as the model wrote it


@dataclass(frozen=True)
class ToolUse:
    """What a request's tools ask for: the definitions the chat template shows the model, the
    parser that reads calls out of its answer (None: the answer is plain text), the grammar
    that forces a call, and whether more than one call may be kept."""

    definitions: list[dict] | None = None
    parser: ToolCallParser | None = None
    forced_call: Constraint | None = None
    parallel: bool = True


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a streamed call: its name on its first delta, then argument fragments."""

    index: int
    name: str | None = None
    arguments: str = ""


class ToolCallParser(ABC):
    """A model family's tool-call format: where calls begin and the grammar that forces them."""

    name: str
    markers: tuple[str, ...]  # text that opens the calls wherever it appears
    leading_json: bool = False  # a "{" that opens the output opens the calls too
    argument_keys: tuple[str, ...] = ("arguments",)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The text before the calls and the calls; the whole text and no calls unless every call
        is complete, valid JSON."""
        found = self.find_start(text)
        if found is None:
            return text, []
        content_end, calls_start = found
        scanner = ToolCallScanner(self.argument_keys)
        scanner.feed(text[calls_start:])
        if not scanner.calls or not scanner.all_valid or scanner.inside_call:
            return text, []
        return text[:content_end], scanner.calls

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    def find_start(self, text: str, at_start: bool = True) -> tuple[int, int] | None:
        """Where the text before the calls ends and the calls' JSON begins, or None; at_start
        says that text opens the output."""
        starts = []
        for marker in self.markers:
            at = text.find(marker)
            if at >= 0:
                starts.append((at, at + len(marker)))
        stripped = text.lstrip() if self.leading_json and at_start else ""
        if stripped.startswith("{"):
            starts.append((0, len(text) - len(stripped)))
        return min(starts, default=None)

    def safe_content_end(self, text: str, at_start: bool = True) -> int:
        """How much of a text with no calls yet may be sent as content: all but a tail that could
        still grow into a marker (or, at the output's start, into a leading "{")."""
        if self.leading_json and at_start and not text.strip():
            return 0
        held = 0
        for marker in self.markers:
            for size in range(min(len(marker) - 1, len(text)), held, -1):
                if text.endswith(marker[:size]):
                    held = size
                    break
        return len(text) - held

    @abstractmethod
    def grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) whose every sentence is one call, or several
        with parallel, to one of tools (OpenAI function definitions) with schema-valid arguments."""

    def _call_rules(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """Lark rules `call_json` (a call object of any of tools) and one %json rule per tool."""
        rules = [f"call_json: {' | '.join(f'tool_{i}' for i in range(len(tools)))}"]
        for i, tool in enumerate(tools):
            key = self.argument_keys[0]
            schema = {
                "type": "object",
                "properties": {
                    "name": {"const": tool["name"]},
                    key: tool.get("parameters") or {"type": "object"},
                },
                "required": ["name", key],
                "additionalProperties": False,
                "x-guidance": _JSON_LAYOUT,
            }
            rules.append(f"tool_{i}: %json {json.dumps(schema)}")
        return "\n".join(rules)


class HermesParser(ToolCallParser):
    """Hermes and Qwen2.5: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>."""

    name = "hermes"
    markers = ("<tool_call>",)

    def grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        repeat = ' ("\\n" call)*' if parallel else ""
        head = f'start: call{repeat}\ncall: "<tool_call>\\n" call_json "\\n</tool_call>"\n'
        return head + self._call_rules(tools)


class Llama3JsonParser(ToolCallParser):
    """Llama 3.x: {"name": ..., "parameters": {...}} opening the output or after <|python_tag|>,
    several separated by "; "."""

    name = "llama3_json"
    markers = ("<|python_tag|>",)
    leading_json = True
    argument_keys = ("parameters", "arguments")

    def grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        repeat = ' ("; " call_json)*' if parallel else ""
        return f"start: call_json{repeat}\n" + self._call_rules(tools)


class MistralParser(ToolCallParser):
    """Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        repeat = ' (", " call_json)*' if parallel else ""
        return f'start: "[TOOL_CALLS][" call_json{repeat} "]"\n' + self._call_rules(tools)


PARSERS: dict[str, type[ToolCallParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser)
}

# Text in a chat template that shows which format its model calls tools in, checked in order.
_TEMPLATE_SIGNS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"))
_TEMPLATE_SIGNS += (("<|python_tag|>", "llama3_json"), ("ipython", "llama3_json"))


def tool_call_parser_for(name: str | None, chat_templates: Sequence[str]) -> ToolCallParser | None:
    """The parser named (one of PARSERS), or the one the chat templates' text points to, or
    None when they show no known format."""
    if name is not None:
        if name not in PARSERS:
            raise ValueError(
                f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(PARSERS))}"
            )
        return PARSERS[name]()
    for sign, found in _TEMPLATE_SIGNS:
        if any(sign in template for template in chat_templates):
            return PARSERS[found]()
    return None


class ToolCallStream:
    """Splits streamed text into content and tool-call deltas, holding back text that may yet
    open a call.

    Only the held-back text is searched again as pieces arrive: a marker cannot begin in text
    already sent, so a long answer costs linear time.
    """

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser
        self._pending = ""  # text not sent yet, before the calls began
        self._at_start = True  # no content sent yet
        self._scanner: ToolCallScanner | None = None

    @property
    def called(self) -> bool:
        return self._scanner is not None and self._scanner.announced > 0

    def feed(self, piece: str) -> tuple[str, list[ToolCallDelta]]:
        """The content and call deltas that piece adds."""
        if self._scanner is not None:
            return "", self._scanner.feed(piece)
        self._pending += piece
        found = self._parser.find_start(self._pending, self._at_start)
        if found is None:
            end = self._parser.safe_content_end(self._pending, self._at_start)
            content, self._pending = self._pending[:end], self._pending[end:]
            self._at_start = self._at_start and not content
            return content, []
        content_end, calls_start = found
        self._scanner = ToolCallScanner(self._parser.argument_keys)
        calls = self._scanner.feed(self._pending[calls_start:])
        return self._pending[:content_end], calls

    def finish(self) -> str:
        """The content held back at the end because it might have opened a call."""
        if self._scanner is not None:
            return ""
        content, self._pending = self._pending, ""
        return content


class ToolCallScanner:
    """Reads call objects {"name": ..., <argument key>: ...} out of JSON text one character at
    a time, skipping whatever lies between objects (tags, commas, brackets).

    A call's name goes out once its string is closed, its arguments as they arrive after that.
    """

    def __init__(self, argument_keys: Sequence[str]) -> None:
        self._argument_keys = tuple(argument_keys)
        self.calls: list[ToolCall] = []
        self.all_valid = True  # every object so far was a valid call
        self.announced = 0  # calls whose name went out
        self._depth = 0
        self._raw = ""  # the object being read
        self._arguments: tuple[int, int | None] | None = None  # start and end in _raw
        self._announced = False  # the object's name went out

    @property
    def inside_call(self) -> bool:
        return self._depth > 0

    def feed(self, text: str) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        for ch in text:
            self._step(ch, deltas)
        self._send_arguments(deltas)
        return deltas

    def _open(self) -> None:
        self._depth, self._raw = 1, "{"
        self._in_string = self._escape = False
        self._state = "key"  # key, in_key, colon, value, in_value, after
        self._key = ""
        self._key_start = self._value_start = 0
        self._name: str | None = None
        self._arguments = None
        self._sent_to = 0  # how far into _raw the arguments went out
        self._announced = False

    def _step(self, ch: str, deltas: list[ToolCallDelta]) -> None:
        if self._depth == 0:
            if ch == "{":
                self._open()
            return
        self._raw += ch
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
        self._track_top_level(ch, deltas)
        if self._depth == 0:
            self._close(deltas)

    def _track_top_level(self, ch: str, deltas: list[ToolCallDelta]) -> None:
        """Follow the object's own keys and values (not those of nested ones)."""
        at = len(self._raw) - 1
        if self._state == "key" and ch == '"':
            self._state, self._key_start = "in_key", at
        elif self._state == "in_key" and not self._in_string:
            self._key, self._state = _json_or_none(self._raw[self._key_start :]), "colon"
        elif self._state == "colon" and ch == ":":
            self._state = "value"
        elif self._state == "value" and not ch.isspace():
            self._state, self._value_start = "in_value", at
            if self._key in self._argument_keys and ch in "{[":
                self._arguments = (at, None)
        if self._state == "in_value":
            end = self._value_end(ch, at)
            if end is not None:
                self._end_value(end, deltas)
                self._state = "key" if ch == "," else "after"
        elif self._state == "after" and ch == ",":
            self._state = "key"

    def _value_end(self, ch: str, at: int) -> int | None:
        """Where the top-level value ends, if ch ends it."""
        first = self._raw[self._value_start]
        if first in "{[":
            return at + 1 if at > self._value_start and self._depth == 1 else None
        if first == '"':
            return at + 1 if at > self._value_start and not self._in_string else None
        if ch in ",}" or ch.isspace():  # a number, true, false or null ends before ch
            return at
        return None

    def _end_value(self, end: int, deltas: list[ToolCallDelta]) -> None:
        value = self._raw[self._value_start : end]
        if self._key == "name":
            self._name = _json_or_none(value)
            if isinstance(self._name, str) and not self._announced:
                self._announced = True
                deltas.append(ToolCallDelta(self.announced, name=self._name))
                self.announced += 1
        elif self._key in self._argument_keys:
            self._arguments = (self._value_start, end)

    def _send_arguments(self, deltas: list[ToolCallDelta]) -> None:
        if not self._announced or self._arguments is None:
            return
        start, end = self._arguments
        end = len(self._raw) if end is None else end
        start = max(start, self._sent_to)
        if end > start:
            deltas.append(ToolCallDelta(self.announced - 1, arguments=self._raw[start:end]))
            self._sent_to = end

    def _close(self, deltas: list[ToolCallDelta]) -> None:
        """The object is complete: send the rest of its arguments and keep it if it is a call."""
        self._send_arguments(deltas)
        if self._arguments is None:
            arguments = "{}"
            if self._announced:
                deltas.append(ToolCallDelta(self.announced - 1, arguments=arguments))
        else:
            arguments = self._raw[self._arguments[0] : self._arguments[1]]
        whole = _json_or_none(self._raw)
        valid = (
            isinstance(whole, dict)
            and isinstance(self._name, str)
            and isinstance(_json_or_none(arguments), dict)
        )
        if valid:
            self.calls.append(ToolCall(self._name, arguments))
        self.all_valid = self.all_valid and valid
        self._raw, self._arguments, self._announced = "", None, False


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
