"""Chat templates: untrusted jinja2 rendered in a strict sandbox, with transformers' globals.

A model directory's template is code from whoever published the model, so it runs in an
immutable sandbox that refuses (rather than silently blanks) any reach for Python internals.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
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
        rendered = template.render(**variables)
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
    """transformers' sandbox, except that touching an unsafe attribute raises at once.

    The plain sandbox hands back an undefined value that renders as "", so a probe such as
    `{{ ''.__class__ }}` would pass in silence; here every reach for internals is an error.
    """

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
    return env


_TEMPLATE_ENV = _template_environment()


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    try:
        return _TEMPLATE_ENV.from_string(source)
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
