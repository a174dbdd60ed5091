"""Chat templates: untrusted jinja2 rendered in a strict sandbox, with transformers' globals.

A model directory's template is code from whoever published the model, so it runs in an
immutable sandbox that refuses (rather than silently blanks) any reach for Python internals,
and within a budget: jinja's sandbox caps one range() at 100,000 items but not loops inside
loops, so every loop iteration and call is counted, the output measured as it is produced, and
repetition (`*`) and powers (`**`) sized before they are computed. A render that passes a bound
raises inside the template, on its own thread, so nothing keeps burning CPU after it.
"""

from __future__ import annotations

import contextvars
import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """There is no chat template, the template failed, or it broke the sandbox's rules."""


# One render's bounds. A real template loops over the messages and tools a few times; these are
# orders of magnitude above what one needs, and stop a hostile one within a second of CPU.
MAX_TEMPLATE_STEPS = 1_000_000  # loop iterations and calls, all loops together
MAX_RENDERED_CHARS = 10_000_000  # ten times the characters of a 256k-token context
MAX_RENDER_CPU_SECONDS = 1.0
# The largest integer a power may make, in bits: an exponent of a million is a CPU sink.
MAX_POWER_BITS = 65_536


def render_chat_template(
    source: str,
    messages: Any,
    *,
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str],
    tools: Any = None,
    documents: Any = None,
    continue_final_message: bool = False,
    **template_kwargs: Any,
) -> str:
    """Render an untrusted chat template in the strict sandbox, as transformers would.

    continue_final_message leaves the last message open (transformers' option of that name):
    the text ends where its content does, so generation continues it, an assistant prefill.
    """
    template = _compile_template(source)
    messages = _template_messages(messages)
    if continue_final_message:
        if add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message continues the last message and add_generation_prompt "
                "opens a new one; ask for one of them"
            )
        content = messages[-1].get("content")
        if not isinstance(content, str):
            raise ChatTemplateError(
                "continue_final_message needs a last message with text content to continue"
            )
        messages[-1]["content"] = content + _CONTINUE_TAG
    variables = {
        "messages": messages,
        "tools": _plain_data(tools),
        "documents": _plain_data(documents),
        "add_generation_prompt": add_generation_prompt,
        **special_tokens,
        **_plain_data(template_kwargs),
    }
    try:
        rendered = _render_within_budget(template, variables)
    except _OverBudget as exc:
        raise ChatTemplateError(
            f"the chat template was stopped: {exc}. A template may loop and call at most "
            f"{MAX_TEMPLATE_STEPS:,} times, render at most {MAX_RENDERED_CHARS:,} characters "
            f"and run {MAX_RENDER_CPU_SECONDS:g} s of CPU; use a trusted template"
        ) from None
    except SecurityError as exc:
        raise ChatTemplateError(
            f"the chat template was stopped by the sandbox: {exc}. A template may not reach "
            "Python internals or change its inputs; use a trusted template"
        ) from exc
    except _TemplateRaised as exc:
        raise ChatTemplateError(f"the chat template refused the messages: {exc}") from exc
    except Exception as exc:  # a template is untrusted code: any failure is the template's
        raise ChatTemplateError(
            f"the chat template failed while rendering: {type(exc).__name__}: {exc}"
        ) from exc
    return _cut_at_continuation(rendered) if continue_final_message else rendered


# Marks where the continued message's content ends, as transformers marks it: the rendered text
# is cut there, dropping whatever the template closes the message with.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _cut_at_continuation(rendered: str) -> str:
    at = rendered.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise ChatTemplateError(
            "continue_final_message: the chat template drops or rewrites the last message's "
            "content, so it cannot be continued"
        )
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the content's trailing space


class _OverBudget(TemplateError):
    """A render passed one of its bounds."""


class _RenderBudget:
    """What one render has spent: steps (loop iterations and calls) and CPU time."""

    def __init__(self) -> None:
        self.steps = 0
        self.deadline = time.thread_time() + MAX_RENDER_CPU_SECONDS

    def spend(self) -> None:
        self.steps += 1
        if self.steps > MAX_TEMPLATE_STEPS:
            raise _OverBudget(f"it looped or called more than {MAX_TEMPLATE_STEPS:,} times")
        if self.steps % 64 == 0 and time.thread_time() > self.deadline:
            raise _OverBudget(f"it ran for more than {MAX_RENDER_CPU_SECONDS:g} s of CPU")


# The budget of the render running on this thread (None outside render_chat_template).
_budget: contextvars.ContextVar[_RenderBudget | None] = contextvars.ContextVar(
    "chat_template_budget", default=None
)


def _render_within_budget(template: jinja2.Template, variables: dict) -> str:
    """template rendered with variables, stopped once it passes a bound."""
    token = _budget.set(_RenderBudget())
    try:
        pieces, size = [], 0
        for piece in template.generate(**variables):
            size += len(piece)
            if size > MAX_RENDERED_CHARS:
                raise _OverBudget(f"it rendered more than {MAX_RENDERED_CHARS:,} characters")
            pieces.append(piece)
        return "".join(pieces)
    finally:
        _budget.reset(token)


def _spend() -> None:
    budget = _budget.get()
    if budget is not None:
        budget.spend()


def _counted_iterations(iterable: Iterable) -> Iterator:
    """The filter every {% for %} loop's iterable is passed through: one step per item."""
    for item in iterable:
        _spend()
        yield item


def _check_operation(operator: str, left: Any, right: Any) -> None:
    """Refuse a repetition longer than a render may be, or a power larger than MAX_POWER_BITS,
    before it is computed."""
    if operator == "*":
        for sequence, times in ((left, right), (right, left)):
            repeated = isinstance(sequence, str | list | tuple) and isinstance(times, int)
            if repeated and len(sequence) * times > MAX_RENDERED_CHARS:
                raise _OverBudget(
                    f"it repeats a sequence of {len(sequence):,} {times:,} times, more than "
                    f"{MAX_RENDERED_CHARS:,} items"
                )
    power = operator == "**" and isinstance(left, int) and isinstance(right, int)
    if power and left.bit_length() * max(right, 0) > MAX_POWER_BITS:  # about its bits
        raise _OverBudget(f"{left} ** {right} is larger than {MAX_POWER_BITS:,} bits")


# The name of the filter that counts loop iterations: a template cannot define filters, so it
# cannot replace it.
_LOOP_FILTER = "astrai_counted_iterations"


class _TemplateRaised(TemplateError):
    """raise_exception() called by a template: a message for the user, not a template bug."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' tojson: jinja's own escapes HTML characters and takes fewer options.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """The `dict` global, without handing a template the dict type itself."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace() that, like transformers', refuses underscore-prefixed names."""

    def __init__(*args, **kwargs) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"a namespace may not hold the underscore-prefixed name {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """Parses `{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) and
    renders its body unchanged, so templates that use it load."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, except that touching an unsafe attribute raises at once, and
    calls, repetitions and powers are charged to the render's budget.

    The plain sandbox hands back an undefined value that renders as "", so a probe such as
    `{{ ''.__class__ }}` would pass in silence; here every reach for internals is an error.
    """

    intercepted_binops = frozenset({"*", "**"})

    def call(__self, __context, __obj, *args, **kwargs) -> Any:  # jinja's names, kept
        _spend()
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        _check_operation(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe"
        )


def _template_environment() -> jinja2.Environment:
    env = _StrictSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    env.filters[_LOOP_FILTER] = _counted_iterations
    return env


_TEMPLATE_ENV = _template_environment()


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """source compiled with every loop's iterable passed through the counting filter."""
    try:
        tree = _TEMPLATE_ENV.parse(source)
        for loop in tree.find_all(jinja2.nodes.For):
            loop.iter = jinja2.nodes.Filter(loop.iter, _LOOP_FILTER, [], [], None, None)
        return _TEMPLATE_ENV.from_string(tree)
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"the chat template does not parse: {exc.message} (line {exc.lineno}); fix the template"
        ) from exc


def _template_messages(messages: Any) -> list[dict]:
    """Messages as plain dicts. Keys set to None are dropped, as transformers does, because
    templates test for a key's presence (`content` is None in OpenAI tool-call messages)."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role', 'content'} dicts")
    plain = []
    for index, message in enumerate(_plain_data(list(messages))):
        if not isinstance(message, dict):
            raise ChatTemplateError(
                f"message {index} is a {type(message).__name__}; each message must be a dict "
                "with 'role' and 'content'"
            )
        plain.append({key: value for key, value in message.items() if value is not None})
    return plain


def _plain_data(value: Any) -> Any:
    """value rebuilt from JSON types only, so a template cannot reach the methods of rich objects
    (the sandbox vets attribute names, not what arbitrary objects would do when called)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # Subclasses (enums and the like) can carry methods of their own: strip them to the base type.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain_data(key): _plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain_data(item) for item in value)
    if callable(getattr(value, "model_dump", None)):  # pydantic models, as the server holds them
        return _plain_data(value.model_dump())
    raise ChatTemplateError(
        f"a chat template input holds a {type(value).__name__}; pass only JSON data "
        "(str, number, bool, None, list, dict)"
    )
