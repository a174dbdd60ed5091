"""Tool calls in model output: one parser per model family's format, for whole texts and streams.

Every format writes calls as JSON objects {"name": ..., "arguments": {...}} wrapped in its own
markers: Hermes and Qwen2.5 in <tool_call> tags, Llama 3.x bare (or after <|python_tag|>) with
"parameters", Mistral as an array after [TOOL_CALLS]. A parser only knows where its calls begin
and how to force one with a grammar; one JSON scanner reads the calls of the whole text and of a
stream alike, so a streamed call concatenates to the call parsed from the whole text.

From the first marker on, the text is the calls: each complete call object with a name and an
object of arguments is a call, and the rest (markup, a call cut off by max_tokens) is dropped.
Text whose calls section holds no call at all is content, as if there were no marker.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from astrai.inference.constraints import Constraint, closed_schema

# JSON laid out as json.dumps does, like astrai's other JSON constraints: whitespace the grammar
# leaves free is where a random-weight (or a confused) model wanders off.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the JSON object as the model wrote it


@dataclass(frozen=True)
class ToolChoice:
    """What the request lets the model do with its tools, in OpenAI's terms: "none", "auto",
    "required", or "named" (the function `name`)."""

    mode: Literal["none", "auto", "required", "named"] = "auto"
    name: str | None = None


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools in OpenAI's terms, whichever API it came through: the function
    definitions, the tool choice, and whether more than one call may be made. Each API's
    request body reads its own fields into one (protocol.py); GenerationService.tool_use
    decides what they ask for."""

    functions: list[dict[str, Any]] = field(default_factory=list)
    choice: ToolChoice = ToolChoice()
    parallel: bool = True


@dataclass(frozen=True)
class ToolUse:
    """What a request's tools ask for: the definitions the chat template shows the model, the
    parser that reads calls out of its answer (None: the answer is plain text), the constraint
    the tools put on decoding (a forced call's grammar, or under auto the grammar that holds
    a call the model starts to the schemas of strict tools), whether the answer is forced to
    be calls only, and whether more than one call may be kept."""

    definitions: list[dict] | None = None
    parser: ToolCallParser | None = None
    constraint: Constraint | None = None
    forced: bool = False
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
    forced_marker: bool = True  # a forced answer opens with the first marker
    argument_keys: tuple[str, ...] = ("arguments",)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The text before the calls and the complete calls; the whole text and no calls when
        the text holds no complete call."""
        found = self.find_start(text)
        if found is None:
            return text, []
        content_end, calls_start = found
        scanner = ToolCallScanner(self.argument_keys)
        scanner.feed(text[calls_start:])
        if not scanner.calls:
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
    def calls_rule(self, parallel: bool) -> str:
        """The Lark rule `calls`: what follows the format's marker, one call (`call_json`) or
        several with parallel, up to where the format closes them."""

    def grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) whose every sentence is one call, or several
        with parallel, to one of tools (OpenAI function definitions) with schema-valid arguments.

        The output may end after any complete call (the model's end of turn)."""
        marker = json.dumps(self.markers[0]) if self.forced_marker else ""
        return f"start: {marker} calls\n{self.calls_rule(parallel)}\n{self._call_rules(tools)}"

    def triggered_grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        """A grammar that leaves the text free until the model writes the format's marker, and
        from there holds its calls to tools: those with strict true to their schema, the others
        to any object of arguments (tool_choice auto with strict tools).

        The free text is one lazy lexeme that ends at the first marker (llguidance's triggered
        tool calls); a marker that is a special token is then written as text."""
        tools = [tool if tool.get("strict") else {**tool, "parameters": None} for tool in tools]
        repeat = "*" if parallel else "?"
        return (
            f"start: (opening calls){repeat} TEXT\n"
            "TEXT: /(.|\\n)*/\n"
            f"opening[lazy]: TEXT {json.dumps(self.markers[0])}\n"
            f"{self.calls_rule(parallel)}\n{self._call_rules(tools)}"
        )

    def _call_rules(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """Lark rules `call_json` (a call object of any of tools) and one %json rule per tool."""
        rules = [f"call_json: {' | '.join(f'tool_{i}' for i in range(len(tools)))}"]
        for i, tool in enumerate(tools):
            key = self.argument_keys[0]
            arguments = tool.get("parameters") or {"type": "object"}
            schema = {
                "type": "object",
                "properties": {"name": {"const": tool["name"]}, key: closed_schema(arguments)},
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

    def calls_rule(self, parallel: bool) -> str:
        repeat = ' ("\\n<tool_call>" call)*' if parallel else ""
        return f'calls: call{repeat}\ncall: "\\n" call_json "\\n</tool_call>"'

    def show_tools(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping]) -> list:
        """messages with tools and the calls and results of earlier turns written into their
        text as Qwen2.5's template writes them, for a chat template that shows none of them:
        the tools in the system message, calls in <tool_call> tags, results in a user turn of
        <tool_response> tags."""
        listed = "".join(f"\n{json.dumps(tool, ensure_ascii=False)}" for tool in tools)
        shown = _HERMES_TOOLS.format(tools=listed)
        messages = [dict(message) for message in messages]
        if messages and messages[0].get("role") == "system":
            messages[0]["content"] = f"{messages[0].get('content') or ''}\n\n{shown}"
        else:
            messages.insert(0, {"role": "system", "content": shown})
        written: list[dict] = []
        after_tool = False  # the last message written holds tool results
        for message in messages:
            if message.get("role") == "tool":
                response = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
                if after_tool:
                    written[-1]["content"] += "\n" + response
                else:
                    written.append({"role": "user", "content": response})
                after_tool = True
                continue
            after_tool = False
            message.pop("tool_call_id", None)
            calls = message.pop("tool_calls", None) or ()
            parts = [message["content"]] if message.get("content") else []
            parts += [_hermes_call(call) for call in calls]
            if calls:
                message["content"] = "\n".join(parts)
            written.append(message)
        return written


def _hermes_call(call: Mapping[str, Any]) -> str:
    """An earlier call of an OpenAI assistant message in Hermes' tags."""
    function = call["function"]
    arguments = function["arguments"]
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    body = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


# Qwen2.5's words for the tools in its system message.
_HERMES_TOOLS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


class Llama3JsonParser(ToolCallParser):
    """Llama 3.x: {"name": ..., "parameters": {...}} opening the output or after <|python_tag|>,
    several separated by "; "."""

    name = "llama3_json"
    markers = ("<|python_tag|>",)
    leading_json = True
    forced_marker = False
    argument_keys = ("parameters", "arguments")

    def calls_rule(self, parallel: bool) -> str:
        repeat = ' ("; " call_json)*' if parallel else ""
        return f"calls: call_json{repeat}"


class MistralParser(ToolCallParser):
    """Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def calls_rule(self, parallel: bool) -> str:
        repeat = ' (", " call_json)*' if parallel else ""
        return f'calls: "[" call_json{repeat} "]"'


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
    open a call, and the calls section until it yields its first call (a section that yields
    none is content at the end, as parse has it).

    Only the held-back text is searched again as pieces arrive: a marker cannot begin in text
    already sent, so a long answer costs linear time.
    """

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser
        self._pending = ""  # text not sent yet: before the calls, or the calls without a call
        self._at_start = True  # no content sent yet
        self._scanner: ToolCallScanner | None = None

    @property
    def called(self) -> bool:
        return self._scanner is not None and bool(self._scanner.calls)

    def feed(self, piece: str) -> tuple[str, list[ToolCallDelta]]:
        """The content and call deltas that piece adds."""
        if self._scanner is not None:
            if not self._scanner.calls:  # held until the section yields a call
                self._pending += piece
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
        content, self._pending = self._pending[:content_end], self._pending[content_end:]
        return content, self._scanner.feed(self._pending[calls_start - content_end :])

    def finish(self) -> str:
        """The content held back at the end: text that might have opened a call, or a calls
        section that yielded none."""
        if self.called:
            return ""
        content, self._pending = self._pending, ""
        return content


class ToolCallScanner:
    """Reads call objects {"name": ..., <argument key>: ...} out of JSON text one character at
    a time, skipping whatever lies between objects (tags, commas, brackets).

    A call goes out (its name, then its arguments as the model wrote them) once its object is
    complete and is a call: one cut off by max_tokens, or that is no call, never goes out.
    """

    def __init__(self, argument_keys: Sequence[str]) -> None:
        self._argument_keys = tuple(argument_keys)
        self.calls: list[ToolCall] = []
        self._depth = 0
        self._raw = ""  # the object being read

    def feed(self, text: str) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        for ch in text:
            call = self._step(ch)
            if call is not None:
                deltas.append(ToolCallDelta(len(self.calls), name=call.name))
                deltas.append(ToolCallDelta(len(self.calls), arguments=call.arguments))
                self.calls.append(call)
        return deltas

    def _open(self) -> None:
        self._depth, self._raw = 1, "{"
        self._in_string = self._escape = False
        self._state = "key"  # key, in_key, colon, value, in_value, after
        self._key = ""
        self._key_start = self._value_start = 0
        self._name: str | None = None
        self._arguments: tuple[int, int] | None = None  # start and end in _raw

    def _step(self, ch: str) -> ToolCall | None:
        """Take ch; the call it completes, if any."""
        if self._depth == 0:
            if ch == "{":
                self._open()
            return None
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
        self._track_top_level(ch)
        return self._close() if self._depth == 0 else None

    def _track_top_level(self, ch: str) -> None:
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
        if self._state == "in_value":
            end = self._value_end(ch, at)
            if end is not None:
                self._end_value(end)
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

    def _end_value(self, end: int) -> None:
        value = self._raw[self._value_start : end]
        if self._key == "name":
            self._name = _json_or_none(value)
        elif self._key in self._argument_keys:
            self._arguments = (self._value_start, end)

    def _close(self) -> ToolCall | None:
        """The object is complete: the call it is, or None."""
        arguments = "{}" if self._arguments is None else self._raw[slice(*self._arguments)]
        valid = (
            isinstance(_json_or_none(self._raw), dict)
            and isinstance(self._name, str)
            and isinstance(_json_or_none(arguments), dict)
        )
        self._raw = ""
        return ToolCall(self._name, arguments) if valid else None


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
