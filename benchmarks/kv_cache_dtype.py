"""Decode speed at a long context by KV cache dtype, on the real SmolLM2-135M-Instruct GGUF.

At 2048 tokens of context SmolLM2's fp32 KV cache (30 layers, 3 KV heads of 64) holds 94 MB
per sequence, more than its 66 MB of Q4_1 linears: decode attention's reads then weigh as much
as the weights' do, and a bf16 or fp16 cache halves them. For each --kv-cache-dtype, the
model (fp32 compute) decodes --new-tokens greedy tokens after random prompts of
--context tokens, at batch 1 and batch --batch, on the C decode kernel; printed: decode
tokens/s (the best of --repeats, the dtypes interleaved so a busy neighbour hurts them alike),
each dtype's ratio to fp32, the KV bytes a sequence holds, and how many greedy outputs equal
fp32's. Then the decode kernel alone on one layer of that batch (the best of 150 calls, the
dtypes interleaved), steadier on a shared machine than whole steps.

    python benchmarks/kv_cache_dtype.py  # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import queue
import random
import time

import torch
from offline_throughput import _NoTextTokenizer
from vs_llamacpp import smollm2_gguf

from astrai.inference import STOP, GenerationParams, InferenceEngine
from astrai.kernels import PagedDecode
from astrai.model import AutoModel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def decode_run(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    """Decode tokens/s of prompts submitted at once, and each one's greedy token ids.

    The window runs from the moment the last of them has its first token (prefill done) to
    the moment the first of them ends, so only steps where all decode together count.
    """
    params = GenerationParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    stamps: queue.SimpleQueue = queue.SimpleQueue()
    tasks = [
        task
        for ids in prompts
        for task in engine.submit(
            ids, params, lambda task, event: stamps.put((task, event, time.perf_counter()))
        )
    ]
    times, ids = {task: [] for task in tasks}, {task: [] for task in tasks}
    remaining = len(tasks)
    while remaining:
        task, event, stamp = stamps.get()
        if event is STOP:
            remaining -= 1
        else:
            times[task].append(stamp)
            ids[task] += event.token_ids
    start = max(t[0] for t in times.values())
    end = min(t[-1] for t in times.values())
    steps = sum(start < stamp <= end for t in times.values() for stamp in t)
    return steps / (end - start), [ids[task] for task in tasks]


def kernel_layer_ms(config, dtypes: list[str], batch: int, context: int) -> dict[str, float]:
    """Milliseconds of one layer's decode attention for batch decodes of context keys each,
    the model's heads, fp32 q over a cache of each dtype: the best of 150 calls."""
    page_size, n_heads, kv_heads, head_dim = 16, config.n_heads, config.n_kv_heads, config.head_dim
    pages = batch * -(-context // page_size)
    calls, alive = {}, []  # the kernel reads the cache and tables through raw pointers
    for name in dtypes:
        k_cache = torch.randn(1, pages, page_size, kv_heads, head_dim).to(DTYPES[name])
        v_cache = torch.randn_like(k_cache)
        decode = PagedDecode(
            k_cache,
            v_cache,
            rows=torch.arange(batch),
            block_tables=torch.arange(pages).view(batch, -1).contiguous(),
            context_lens=torch.full((batch,), context),
        )
        q = torch.randn(batch, n_heads, head_dim)
        calls[name] = decode.kernel_call(0, q, torch.empty_like(q), scale=head_dim**-0.5)
        alive.append((k_cache, v_cache, decode))
    best = dict.fromkeys(dtypes, float("inf"))
    for _ in range(15):
        for name, call in calls.items():
            for _ in range(10):
                start = time.perf_counter()
                call()
                best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kv-cache-dtype", action="append", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="best of this many runs")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = args.kv_cache_dtype or ["fp32", "bf16", "fp16"]
    if dtypes[0] != "fp32":
        dtypes = ["fp32", *dtypes]  # the ratios' base
    model = AutoModel.from_pretrained(smollm2_gguf())
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.context)] for _ in range(args.batch)]
    print(
        f"SmolLM2-135M-Instruct Q4_1, fp32 compute, {torch.get_num_threads()} threads, "
        f"{args.context}-token context, {args.new_tokens} new tokens, best of {args.repeats}"
    )
    engines = {
        dtype: InferenceEngine(
            model,
            _NoTextTokenizer(),
            max_batch_size=args.batch,
            max_seq_len=args.context + args.new_tokens,
            enable_prefix_cache=False,  # each run computes its prompts' K/V
            kv_cache_dtype=dtype,
        )
        for dtype in dtypes
    }
    for engine in engines.values():  # the first steps time the kernels' paths
        decode_run(engine, [prompts[0][:64]], 4)
    best = {(dtype, batch): 0.0 for dtype in dtypes for batch in (1, args.batch)}
    outputs = {}
    for _ in range(args.repeats):
        for batch in (1, args.batch):
            for dtype, engine in engines.items():
                rate, ids = decode_run(engine, prompts[:batch], args.new_tokens)
                best[dtype, batch] = max(best[dtype, batch], rate)
                outputs[dtype, batch] = ids
    print("| KV cache | KV MB a sequence | batch | decode tok/s | vs fp32 | outputs as fp32's |")
    print("|---|---:|---:|---:|---:|---:|")
    for batch in (1, args.batch):
        for dtype, engine in engines.items():
            reference, ids = outputs["fp32", batch], outputs[dtype, batch]
            equal = sum(x == y for x, y in zip(reference, ids, strict=True))
            cache = engine.cache
            token_bytes = 2 * cache.kv.k_cache.nbytes / (cache.n_pages * cache.page_size)
            print(
                f"| {dtype} | {token_bytes * args.context / 1e6:.0f} | {batch} | "
                f"{best[dtype, batch]:.1f} | {best[dtype, batch] / best['fp32', batch]:.2f}x | "
                f"{equal}/{batch} |"
            )
    for engine in engines.values():
        engine.close()
    layer_ms = kernel_layer_ms(model.config, dtypes, args.batch, args.context)
    print(f"\nthe decode kernel alone, one layer, {args.batch} decodes of {args.context} keys")
    print("| KV cache | ms | vs fp32 (speed) |")
    print("|---|---:|---:|")
    for name, ms in layer_ms.items():
        print(f"| {name} | {ms:.3f} | {layer_ms['fp32'] / ms:.2f}x |")


if __name__ == "__main__":
    main()
