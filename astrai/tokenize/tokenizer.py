"""Hugging Face tokenizers for astrai: ids and text, special and stop tokens, chat templates, and
incremental detokenization for streaming.

Everything runs on the `tokenizers` library (tokenizer.json); transformers is never imported. Where
transformers has a behaviour users rely on (chat template rendering, which tokens are special), this
module reproduces it, and the tests hold the two to the same output.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import tokenizers
from tokenizers.decoders import DecodeStream

from astrai.tokenize.chat_template import ChatTemplateError, render_chat_template


class TokenizerError(ValueError):
    """The tokenizer files are missing, unreadable or inconsistent, or a token id is unknown."""


# The named special tokens transformers hands a chat template as strings (its special_tokens_map).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def load_hf_tokenizer(
    path: str | os.PathLike, chat_template: str | os.PathLike | None = None
) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory: tokenizer.json, tokenizer_config.json,
    generation_config.json and chat templates.

    chat_template, a Jinja file or the template's text, replaces the model's default one.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise TokenizerError(f"{directory} is not a directory; pass a model directory")
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise TokenizerError(
            f"{directory} has no tokenizer.json; astrai reads Hugging Face fast-tokenizer "
            "files. Convert a slow tokenizer once with transformers: "
            "AutoTokenizer.from_pretrained(path).save_pretrained(path)"
        )
    try:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # the library raises a bare Exception on malformed files
        raise TokenizerError(f"{tokenizer_file} could not be loaded: {exc}") from exc
    config = _read_json(directory / "tokenizer_config.json")
    generation = _read_json(directory / "generation_config.json")
    if not generation:
        # Without generation_config.json, transformers reads these settings from config.json.
        generation = _read_json(directory / "config.json")
    special_tokens = {
        name: _token_content(config[name], name)
        for name in SPECIAL_TOKEN_NAMES
        if config.get(name) is not None
    }
    eos_token_ids = _token_ids(config.get("eos_token_id"), "tokenizer_config.json")
    eos_token_ids += _token_ids(generation.get("eos_token_id"), "generation_config.json")
    chat_templates = _chat_templates(directory, config)
    if chat_template is not None:
        chat_templates["default"] = chat_template_text(chat_template)
    return Tokenizer(
        backend,
        special_tokens=special_tokens,
        chat_templates=chat_templates,
        eos_token_ids=eos_token_ids,
    )


class Tokenizer:
    """A model's tokenizer: encode and decode, special and stop token ids, chat templates."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: Mapping[str, str],
        chat_templates: Mapping[str, str],
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._backend = backend
        self._special_tokens = dict(special_tokens)
        self._chat_templates = dict(chat_templates)
        self._added_token_ids = frozenset(backend.get_added_tokens_decoder())
        self._token_to_bytes = _token_bytes_function(backend)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._special_token_id("bos_token")
        self.eos_token_id = self._special_token_id("eos_token")
        stop = set(eos_token_ids)
        if self.eos_token_id is not None:
            stop.add(self.eos_token_id)
        self.stop_token_ids: frozenset[int] = frozenset(stop)
        self.chat_template: str | None = self._chat_templates.get("default")

    @property
    def chat_templates(self) -> Mapping[str, str]:
        """Every chat template by name ("default", "tool_use", ...)."""
        return MappingProxyType(self._chat_templates)

    def _special_token_id(self, name: str) -> int | None:
        token = self._special_tokens.get(name)
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise TokenizerError(
                f"tokenizer_config.json names {name} {token!r}, which tokenizer.json does not "
                "contain; fix the config or add the token to tokenizer.json"
            )
        return token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; add_special_tokens applies tokenizer.json's post-processor (bos).

        encode_batch, not encode: it releases the GIL, so a server thread encoding a huge prompt
        does not stall the event loop and the engine."""
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes this token adds to a text: byte-level tokens may hold part of a
        character, which no string can show, so logprob displays need the bytes."""
        token = self._backend.id_to_token(token_id) if token_id >= 0 else None
        if token is None:
            raise TokenizerError(
                f"token id {token_id} is not in the vocabulary (ids 0..{self.vocab_size - 1})"
            )
        if token_id in self._added_token_ids:
            return token.encode("utf-8")
        return self._token_to_bytes(token, token_id)

    def id_to_token(self, token_id: int) -> str:
        """The token's text on its own, for logprob displays; a partial character shows as U+FFFD.

        It is token_bytes decoded, so it keeps the leading space that a sentencepiece decoder
        strips from the first token of a text.
        """
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._backend, skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **template_kwargs: Any,
    ) -> list[int] | str:
        """Render messages with the model's chat template as transformers does, in a sandbox.

        template_kwargs reach the template as variables (tools, documents, enable_thinking, ...).
        The rendered text already holds the template's special tokens, so tokenizing it adds none.
        """
        tools = template_kwargs.pop("tools", None)
        rendered = render_chat_template(
            self._select_template(tools),
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self._special_tokens,
            tools=tools,
            **template_kwargs,
        )
        if tokenize:
            return self.encode(rendered, add_special_tokens=False)
        return rendered

    def _select_template(self, tools: Any) -> str:
        # As transformers chooses: "tool_use" when tools are given, else "default".
        if tools is not None and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        if "default" in self._chat_templates:
            return self._chat_templates["default"]
        if self._chat_templates:
            raise ChatTemplateError(
                f"the tokenizer has chat templates {sorted(self._chat_templates)} but none named "
                "'default'; name one 'default' in tokenizer_config.json"
            )
        raise ChatTemplateError(
            "this tokenizer has no chat template (tokenizer_config.json has no 'chat_template' "
            "and there is no chat_template.jinja); add one to the model directory, or format "
            "the prompt yourself and call encode()"
        )


class IncrementalDetokenizer:
    """Turns generated token ids, one at a time, into text pieces for streaming.

    Pieces never split a UTF-8 character and concatenate to decode(all ids). The work is the
    tokenizers library's DecodeStream: it decodes only a short window of recent ids, and emits
    once the window's text grows and does not end in an incomplete character (U+FFFD).
    """

    def __init__(self, backend: tokenizers.Tokenizer, skip_special_tokens: bool = True) -> None:
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Feed the next id; returns the new text ("" while a character is incomplete)."""
        return self._stream.step(self._backend, token_id) or ""


def _read_json(path: Path) -> dict:
    """A JSON object from path, or {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path} is not valid JSON ({exc}); fix or remove the file") from exc
    if not isinstance(value, dict):
        raise TokenizerError(f"{path} must hold a JSON object, found {type(value).__name__}")
    return value


def _token_content(value: Any, name: str) -> str:
    # tokenizer_config.json spells a token as a string or as a serialized AddedToken.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(
        f"tokenizer_config.json {name} must be a string or an object with 'content', got {value!r}"
    )


def _token_ids(value: Any, source: str) -> list[int]:
    if value is None:
        return []
    values = list(value) if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TokenizerError(
            f"{source} eos_token_id must be an integer or a list of integers, got {value!r}"
        )
    return values


def chat_template_text(template: str | os.PathLike) -> str:
    """The text of a chat template given as a file or as the template itself."""
    if isinstance(template, str) and ("{{" in template or "{%" in template):
        return template
    if Path(template).is_file():
        return Path(template).read_text(encoding="utf-8")
    raise TokenizerError(
        f"chat template {str(template)!r} is neither a file nor Jinja template text; pass the "
        "path of a .jinja file or the template itself"
    )


def _chat_templates(directory: Path, config: dict) -> dict[str, str]:
    """Templates by name. As in transformers, template files beside the config win over it."""
    templates = {}
    default_file = directory / "chat_template.jinja"
    if default_file.is_file():
        templates["default"] = default_file.read_text(encoding="utf-8")
    extra_dir = directory / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if templates:
        return templates
    value = config.get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(
        isinstance(item, dict) and isinstance(item.get("name"), str) and "template" in item
        for item in value
    ):
        return {item["name"]: item["template"] for item in value}
    raise TokenizerError(
        "tokenizer_config.json chat_template must be a string or a list of "
        '{"name": ..., "template": ...} objects'
    )


def _gpt2_byte_decoder() -> dict[str, int]:
    """Byte-level BPE spells each byte as a printable character (GPT-2's table); this inverts it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + shifted)
            shifted += 1
    return {char: byte for byte, char in chars.items()}


BYTE_DECODER = _gpt2_byte_decoder()


def _token_bytes_function(backend: tokenizers.Tokenizer):
    """How a vocabulary token maps to the bytes it contributes, read from the decoder's config.

    Decoding a token alone cannot answer this: it replaces partial characters with U+FFFD and a
    sentencepiece decoder strips the leading space of a text's first token.
    """
    # The decoder's config alone: the whole tokenizer's JSON (its vocabulary and merges) takes
    # 0.15 s to write and read back for a 49k-token vocabulary.
    decoder = {} if backend.decoder is None else json.loads(backend.decoder.__getstate__())
    steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    types = {step.get("type") for step in steps}
    if "ByteLevel" in types:

        def byte_level(token: str, token_id: int) -> bytes:
            if all(char in BYTE_DECODER for char in token):
                return bytes(BYTE_DECODER[char] for char in token)
            return token.encode("utf-8")

        return byte_level
    replacements = [
        (step["pattern"]["String"], step["content"])
        for step in steps
        if step.get("type") == "Replace" and "String" in step.get("pattern", {})
    ]
    replacements += [(s["replacement"], " ") for s in steps if s.get("type") == "Metaspace"]
    byte_fallback = "ByteFallback" in types
    if replacements or byte_fallback:

        def sentencepiece(token: str, token_id: int) -> bytes:
            if byte_fallback and len(token) == 6 and token.startswith("<0x") and token[5] == ">":
                return bytes([int(token[3:5], 16)])
            for pattern, content in replacements:
                token = token.replace(pattern, content)
            return token.encode("utf-8")

        return sentencepiece

    def decoded(token: str, token_id: int) -> bytes:
        return backend.decode([token_id], skip_special_tokens=False).encode("utf-8")

    return decoded
