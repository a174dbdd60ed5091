"""The request fields astrai does not honour, per request model: refused, or accepted as no-ops.

This table is the one place that decides them. A field missing from it is implemented; a field
the engine learns to honour leaves it (and turns "implemented" in docs/api.md), and a test holds
the table, the models and docs/api.md to each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from astrai.server.errors import APIError
from astrai.server.protocol import (
    AnthropicMessage,
    AnthropicTool,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    CountTokensRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    MessagesRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaOptions,
    OllamaShowRequest,
    ResponsesFunctionCall,
    ResponsesFunctionCallOutput,
    ResponsesFunctionTool,
    ResponsesMessage,
    ResponsesNamedTool,
    ResponsesReasoning,
    ResponsesRequest,
    ResponsesText,
    StreamOptions,
    TokenizeRequest,
)


@dataclass(frozen=True)
class Refused:
    """A field astrai cannot honour: any value but null and those in `noop` is a 400.

    `noop` holds the values that ask for nothing (the defaults, an empty tool list), which
    clients send without meaning anything by them.
    """

    why: str
    noop: tuple[Any, ...] = ()

    def refuses(self, value: Any) -> bool:
        return value is not None and value not in self.noop


@dataclass(frozen=True)
class NoOp:
    """A field accepted with any value because it asks nothing of a server on this machine."""

    why: str


Rule = Refused | NoOp

ENGINE = "is not supported by astrai yet (the engine has no such setting); leave it out"
STRUCTURED = (
    "is not supported by astrai's Anthropic API yet (the OpenAI API's response_format is); "
    "describe the format in the prompt instead, or leave it out"
)
TOOLS = "is not supported by astrai's Anthropic API yet (the OpenAI API's tools are); leave it out"
FUNCTIONS = "is OpenAI's deprecated form of tools and is not supported; send tools instead"
TEMPLATE = "is not supported: astrai applies the model's own chat template as it is"
HOSTED = "is a feature of the hosted API that a local server does not have; leave it out"
BEAM = (
    "is not supported: astrai has no beam search (its beams would fork and drop sequences' KV "
    "pages every step, which the scheduler and the page tables do not do); leave it out"
)
PROMPT = "is not supported by astrai yet: it cannot echo the chat's last message; leave it out"
LOAD = (
    "is a setting of how the model is loaded, which astrai serve fixes when it starts (its "
    "flags, --help); leave it out"
)

_OPENAI = {
    "user": NoOp("an end-user id for the hosted API's abuse monitoring"),
    "guided_decoding_backend": Refused(
        "is not supported: astrai has one grammar backend, llguidance; leave it out"
    ),
    "guided_whitespace_pattern": Refused(
        "is not supported: JSON output is laid out as Python's json.dumps does; leave it out"
    ),
    "bad_words": Refused(ENGINE, noop=([],)),
    "use_beam_search": Refused(BEAM, noop=(False,)),
    "length_penalty": Refused(BEAM, noop=(1, 1.0)),
    "skip_special_tokens": Refused(
        "is not supported: special tokens are always left out of the text", noop=(True,)
    ),
    "spaces_between_special_tokens": Refused(ENGINE, noop=(True,)),
    "return_tokens_as_token_ids": Refused(ENGINE, noop=(False,)),
    "priority": Refused("is not supported: requests are served first come first served", (0,)),
    "logits_processors": Refused(ENGINE, noop=([],)),
}

RULES: dict[type[BaseModel], Mapping[str, Rule]] = {
    ChatCompletionRequest: {
        **_OPENAI,
        "functions": Refused(FUNCTIONS, noop=([],)),
        "function_call": Refused(FUNCTIONS, noop=("none", "auto")),
        "audio": Refused("is not supported: astrai generates text only"),
        "modalities": Refused("is not supported: astrai generates text only", noop=(["text"],)),
        "prediction": Refused(ENGINE),
        "reasoning_effort": Refused("is not supported: astrai passes no effort to the model"),
        "verbosity": Refused("is not supported: astrai passes no verbosity to the model"),
        "web_search_options": Refused(HOSTED),
        "moderation": Refused(HOSTED),
        "metadata": NoOp("tags for the hosted API's stored completions; astrai stores nothing"),
        "store": Refused(HOSTED, noop=(False,)),
        "service_tier": Refused(HOSTED, noop=("auto", "default")),
        "safety_identifier": NoOp("an end-user id for the hosted API's abuse monitoring"),
        "prompt_cache_key": NoOp("a routing hint; astrai's prefix cache serves every request"),
        "prompt_cache_retention": Refused(HOSTED, noop=("in_memory",)),
        "prompt_cache_options": Refused(HOSTED),
        "echo": Refused(PROMPT, noop=(False,)),
        "chat_template": Refused(TEMPLATE),
        "documents": Refused(TEMPLATE, noop=([],)),
    },
    CompletionRequest: {
        **_OPENAI,
        "suffix": Refused("is not supported: astrai has no fill-in-the-middle", noop=("",)),
    },
    ChatMessage: {
        "name": Refused("is not supported: chat templates take no participant names"),
        "function_call": Refused(FUNCTIONS),
        "refusal": Refused("is not supported: a refusal is no text the chat template knows"),
        "audio": Refused("is not supported: astrai takes text only"),
        "annotations": Refused("is not supported: astrai takes text only", noop=([],)),
    },
    StreamOptions: {
        "include_obfuscation": Refused("is not supported: astrai does not pad its chunks", (False,))
    },
    AnthropicMessage: {},
    AnthropicTool: {
        "cache_control": NoOp("astrai's prefix cache caches every prompt without being asked")
    },
    MessagesRequest: {
        "output_config": Refused(STRUCTURED),
        "cache_control": NoOp("astrai's prefix cache caches every prompt without being asked"),
        "speed": Refused("is not supported: astrai has one speed", noop=("standard",)),
        "user_profile_id": NoOp("attribution in the hosted API; astrai keeps no accounts"),
        "workspace_id": NoOp("a workspace of the hosted API; astrai has none"),
        "metadata": NoOp("an end-user id for the hosted API's abuse monitoring"),
        "service_tier": Refused(HOSTED, noop=("auto", "standard_only")),
        "container": Refused(HOSTED),
        "context_management": Refused(HOSTED),
        "mcp_servers": Refused(HOSTED, noop=([],)),
        "inference_geo": Refused(HOSTED),
        "diagnostics": Refused(HOSTED),
    },
    TokenizeRequest: {
        "continue_final_message": Refused(
            "is not supported by /tokenize yet (chat completions take it); leave it out",
            noop=(False,),
        ),
        "chat_template": Refused(TEMPLATE),
        "chat_template_kwargs": Refused(TEMPLATE, noop=({},)),
        "mm_processor_kwargs": Refused("is not supported: astrai takes text only", noop=({},)),
        "media_io_kwargs": Refused("is not supported: astrai takes text only", noop=({},)),
    },
    DetokenizeRequest: {},
    ResponsesRequest: {
        "reasoning": Refused(
            "is not supported: astrai passes no reasoning effort or summary to the model "
            "(a reasoning model's thinking comes back as reasoning items without it)",
            noop=({}, {"summary": "auto"}, {"summary": "none"}),
        ),
        "top_logprobs": Refused(ENGINE, noop=(0,)),
        "truncation": Refused(
            "is not supported: a prompt too long for the context is a 400, never cut",
            noop=("disabled",),
        ),
        "max_tool_calls": NoOp("a limit on the hosted API's built-in tools, which astrai has not"),
        "client_metadata": NoOp("a client's notes on itself for the hosted API's telemetry"),
        "stream_options": Refused(
            "is not supported: astrai does not pad its events",
            noop=({}, {"include_obfuscation": False}),
        ),
        "user": NoOp("an end-user id for the hosted API's abuse monitoring"),
        "safety_identifier": NoOp("an end-user id for the hosted API's abuse monitoring"),
        "prompt_cache_key": NoOp("a routing hint; astrai's prefix cache serves every request"),
        "prompt_cache_retention": Refused(HOSTED, noop=("in_memory",)),
        "prompt_cache_options": Refused(HOSTED),
        "service_tier": Refused(HOSTED, noop=("auto", "default")),
        "background": Refused(HOSTED, noop=(False,)),
        "background_options": Refused(HOSTED),
        "conversation": Refused(HOSTED),
        "context_management": Refused(HOSTED),
        "prompt": Refused(HOSTED),
        "moderation": Refused(HOSTED),
        "image": Refused("is not supported: astrai takes text only"),
        "access_programs": Refused(HOSTED),
    },
    ResponsesMessage: {
        "id": NoOp("the id the server gave an output item sent back"),
        "status": NoOp("the status the server gave an output item sent back"),
        "phase": NoOp("a label of an assistant message that chat templates have no place for"),
    },
    ResponsesFunctionCall: {
        "id": NoOp("the id the server gave an output item sent back"),
        "status": NoOp("the status the server gave an output item sent back"),
    },
    ResponsesFunctionCallOutput: {
        "id": NoOp("the id the server gave an output item sent back"),
        "status": NoOp("the status the server gave an output item sent back"),
    },
    ResponsesReasoning: {
        "id": NoOp("the id the server gave an output item sent back"),
        "status": NoOp("the status the server gave an output item sent back"),
    },
    ResponsesFunctionTool: {
        "defer_loading": Refused(
            "is not supported: every tool is shown to the model", noop=(False,)
        ),
        "output_schema": Refused("is not supported: chat templates show no output schemas"),
        "allowed_callers": Refused("is not supported: astrai has no hosted callers"),
    },
    ResponsesNamedTool: {},
    EmbeddingRequest: {"user": NoOp("an end-user id for the hosted API's abuse monitoring")},
    OllamaEmbedRequest: {},
    OllamaEmbeddingsRequest: {},
    ResponsesText: {
        "verbosity": Refused(
            "is not supported: astrai passes no verbosity to the model", ("medium",)
        ),
    },
}
RULES.update(
    {
        OllamaOptions: {
            "num_keep": Refused(
                "is not supported: a prompt too long for the context is a 400, never shifted, "
                "so no tokens need keeping; leave it out"
            ),
            "typical_p": Refused(ENGINE, noop=(1, 1.0)),
            "repeat_last_n": Refused(
                "is not supported: repeat_penalty looks at the whole context (Ollama's -1); "
                "leave it out",
                noop=(-1,),
            ),
            "tfs_z": Refused(ENGINE, noop=(1, 1.0)),
            "mirostat": Refused(ENGINE, noop=(0,)),
            "mirostat_tau": Refused(ENGINE, noop=(5, 5.0)),
            "mirostat_eta": Refused(ENGINE, noop=(0.1,)),
            "penalize_newline": Refused(ENGINE, noop=(False,)),
            **{
                name: Refused(LOAD)
                for name in (
                    "numa",
                    "num_batch",
                    "num_gpu",
                    "main_gpu",
                    "low_vram",
                    "f16_kv",
                    "logits_all",
                    "vocab_only",
                    "use_mmap",
                    "use_mlock",
                    "embedding_only",
                    "num_thread",
                )
            },
        },
        OllamaGenerateRequest: {
            "suffix": Refused("is not supported: astrai has no fill-in-the-middle", noop=("",)),
            "template": Refused(TEMPLATE, noop=("",)),
            "context": Refused(
                "is not supported: it is Ollama's deprecated conversation memory; send the "
                "conversation to /api/chat instead",
                noop=([],),
            ),
            **{
                name: Refused("is not supported: astrai generates text, not images")
                for name in ("width", "height", "steps")
            },
        },
        OllamaShowRequest: {
            "verbose": Refused(
                "is not supported: astrai's model_info holds no tokenizer tables to add",
                noop=(False,),
            )
        },
    }
)
RULES[CountTokensRequest] = {
    name: rule
    for name, rule in RULES[MessagesRequest].items()
    if name in CountTokensRequest.model_fields
}


def refuse_unsupported(body: BaseModel, path: str = "") -> None:
    """Raise a 400 naming the first field of body (or of a model inside it) astrai refuses."""
    rules = RULES.get(type(body), {})
    for name in type(body).model_fields:
        if name not in body.model_fields_set:
            continue
        value = getattr(body, name)
        where = f"{path}{name}"
        rule = rules.get(name)
        if isinstance(rule, Refused) and rule.refuses(value):
            raise APIError(400, f"{where} {rule.why}", param=where)
        if isinstance(value, BaseModel):
            refuse_unsupported(value, f"{where}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    refuse_unsupported(item, f"{where}.{i}.")
