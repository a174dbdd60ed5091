"""The `astrai` command line's flags: the parser of every command, with the settings flags
derived from the dataclasses' fields (add_flags, from_flags), and serve_settings, which reads
`astrai serve`'s flags for astrai.deploy's replicas. astrai.cli runs the commands."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import typing

# Only torch-free modules here: `astrai --help` answers without loading torch.
from astrai import __version__
from astrai.config import ConfigError, EngineConfig, LoadConfig
from astrai.inference.task import GenerationParams
from astrai.server.reasoning import PARSERS as REASONING_PARSERS
from astrai.server.tool_parsers import PARSERS

METAVARS = {int: "N", float: "X", str: "TEXT"}
# The sampling settings of a generation_config.json that generate and chat take as defaults.
GENERATION_CONFIG_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
Settings = typing.TypeVar("Settings")


def add_flags(
    parser: argparse.ArgumentParser,
    title: str,
    cls: type,
    parsers: dict[str, typing.Callable[[str], typing.Any]] | None = None,
    actions: dict[str, type[argparse.Action]] | None = None,
) -> None:
    """Add a group of flags, one per field of the dataclass cls, so a new field needs no CLI edit.

    The flag is --field-name unless metadata["flag"] spells it otherwise, with the other
    spellings of metadata["aliases"]; its help, choices, metavar and parser come from the
    field's metadata, its type from the annotation: a bool
    is --flag/--no-flag, an optional type keeps None when the flag is absent, and a tuple is
    a flag given once per item. parsers gives a field's parser where it lives above
    astrai.config, which cannot import it (LoadConfig.quantization's, in astrai.model); actions
    gives a field's argparse action where a command reads the flag otherwise (serve's --model,
    given once per model).
    """
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for spec in dataclasses.fields(cls):
        meta = spec.metadata
        flag = meta.get("flag", "--" + spec.name.replace("_", "-"))
        # An absent flag leaves no attribute (SUPPRESS), so given_flags can tell it from a
        # flag given with the default's value.
        options = {"dest": spec.name, "default": argparse.SUPPRESS, "help": _help(spec)}
        kind = _strip_none(hints[spec.name])
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            if typing.get_origin(kind) is tuple:
                kind = typing.get_args(kind)[0]
                options["action"] = "append"
            if spec.name in (actions or {}):
                options["action"] = actions[spec.name]
            parse = (parsers or {}).get(spec.name, meta.get("parse"))
            parse = kind if parse is None else _flag_parser(parse)
            options["choices"] = meta.get("choices")
            # With choices and no metavar, argparse lists the choices: {auto,fp32,...}.
            metavar = meta.get("metavar", None if options["choices"] else METAVARS.get(kind))
            options.update(type=parse, metavar=metavar)
        group.add_argument(flag, *meta.get("aliases", ()), **options)


def from_flags(cls: type[Settings], args: argparse.Namespace) -> Settings:
    """Build the dataclass cls back from the flags add_flags gave it; cls validates itself."""
    values = {spec.name: getattr(args, spec.name, spec.default) for spec in dataclasses.fields(cls)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def given_flags(cls: type, args: argparse.Namespace) -> set[str]:
    """The fields of cls whose flags the command line gave."""
    return {spec.name for spec in dataclasses.fields(cls) if hasattr(args, spec.name)}


def _help(spec: dataclasses.Field) -> str:
    text = spec.metadata.get("help", "").replace("%", "%%")
    if spec.default in (None, ()):
        return text
    return f"{text} (default: {spec.default})"


def _strip_none(hint):
    """int | None -> int: the flag takes an int, and leaving it out keeps the None default."""
    kinds = typing.get_args(hint)
    if type(None) not in kinds:
        return hint
    (kind,) = (kind for kind in kinds if kind is not type(None))
    return kind


def _flag_parser(parse):
    """Let a field's own parser's ValueError message reach the user as argparse's error."""

    def parse_flag(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse_flag


def _add_engine_flags(
    parser: argparse.ArgumentParser, actions: dict[str, type[argparse.Action]] | None = None
) -> None:
    add_flags(parser, "model", LoadConfig, parsers={"quantization": _quantization}, actions=actions)
    add_flags(parser, "engine", EngineConfig)


class _EachModel(argparse.Action):
    """serve's --model, given once per model to serve: args.models holds them all, args.model
    the last (what one --model sets)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        namespace.models = [*getattr(namespace, "models", []), values]
        setattr(namespace, self.dest, values)


def _quantization(text: str) -> str:
    """A --quantization name, refused (a ConfigError, so a ValueError) with the choices unless
    known; _flag_parser turns that into argparse's error."""
    from astrai.model.weights.quantize import quantization_type

    quantization_type(text)
    return text


def _positive(kind: type):
    """An argparse type: a number of the kind above zero."""

    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the kind in "invalid int value" errors
    return parse


def _add_serve_limits(serve: argparse.ArgumentParser) -> None:
    from astrai.server import defaults

    limits = serve.add_argument_group("production")
    limits.add_argument(
        "--allowed-hosts",
        action="extend",
        type=lambda text: [name for name in text.split(",") if name],
        default=[],
        metavar="NAMES",
        help="host names clients may send as Host besides --host, loopback names and IP "
        "addresses (comma-separated or repeated; '*' allows any); guards against DNS rebinding",
    )
    limits.add_argument(
        "--allowed-media-domains",
        action="extend",
        type=lambda text: [name for name in text.split(",") if name],
        default=[],
        metavar="NAMES",
        help="hosts whose http(s) image URLs requests may send, fetched by the server "
        "(comma-separated or repeated; exact names, no redirects elsewhere, public addresses "
        "only); without it remote image URLs are refused",
    )
    limits.add_argument(
        "--media-fetch-timeout",
        type=_positive(float),
        default=defaults.MEDIA_FETCH_TIMEOUT,
        metavar="SECONDS",
        help="most seconds fetching one image URL may take, redirects included (default: "
        f"{defaults.MEDIA_FETCH_TIMEOUT:g})",
    )
    limits.add_argument(
        "--max-request-bytes",
        type=_positive(int),
        default=defaults.MAX_REQUEST_BYTES,
        metavar="N",
        help="largest request body accepted, in bytes; larger ones get 413 (default: "
        f"{defaults.MAX_REQUEST_BYTES}, {defaults.MAX_REQUEST_BYTES / 2**20:g} MiB)",
    )
    limits.add_argument(
        "--read-timeout",
        type=_positive(float),
        default=defaults.READ_TIMEOUT,
        metavar="SECONDS",
        help="time a client has to send a request's headers, and again its body; slower "
        "connections are closed (default: %(default)s)",
    )
    limits.add_argument(
        "--shutdown-timeout",
        type=_positive(float),
        default=defaults.SHUTDOWN_TIMEOUT,
        metavar="SECONDS",
        help="on SIGTERM or SIGINT, time running requests get to finish before they are ended "
        "with an error; new requests get 503 meanwhile (default: %(default)s)",
    )
    limits.add_argument(
        "--no-webui",
        dest="webui",
        action="store_false",
        help="do not serve the chat page at / (a browser page that streams from "
        "/v1/chat/completions)",
    )
    limits.add_argument(
        "--lora-dir",
        metavar="DIR",
        help="allow POST /v1/load_lora_adapter to load LoRA adapters found below DIR (with "
        "--max-loras slots to hold them); off by default, since it reads files on the server",
    )
    limits.add_argument(
        "--docs",
        action="store_true",
        help="serve the API docs at /docs, /redoc and /openapi.json (behind --api-key if set)",
    )


def _add_router_flags(serve: argparse.ArgumentParser) -> None:
    router = serve.add_argument_group(
        "several models",
        "serve several models, each loaded when a request names it (llama.cpp's router mode): "
        "those in --models-dir and each --model given, when there are several. Engine flags "
        "apply to each model; --kv-cache-memory is shared evenly among --max-loaded-models",
    )
    router.add_argument(
        "--models-dir",
        metavar="DIR",
        help="serve every model found in DIR and below it: .gguf files (but mmproj ones) and "
        "model directories (with a config.json), each named by its path under DIR",
    )
    router.add_argument(
        "--max-loaded-models",
        type=_positive(int),
        metavar="N",
        help="most models loaded at once; loading one more first unloads the least recently "
        "used model that no request is using (default: all of them)",
    )
    router.add_argument(
        "--idle-unload",
        type=_positive(float),
        metavar="SECONDS",
        help="unload a model no request has used for this long (default: never)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="astrai",
        description="astrai: a small, fast LLM inference engine. Without --model every "
        "command uses the demo model shipped with astrai.",
    )
    parser.add_argument("--version", action="version", version=f"astrai {__version__}")
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="serve OpenAI- and Anthropic-compatible HTTP APIs",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models, /v1/messages, "
        "/health and /metrics.",
    )
    serve.add_argument(
        "model_path",
        nargs="?",
        metavar="MODEL",
        help="the model to serve, as --model takes it (as `vllm serve MODEL` takes it)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s)")
    serve.add_argument(
        "--api-key",
        default=os.environ.get("ASTRAI_API_KEY"),
        help="require this key (Authorization: Bearer KEY or x-api-key: KEY) on /v1 endpoints; "
        "default: $ASTRAI_API_KEY, else no key",
    )
    serve.add_argument(
        "--model-name",
        "--served-model-name",
        help="model name clients must send (default: the hub id, or the model directory's or "
        "file's name); --served-model-name is vLLM's spelling",
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        help="the format the model writes tool calls in under tool_choice auto (default: the "
        "one its chat template shows, or hermes, written into the prompt, when the template "
        "drops the tools); forced calls need none",
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        help="the format of the model's think blocks, answered apart from the text as "
        "reasoning_content, thinking blocks and reasoning items (default: think when the chat "
        "template mentions <think>, else none)",
    )
    serve.add_argument(
        "--override-generation-config",
        metavar="JSON",
        help="sampling settings for requests that leave them out, over the model's "
        "generation_config.json, e.g. '{\"temperature\": 0}' (vLLM's flag; keys: "
        f"{', '.join(GENERATION_CONFIG_SAMPLING)})",
    )
    _add_serve_limits(serve)
    _add_router_flags(serve)
    _add_engine_flags(serve, actions={"model": _EachModel})
    serve.set_defaults(command="serve", parser=serve, settings=(EngineConfig,))

    generate = commands.add_parser(
        "generate",
        help="generate a continuation of a prompt, streamed to stdout",
        description="Generate from one prompt and stream the text to stdout. Sampling flags "
        "not given take the model's generation_config.json values, as transformers does.",
    )
    generate.add_argument("prompt", help="the prompt text")
    generate.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message through the model's chat template",
    )
    generate.add_argument(
        "--image",
        action="append",
        metavar="FILE",
        help="an image (PNG, JPEG, WebP, GIF) the user message shows before the prompt, for a "
        "vision-language model; implies --chat; repeat it for several images",
    )
    chat = commands.add_parser(
        "chat",
        help="chat interactively; keeps the conversation's history",
        description="Chat with the model through its chat template; at a terminal with line "
        "editing and history. /help lists the commands (/reset, /system TEXT, /save FILE, "
        "/image FILE, /exit); Ctrl-C stops a reply, Ctrl-D leaves. Sampling flags not given "
        "take the model's generation_config.json values, as transformers does.",
    )
    for name, sub in (("generate", generate), ("chat", chat)):
        _add_engine_flags(sub)
        add_flags(sub, "sampling", GenerationParams)
        sub.set_defaults(command=name, parser=sub, settings=(EngineConfig, GenerationParams))

    bench = commands.add_parser(
        "bench",
        help="measure offline throughput on a seeded synthetic workload",
        description="Run random-token prompts through the engine at once and report "
        "throughput. Outputs ignore end-of-sequence, so every request makes --output-len tokens.",
    )
    bench.add_argument(
        "--num-requests", type=int, default=64, help="requests to run (default: %(default)s)"
    )
    bench.add_argument(
        "--input-len",
        type=int,
        default=128,
        help="prompt tokens per request (default: %(default)s)",
    )
    bench.add_argument(
        "--output-len",
        type=int,
        default=128,
        help="generated tokens per request (default: %(default)s)",
    )
    bench.add_argument(
        "--seed", type=int, default=0, help="seed of prompts and sampling (default: %(default)s)"
    )
    _add_engine_flags(bench)
    bench.set_defaults(command="bench", parser=bench, settings=(EngineConfig,))
    return parser


def take_positional_model(args: argparse.Namespace) -> None:
    """`astrai serve MODEL` is `astrai serve --model MODEL`; both at once must agree."""
    positional = getattr(args, "model_path", None)
    if positional is None:
        return
    given = getattr(args, "model", None)
    if given not in (None, positional):
        args.parser.error(
            f"the model is given twice: {positional} and --model {given}; give one of them"
        )
    args.model = positional
    if given is None:
        args.models = [positional]


def serve_settings(flags: list[str]) -> tuple[argparse.Namespace, EngineConfig]:
    """`astrai serve`'s flags read as the command reads them, for astrai.deploy's replicas.

    A bad flag raises ConfigError with argparse's message instead of exiting the process.
    """
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = build_parser().parse_args(["serve", *flags])
            take_positional_model(args)
    except SystemExit:
        message = errors.getvalue().strip().splitlines()
        raise ConfigError(message[-1] if message else f"bad serve flags: {flags}") from None
    return args, from_flags(EngineConfig, args)
