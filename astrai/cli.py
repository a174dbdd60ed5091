"""The `astrai` command line: serve, generate, chat and bench."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import signal
import sys
import time
from pathlib import Path

from astrai.config import ConfigError, EngineConfig

log = logging.getLogger("astrai")

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "demo"
_ENGINE_DEFAULTS = EngineConfig()


def main(argv: list[str] | None = None) -> int:
    """Run one `astrai` subcommand; returns the process exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from astrai.inference.task import RequestError
    from astrai.model import CheckpointError
    from astrai.tokenize import TokenizerError

    try:
        return args.command(args)
    except (FileNotFoundError, ConfigError, CheckpointError, TokenizerError, RequestError) as exc:
        print(f"astrai: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


# -- flags ------------------------------------------------------------------------------------


def _engine_flags() -> argparse.ArgumentParser:
    flags = argparse.ArgumentParser(add_help=False)
    group = flags.add_argument_group("model and engine")
    group.add_argument(
        "--model",
        type=Path,
        metavar="DIR",
        help="model directory (Hugging Face Llama-family or native astrai); "
        "default: the small demo model shipped with astrai",
    )
    group.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="weight and KV-cache dtype; auto is bfloat16 on CUDA, float32 on CPU "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--device",
        default="auto",
        metavar="DEVICE",
        help="cpu, cuda or cuda:N; auto picks CUDA when present",
    )
    group.add_argument(
        "--max-batch-size",
        type=int,
        metavar="N",
        default=_ENGINE_DEFAULTS.max_batch_size,
        help="most requests generated at once (default: %(default)s)",
    )
    group.add_argument(
        "--kv-cache-memory",
        type=float,
        metavar="BYTES_OR_FRACTION",
        default=_ENGINE_DEFAULTS.kv_cache_memory,
        help="KV cache budget: bytes if above 1, else a fraction of free device memory "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--page-size",
        type=int,
        metavar="N",
        default=_ENGINE_DEFAULTS.page_size,
        help="tokens per KV cache page (default: %(default)s)",
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        metavar="N",
        default=_ENGINE_DEFAULTS.max_num_batched_tokens,
        help="token budget of one forward pass; longer prompts are prefilled in chunks "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--max-seq-len",
        type=int,
        metavar="N",
        help="longest prompt plus output in tokens (default: the model's context length)",
    )
    group.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="do not reuse the KV cache of shared prompt prefixes",
    )
    return flags


def _sampling_flags() -> argparse.ArgumentParser:
    from astrai.inference import GenerationParams

    defaults = GenerationParams()
    flags = argparse.ArgumentParser(add_help=False)
    group = flags.add_argument_group("sampling")
    group.add_argument(
        "--max-tokens",
        type=int,
        metavar="N",
        default=defaults.max_tokens,
        help="most tokens to generate (default: %(default)s)",
    )
    group.add_argument(
        "--temperature",
        type=float,
        metavar="T",
        default=defaults.temperature,
        help="softmax temperature; 0 is greedy (default: %(default)s)",
    )
    group.add_argument(
        "--top-p",
        type=float,
        metavar="P",
        default=defaults.top_p,
        help="nucleus sampling: keep the smallest set of tokens whose probability reaches "
        "this; 1 is off (default: %(default)s)",
    )
    group.add_argument(
        "--top-k",
        type=int,
        metavar="N",
        default=defaults.top_k,
        help="keep only the k most likely tokens; 0 is off (default: %(default)s)",
    )
    group.add_argument("--seed", type=int, metavar="N", help="seed for reproducible sampling")
    group.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop when this text appears (not printed); repeat for several",
    )
    return flags


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="astrai",
        description="astrai: a small, fast LLM inference engine. Without --model every "
        "command uses the demo model shipped with astrai.",
    )
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    engine, sampling = _engine_flags(), _sampling_flags()

    serve = commands.add_parser(
        "serve",
        parents=[engine],
        help="serve OpenAI- and Anthropic-compatible HTTP APIs",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models, /v1/messages, "
        "/health and /metrics.",
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
        help="model name clients must send (default: the model directory's name)",
    )
    serve.set_defaults(command=_serve)

    generate = commands.add_parser(
        "generate",
        parents=[engine, sampling],
        help="generate a continuation of a prompt, streamed to stdout",
        description="Generate from one prompt and stream the text to stdout.",
    )
    generate.add_argument("prompt", help="the prompt text")
    generate.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message through the model's chat template",
    )
    generate.set_defaults(command=_generate)

    chat = commands.add_parser(
        "chat",
        parents=[engine, sampling],
        help="chat interactively; keeps the conversation's history",
        description="Chat with the model through its chat template. Type /reset to forget "
        "the conversation, /exit (or end of input) to leave.",
    )
    chat.set_defaults(command=_chat)

    bench = commands.add_parser(
        "bench",
        parents=[engine],
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
    bench.set_defaults(command=_bench)
    return parser


# -- loading ----------------------------------------------------------------------------------


def _model_dir(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return args.model
    log.info("no --model given; using the demo model at %s", DEMO_MODEL_DIR)
    return DEMO_MODEL_DIR


def _load_engine(args: argparse.Namespace, model_dir: Path):
    import torch

    from astrai.inference import InferenceEngine
    from astrai.model import AutoModel
    from astrai.tokenize import AutoTokenizer

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if torch.device(device).type == "cuda" else "float32"
    config = EngineConfig(
        max_batch_size=args.max_batch_size,
        kv_cache_memory=args.kv_cache_memory,
        page_size=args.page_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_seq_len=args.max_seq_len,
        enable_prefix_cache=not args.no_prefix_cache,
    )
    model = AutoModel.from_pretrained(model_dir, dtype=dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return InferenceEngine(model, tokenizer, config)


def _params(args: argparse.Namespace):
    from astrai.inference import GenerationParams

    return GenerationParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )


# -- commands ---------------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from astrai.server import create_app

    model_dir = _model_dir(args)
    name = args.model_name or model_dir.resolve().name
    engine = _load_engine(args, model_dir)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM (stops accepting, gives requests a few
    # seconds, then cancels them), then raises the signal again. Let SIGTERM unwind like
    # SIGINT instead of killing the process, so the engine below is closed in both cases.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        app = create_app(engine, name, api_key=args.api_key)
        log.info("serving model %r%s", name, " (API key required)" if args.api_key else "")
        uvicorn.run(app, host=args.host, port=args.port, timeout_graceful_shutdown=5)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        engine.close()
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _generate(args: argparse.Namespace) -> int:
    from astrai.inference import GenerationRequest

    params = _params(args)
    with _load_engine(args, _model_dir(args)) as engine:
        prompt = args.prompt
        if args.chat:
            prompt = GenerationRequest(({"role": "user", "content": prompt},), params)
        for piece in engine.generate(prompt, params, stream=True):
            sys.stdout.write(piece)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _chat(args: argparse.Namespace) -> int:
    from astrai.inference import GenerationRequest
    from astrai.inference.task import RequestError

    params = _params(args)
    interactive = sys.stdin.isatty()
    with _load_engine(args, _model_dir(args)) as engine:
        history: list[dict[str, str]] = []
        while True:
            try:
                line = input("> " if interactive else "").strip()
            except EOFError:
                break
            if line == "/exit":
                break
            if line == "/reset":
                history.clear()
                continue
            if not line:
                continue
            history.append({"role": "user", "content": line})
            pieces = []
            try:
                for piece in engine.generate(
                    GenerationRequest(tuple(history), params), stream=True
                ):
                    sys.stdout.write(piece)
                    sys.stdout.flush()
                    pieces.append(piece)
            except RequestError as exc:
                history.pop()
                print(f"astrai: {exc}; type /reset to start over", file=sys.stderr)
                continue
            sys.stdout.write("\n")
            history.append({"role": "assistant", "content": "".join(pieces)})
    return 0


def _bench(args: argparse.Namespace) -> int:
    from astrai.inference import GenerationParams

    with _load_engine(args, _model_dir(args)) as engine:
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
