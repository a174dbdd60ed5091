"""The `astrai` command line: serve, generate, chat and bench."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import difflib
import errno
import io
import json
import logging
import os
import random
import socket
import sys
import time
import typing
from pathlib import Path

# Only torch-free modules here: `astrai --help` and a busy --port answer without loading torch;
# the engine, the model and the server are imported where a command needs them.
from astrai import __version__
from astrai.config import ConfigError, EngineConfig, LoadConfig
from astrai.inference.task import GenerationParams, InvalidParamsError, RequestError
from astrai.server.reasoning import PARSERS as REASONING_PARSERS
from astrai.server.tool_parsers import PARSERS

log = logging.getLogger("astrai")

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "demo"
METAVARS = {int: "N", float: "X", str: "TEXT"}
# The sampling settings of a generation_config.json that generate and chat take as defaults.
GENERATION_CONFIG_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
Settings = typing.TypeVar("Settings")


def main(argv: list[str] | None = None) -> int:
    """Run one `astrai` subcommand; returns the process exit status."""
    args, unknown = _parser().parse_known_args(argv)
    if unknown:
        args.parser.error(_unrecognized(args.parser, unknown))
    _take_positional_model(args)
    try:
        settings = [from_flags(cls, args) for cls in args.settings]
    except (ConfigError, InvalidParamsError) as exc:
        args.parser.error(str(exc))
    for params in settings:
        if not isinstance(params, GenerationParams):
            continue
        if params.logprobs is not None or params.prompt_logprobs is not None or params.n > 1:
            args.parser.error(
                "--logprobs, --prompt-logprobs and --n ask for what only the server's API "
                "returns; generate and chat print one text (use `astrai serve`)"
            )
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.command(args, *settings)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except Exception as exc:
        if not _caused_by_user(exc):
            raise
        print(f"astrai: error: {exc}", file=sys.stderr)
        return 1


def _unrecognized(parser: argparse.ArgumentParser, words: list[str]) -> str:
    """argparse's message for words no flag of the command takes, with the nearest flag of
    each (argparse says it only from Python 3.14 on, and with the top-level usage)."""
    flags = list(parser._option_string_actions)
    message = f"unrecognized arguments: {' '.join(words)}"
    for word in words:
        close = difflib.get_close_matches(word.split("=")[0], flags, n=1)
        if word.startswith("-") and close:
            message += f"; did you mean {close[0]} (for {word})?"
    return message


def _take_positional_model(args: argparse.Namespace) -> None:
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


def _caused_by_user(exc: Exception) -> bool:
    """Whether exc is an error the user can mend, reported in one line, not as a traceback."""
    if isinstance(exc, FileNotFoundError | ConfigError | RequestError):
        return True
    # Imported only now: astrai.model loads torch, which a busy --port need not wait for.
    from astrai.model import CheckpointError
    from astrai.tokenize import TokenizerError

    return isinstance(exc, CheckpointError | TokenizerError)


# -- flags ------------------------------------------------------------------------------------


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


def _parser() -> argparse.ArgumentParser:
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
    serve.set_defaults(command=_serve, parser=serve, settings=(EngineConfig,))

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
    for sub, run in ((generate, _generate), (chat, _chat)):
        _add_engine_flags(sub)
        add_flags(sub, "sampling", GenerationParams)
        sub.set_defaults(command=run, parser=sub, settings=(EngineConfig, GenerationParams))

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
    bench.set_defaults(command=_bench, parser=bench, settings=(EngineConfig,))
    return parser


# -- loading ----------------------------------------------------------------------------------


def _model_path(args: argparse.Namespace) -> Path:
    """The local directory or .gguf file that --model (with --revision, --gguf-file) names."""
    from astrai.model.weights.hub import resolve_model

    load = from_flags(LoadConfig, args)
    name = load.model
    if name is None:
        log.info("no --model given; using the demo model at %s", DEMO_MODEL_DIR)
        name = DEMO_MODEL_DIR
    path = resolve_model(name, revision=load.revision, gguf_file=load.gguf_file)
    if path != Path(name):
        log.info("model %s is %s", name, path)
    return path


def _model_name(args: argparse.Namespace, model_dir: Path) -> str:
    """The name a model goes by: a hub id as given (its snapshot directory is a commit hash),
    else the directory's or file's name."""
    model = from_flags(LoadConfig, args).model
    local = model is None or Path(model).exists()
    return model_dir.resolve().name if local else model


def _model_sampling(params: GenerationParams, given: set[str], model_dir: Path):
    """params with the sampling settings of the model's generation_config.json for the flags
    not given, as transformers' generate takes them (do_sample false there: greedy)."""
    path = model_dir / "generation_config.json"
    taken = {k: v for k, v in generation_config_sampling(model_dir).items() if k not in given}
    if not taken:
        return params
    try:
        params = dataclasses.replace(params, **taken)
    except InvalidParamsError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    settings = ", ".join(f"{name}={value}" for name, value in taken.items())
    log.info("sampling settings from %s: %s (a flag overrides each)", path, settings)
    return params


def generation_config_sampling(model_dir: Path) -> dict:
    """The sampling settings model_dir's generation_config.json gives (do_sample false:
    temperature 0, greedy, as transformers reads it); none without the file."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        generation = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    taken = {
        name: generation[name]
        for name in GENERATION_CONFIG_SAMPLING
        if generation.get(name) is not None
    }
    if generation.get("do_sample") is False:
        taken["temperature"] = 0.0
    return taken


def _sampling_override(args: argparse.Namespace) -> dict:
    """--override-generation-config's settings, checked before any model loads."""
    if args.override_generation_config is None:
        return {}
    try:
        override = json.loads(args.override_generation_config)
    except ValueError as exc:
        raise ConfigError(f"--override-generation-config is not JSON: {exc}") from None
    if not isinstance(override, dict) or not set(override) <= set(GENERATION_CONFIG_SAMPLING):
        raise ConfigError(
            "--override-generation-config takes a JSON object of "
            f"{', '.join(GENERATION_CONFIG_SAMPLING)}; got {args.override_generation_config}"
        )
    try:
        GenerationParams(**override)
    except InvalidParamsError as exc:
        raise ConfigError(f"--override-generation-config: {exc}") from None
    return override


def _server_sampling(model_dir: Path, override: dict) -> dict:
    """The sampling settings a request that leaves them out gets: the model's
    generation_config.json's, under override (--override-generation-config's)."""
    sampling = generation_config_sampling(model_dir) | override
    try:
        GenerationParams(**sampling)
    except InvalidParamsError as exc:
        raise ConfigError(f"request sampling defaults {sampling}: {exc}") from None
    if sampling:
        settings = ", ".join(f"{name}={value}" for name, value in sampling.items())
        log.info("requests without their own sampling settings take %s", settings)
    return sampling


def _adapter_params(params: GenerationParams, config: EngineConfig) -> GenerationParams:
    """params generating under the one --lora adapter given, unless --use-lora names one."""
    if params.lora is None and len(config.loras) == 1:
        return dataclasses.replace(params, lora=config.adapters[0][0])
    return params


def _load_engine(args: argparse.Namespace, config: EngineConfig, model_dir: Path):
    from astrai.inference import InferenceEngine

    return InferenceEngine(*_load_model(args, config, model_dir), config)


def _load_model(args: argparse.Namespace, config: EngineConfig, model_dir: Path):
    """(model, tokenizer) as the flags ask for them."""
    import torch

    from astrai.model import AutoModel
    from astrai.tokenize import AutoTokenizer

    load = from_flags(LoadConfig, args)
    device = _device(load)
    dtype = load.dtype
    if dtype == "auto":
        dtype = "bfloat16" if torch.device(device).type == "cuda" else "float32"
    if config.tensor_parallel_size > 1 and load.mmproj:
        raise ConfigError(
            "--mmproj with --tensor-parallel-size: images run on one process only; leave one out"
        )
    # A GGUF file's readers are shared while one is held: holding one across both loads parses
    # its metadata (a vocabulary of tens of thousands of tokens, 0.5 s) once, not twice.
    held_reader = _gguf_reader(model_dir)
    if config.tensor_parallel_size > 1:
        model = _load_sharded(load, config, model_dir, dtype, device)
    else:
        model = AutoModel.from_pretrained(
            model_dir,
            dtype=dtype,
            device=device,
            dequantize=load.dequantize,
            quantization=load.quantization,
            mmproj=load.mmproj,
        )
    tokenizer = AutoTokenizer.from_pretrained(model_dir, chat_template=load.chat_template)
    del held_reader
    return model, tokenizer


def _gguf_reader(path: Path):
    """The shared reader of a .gguf file (None for a directory)."""
    if path.suffix != ".gguf" or not path.is_file():
        return None
    from astrai.model.weights.gguf import open_gguf

    return open_gguf(path)


def _device(load: LoadConfig) -> str:
    """The device --device names; auto is CUDA where there is one."""
    import torch

    if load.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return load.device


def _load_sharded(load: LoadConfig, config: EngineConfig, model_dir: Path, dtype, device):
    """Rank 0's shard of a tensor-parallel model (under torchrun, the other ranks serve steps
    inside this call and exit)."""
    from astrai.distributed import load_sharded

    return load_sharded(
        model_dir,
        config.tensor_parallel_size,
        dtype=dtype,
        device=device,
        dequantize=load.dequantize,
        quantization=load.quantization,
    )


# -- commands ---------------------------------------------------------------------------------


def serve_settings(flags: list[str]) -> tuple[argparse.Namespace, EngineConfig]:
    """`astrai serve`'s flags read as the command reads them, for astrai.deploy's replicas.

    A bad flag raises ConfigError with argparse's message instead of exiting the process.
    """
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = _parser().parse_args(["serve", *flags])
            _take_positional_model(args)
    except SystemExit:
        message = errors.getvalue().strip().splitlines()
        raise ConfigError(message[-1] if message else f"bad serve flags: {flags}") from None
    return args, from_flags(EngineConfig, args)


def open_server(args: argparse.Namespace, config: EngineConfig):
    """Load the engine `astrai serve`'s flags describe and create the app serving it.

    Returns (engine, app); the caller closes the engine. astrai.deploy's replicas run this too.
    """
    from astrai.server import create_app

    if _serves_several(args):
        raise ConfigError(
            "this command serves one model; --models-dir and several --model are astrai serve's"
        )
    if args.max_loaded_models is not None or args.idle_unload is not None:
        raise ConfigError(
            "--max-loaded-models and --idle-unload are for several models (--models-dir, or "
            "--model given more than once); one model stays loaded while the server runs"
        )
    model_dir = _model_path(args)
    name = args.model_name or _model_name(args, model_dir)
    config = _checkpoint_pooling(config, model_dir)
    sampling = _server_sampling(model_dir, _sampling_override(args))
    engine = _load_engine(args, config, model_dir)
    try:
        app = create_app(
            engine,
            name,
            sampling=sampling,
            api_key=args.api_key,
            allowed_hosts=[args.host, *args.allowed_hosts],
            max_request_bytes=args.max_request_bytes,
            read_timeout=args.read_timeout,
            docs=args.docs,
            webui=args.webui,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            lora_dir=args.lora_dir,
            allowed_media_domains=args.allowed_media_domains,
            media_fetch_timeout=args.media_fetch_timeout,
        )
    except BaseException:
        engine.close()
        raise
    log.info("serving model %r%s", name, " (API key required)" if args.api_key else "")
    return engine, app


def _checkpoint_pooling(config: EngineConfig, model_dir: Path) -> EngineConfig:
    """config pooling embeddings as the checkpoint says, unless --pooling says otherwise."""
    from astrai.model.pooling import checkpoint_pooling

    if config.pooling is None and (pooling := checkpoint_pooling(model_dir)) is not None:
        log.info("embeddings pool by %s, as the checkpoint's pooling config says", pooling)
        config = dataclasses.replace(config, pooling=pooling)
    return config


def _serves_several(args: argparse.Namespace) -> bool:
    """Whether `astrai serve` serves several models, each loaded on demand."""
    return args.models_dir is not None or len(getattr(args, "models", [])) > 1


def open_router(args: argparse.Namespace, config: EngineConfig):
    """The app serving the models of --models-dir and of each --model, none loaded yet.

    Returns (registry, app); the caller closes the registry (every model still loaded).
    """
    from astrai.server.app import ModelSource, create_router_app

    _refuse_for_several(args, config)
    sources = _router_models(args)
    if not sources:
        raise ConfigError(
            f"--models-dir {args.models_dir} holds no model (.gguf file or model "
            "directory with a config.json); put models there or give --model"
        )
    loaded_at_once = args.max_loaded_models or len(sources)
    config = _kv_share(config, from_flags(LoadConfig, args), loaded_at_once)
    override = _sampling_override(args)

    def loader(path: Path):
        def load():
            model_config = _checkpoint_pooling(config, path)
            sampling = _server_sampling(path, override)
            return _load_engine(args, model_config, path), sampling

        return load

    app = create_router_app(
        [ModelSource(name, path, loader(path)) for name, path in sources.items()],
        max_loaded_models=args.max_loaded_models,
        idle_unload=args.idle_unload,
        api_key=args.api_key,
        allowed_hosts=[args.host, *args.allowed_hosts],
        max_request_bytes=args.max_request_bytes,
        read_timeout=args.read_timeout,
        docs=args.docs,
        webui=args.webui,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        allowed_media_domains=args.allowed_media_domains,
        media_fetch_timeout=args.media_fetch_timeout,
    )
    for name, path in sources.items():
        log.info("serving model %r from %s, loaded when a request names it", name, path)
    log.info(
        "models loaded at once: %d at most%s%s",
        loaded_at_once,
        "" if args.idle_unload is None else f"; each unloaded after {args.idle_unload:g}s idle",
        " (API key required)" if args.api_key else "",
    )
    return app.state.models, app


def _refuse_for_several(args: argparse.Namespace, config: EngineConfig) -> None:
    """A ConfigError for the flags that name one model's settings, given with several models."""
    per_model = {
        "--lora": config.loras,
        "--max-loras": config.max_loras,
        "--lora-dir": args.lora_dir,
        "--model-name": args.model_name,
        "--revision": getattr(args, "revision", None),
        "--gguf-file": getattr(args, "gguf_file", None),
        "--mmproj": getattr(args, "mmproj", None),
    }
    given = [flag for flag, value in per_model.items() if value]
    if config.tensor_parallel_size > 1:
        given.append("--tensor-parallel-size")
    if given:
        raise ConfigError(
            f"{', '.join(given)} set one model's settings, but --models-dir or several --model "
            "serve several models; leave them out, or serve that model alone with --model"
        )


def _router_models(args: argparse.Namespace) -> dict[str, Path]:
    """Each model to serve on demand by its name: the models found in --models-dir, named by
    their path under it, then each --model, named as one model served alone is."""
    from astrai.model.weights.hub import resolve_model

    sources: dict[str, Path] = {}
    if args.models_dir is not None:
        sources.update(_models_in(Path(args.models_dir)))
    for model in getattr(args, "models", []):
        path = resolve_model(model)
        local = Path(model).exists()
        name = path.resolve().name if local else model
        if name in sources and sources[name] != path:
            raise ConfigError(
                f"two models go by the name {name!r}: {sources[name]} and {path}; rename one"
            )
        sources[name] = path
    return sources


def _models_in(directory: Path) -> dict[str, Path]:
    """The models below directory by their path under it: .gguf files (but vision projectors,
    mmproj*.gguf) and directories with a config.json (not looked into further)."""
    if not directory.is_dir():
        raise ConfigError(f"--models-dir {directory} is not a directory")
    found = {}
    for path in sorted(directory.rglob("*")):
        if any(parent in found.values() for parent in path.parents):
            continue  # a file of a model directory
        is_gguf = path.suffix == ".gguf" and path.is_file() and not path.name.startswith("mmproj")
        if is_gguf or (path.is_dir() and (path / "config.json").is_file()):
            found[path.relative_to(directory).as_posix()] = path
    return found


def _kv_share(config: EngineConfig, load: LoadConfig, models: int) -> EngineConfig:
    """config with its KV budget split evenly among the models loaded at once: a fraction of
    free memory is taken of the memory free now, before any model loads."""
    from astrai.inference.kv_cache import free_memory

    budget = config.kv_cache_memory
    if budget <= 1:
        budget *= free_memory(_device(load))
    share = int(budget // models)
    log.info(
        "KV cache budget %.0f MB: %.0f MB for each model, %d loaded at once at most",
        budget / 2**20,
        share / 2**20,
        models,
    )
    return dataclasses.replace(config, kv_cache_memory=share)


def _serve(args: argparse.Namespace, config: EngineConfig) -> int:
    # Bound before the model loads (seconds to minutes), so a busy port fails at once;
    # torchrun's other ranks serve steps, not HTTP.
    sock = _bound_socket(args.host, args.port) if os.environ.get("RANK", "0") == "0" else None
    from astrai.server import run_server

    try:
        if _serves_several(args):
            models, app = open_router(args, config)
            close = models.close
        else:
            engine, app = open_server(args, config)
            close = engine.close
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    if sock is not None:  # uvicorn says where it listens only for a socket it binds itself
        host, port = sock.getsockname()[:2]
        log.info("listening on http://%s:%d (Ctrl-C to stop)", host, port)
    try:
        # SIGINT and SIGTERM drain the server, which then returns here.
        run_server(
            app,
            args.host,
            args.port,
            shutdown_timeout=args.shutdown_timeout,
            header_timeout=args.read_timeout,
            sock=sock,
        )
    finally:
        close()
    return 0


def _bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (as uvicorn binds one), or a ConfigError that says why
    not."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        hint = (
            "another process is listening there: stop it or choose another --port"
            if exc.errno == errno.EADDRINUSE
            else "check --host and --port"
        )
        reason = exc.strerror or exc
        raise ConfigError(f"cannot listen on {host}:{port}: {reason}; {hint}") from None
    return sock


def _generate(args: argparse.Namespace, config: EngineConfig, params: GenerationParams) -> int:
    from astrai.inference import GenerationRequest, InferenceEngine
    from astrai.inference.engine import image_placeholder
    from astrai.model.vision.tiled_image import expand_image_tokens

    model_dir = _model_path(args)
    params = _adapter_params(
        _model_sampling(params, given_flags(GenerationParams, args), model_dir), config
    )
    model, tokenizer = _load_model(args, config, model_dir)
    prompt = args.prompt
    images = [_read_image(path, config) for path in args.image or ()]
    image_tokens = 0
    if images:
        if model.vision is None:
            raise ConfigError(f"--image needs a vision-language model; {model_dir} reads text only")
        parts = [{"type": "image", "image": image} for image in images]
        content = [*parts, {"type": "text", "text": prompt}]
        prompt = GenerationRequest(({"role": "user", "content": content},), params)
        vision = model.vision
        placeholder = image_placeholder(vision, tokenizer)
        prompt_ids = tokenizer.apply_chat_template(prompt.rendered_messages(placeholder))
        expanded, _ = expand_image_tokens(
            prompt_ids,
            [vision.tile(image) for image in images],
            vision.image_token_id,
            lambda text: tokenizer.encode(text, add_special_tokens=False),
        )
        image_tokens = len(expanded) - len(prompt_ids)
    elif args.chat:
        prompt = GenerationRequest(({"role": "user", "content": prompt},), params)
        prompt_ids = tokenizer.apply_chat_template(list(prompt.messages))
    else:
        prompt_ids = tokenizer.encode(prompt)
    if "max_total_tokens" not in given_flags(EngineConfig, args):
        # The prompt (each image's placeholder expanded) and its output are all this command's
        # KV pool ever holds.
        tokens = len(prompt_ids) + image_tokens + params.max_tokens
        config = dataclasses.replace(config, max_total_tokens=tokens)
    with InferenceEngine(model, tokenizer, config) as engine:
        for piece in engine.generate(prompt, params, stream=True):
            sys.stdout.write(piece)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _read_image(path: str, config: EngineConfig):
    """The image of a file, decoded within the engine's image limits."""
    from astrai.model.vision.decode import ImageError, ImageLimits, decode_image

    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"--image {path}: cannot read it ({exc.strerror})") from exc
    try:
        return decode_image(
            data, ImageLimits(config.max_image_bytes, config.max_image_pixels), path
        )
    except ImageError as exc:
        raise ConfigError(f"--image: {exc}") from exc


def _chat(args: argparse.Namespace, config: EngineConfig, params: GenerationParams) -> int:
    from astrai.chat_repl import ChatSession

    model_dir = _model_path(args)
    params = _adapter_params(
        _model_sampling(params, given_flags(GenerationParams, args), model_dir), config
    )
    if "max_batch_size" not in given_flags(EngineConfig, args):
        # One request at a time: a batch of one sizes the KV pool for one conversation.
        config = dataclasses.replace(config, max_batch_size=1)
    with _load_engine(args, config, model_dir) as engine:
        session = ChatSession(
            engine, params, _model_name(args, model_dir), interactive=sys.stdin.isatty()
        )
        return session.run()


def _bench(args: argparse.Namespace, config: EngineConfig) -> int:
    with _load_engine(args, config, _model_path(args)) as engine:
        rng = random.Random(args.seed)
        vocab = engine.model.config.vocab_size
        prompts = [
            [rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_requests)
        ]
        params = GenerationParams(max_tokens=args.output_len, seed=args.seed, ignore_eos=True)
        start = time.perf_counter()
        results = asyncio.run(_run_all(engine, prompts, params))
        seconds = time.perf_counter() - start
    prompt_tokens = sum(r.prompt_tokens for r in results)
    output_tokens = sum(r.completion_tokens for r in results)
    header = ("requests", "prompt tokens", "output tokens", "seconds", "output tok/s")
    row = (
        len(results),
        prompt_tokens,
        output_tokens,
        f"{seconds:.2f}",
        f"{output_tokens / seconds:.1f}",
    )
    widths = [max(len(h), len(str(v))) for h, v in zip(header, row, strict=True)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join(str(v).rjust(w) for v, w in zip(row, widths, strict=True)))
    return 0


async def _run_all(engine, prompts: list[list[int]], params) -> list:
    """Run every prompt concurrently, never more waiting than the engine's queue holds."""
    slots = asyncio.Semaphore(engine.config.max_waiting)
    done = 0

    async def run_one(prompt: list[int]):
        nonlocal done
        async with slots:
            async for event in engine.submit_async(prompt, params):
                if event.result is not None:
                    result = event.result
        done += 1
        print(f"\rbench: {done}/{len(prompts)} requests done", end="", file=sys.stderr, flush=True)
        return result

    results = await asyncio.gather(*(run_one(p) for p in prompts))
    print(file=sys.stderr)
    return results
