"""The `astrai` command line: serve, generate, chat and bench."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import difflib
import errno
import logging
import random
import socket
import sys
import time
from pathlib import Path

# Only torch-free modules here: `astrai --help` and a busy --port answer without loading torch;
# the engine, the model and the server are imported where a command needs them.
from astrai.config import ConfigError, EngineConfig
from astrai.flags import build_parser, from_flags, given_flags, take_positional_model
from astrai.inference.task import GenerationParams, InvalidParamsError, RequestError
from astrai.launch import (
    generation_config_sampling,
    is_worker_rank,
    load_engine,
    load_model,
    model_name,
    model_path,
    open_router,
    open_server,
    serve_worker_rank,
    serves_several,
)

log = logging.getLogger("astrai")


def main(argv: list[str] | None = None) -> int:
    """Run one `astrai` subcommand; returns the process exit status."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        args.parser.error(_unrecognized(args.parser, unknown))
    take_positional_model(args)
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
    config = next(s for s in settings if isinstance(s, EngineConfig))
    try:
        if is_worker_rank(config):  # under torchrun: rank 0 runs the command, this its steps
            serve_worker_rank(args, config)
            return 0
        return COMMANDS[args.command](args, *settings)
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


def _caused_by_user(exc: Exception) -> bool:
    """Whether exc is an error the user can mend, reported in one line, not as a traceback."""
    if isinstance(exc, FileNotFoundError | ConfigError | RequestError):
        return True
    # Imported only now: astrai.model loads torch, which a busy --port need not wait for.
    from astrai.model import CheckpointError
    from astrai.tokenize import TokenizerError

    return isinstance(exc, CheckpointError | TokenizerError)


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


def _adapter_params(params: GenerationParams, config: EngineConfig) -> GenerationParams:
    """params generating under the one --lora adapter given, unless --use-lora names one."""
    if params.lora is None and len(config.loras) == 1:
        return dataclasses.replace(params, lora=config.adapters[0][0])
    return params


def _serve(args: argparse.Namespace, config: EngineConfig) -> int:
    # Bound before the model loads (seconds to minutes), so a busy port fails at once.
    sock = _bound_socket(args.host, args.port)
    from astrai.server import run_server

    try:
        if serves_several(args):
            models, app = open_router(args, config)
            close = models.close
        else:
            engine, app = open_server(args, config)
            close = engine.close
    except BaseException:
        sock.close()
        raise
    # uvicorn says where it listens only for a socket it binds itself
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

    if args.image and config.tensor_parallel_size > 1:
        raise ConfigError(
            "--image with --tensor-parallel-size: images run on one process only; leave one out"
        )
    model_dir = model_path(args)
    params = _adapter_params(
        _model_sampling(params, given_flags(GenerationParams, args), model_dir), config
    )
    model, tokenizer = load_model(args, config, model_dir)
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

    model_dir = model_path(args)
    params = _adapter_params(
        _model_sampling(params, given_flags(GenerationParams, args), model_dir), config
    )
    if "max_batch_size" not in given_flags(EngineConfig, args):
        # One request at a time: a batch of one sizes the KV pool for one conversation.
        config = dataclasses.replace(config, max_batch_size=1)
    with load_engine(args, config, model_dir) as engine:
        session = ChatSession(
            engine, params, model_name(args, model_dir), interactive=sys.stdin.isatty()
        )
        return session.run()


def _bench(args: argparse.Namespace, config: EngineConfig) -> int:
    with load_engine(args, config, model_path(args)) as engine:
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


COMMANDS = {"serve": _serve, "generate": _generate, "chat": _chat, "bench": _bench}
