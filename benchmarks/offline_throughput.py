"""Offline throughput: astrai against transformers' batched generate, same weights, same run.

64 seeded requests (prompts 32-512 tokens, outputs 32-256, EOS ignored) on a random-weight
model shaped like SmolLM2-135M. Prints output tokens/s of both and their ratio per dtype.

    python benchmarks/offline_throughput.py                      # fp32 and bf16
    python benchmarks/offline_throughput.py --dtype bfloat16 --num-requests 16
"""

from __future__ import annotations

import argparse
import queue
import time

import torch
from workload import Request, left_padded, offline_workload, write_random_model

from astrai.inference import STOP, GenerationParams, InferenceEngine
from astrai.model import AutoModel


def run_astrai(
    model,
    requests: list[Request],
    max_batch_size: int,
    loras: dict[str, str] | None = None,
    names: list[str | None] | None = None,
) -> tuple[int, float]:
    """Submit every request at once, request i under the LoRA adapter names[i] (of loras)
    where given; return (output tokens, seconds)."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    config = {"max_batch_size": max_batch_size, "loras": loras or {}}
    with InferenceEngine(model, _NoTextTokenizer(), **config) as engine:
        start = time.perf_counter()
        for request, name in zip(requests, names or [None] * len(requests), strict=True):
            params = GenerationParams(
                max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True, lora=name
            )
            engine.submit(request.prompt_ids, params, lambda task, event: events.put(event))
        finished = 0
        while finished < len(requests):
            finished += events.get() is STOP
        elapsed = time.perf_counter() - start
        tokens = engine.get_stats().generation_tokens
    return tokens, elapsed


def run_transformers(hf_model, requests: list[Request], batch_size: int) -> tuple[int, float]:
    """Static batches in arrival order, left padded; only each request's own tokens count."""
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        ids, mask = left_padded(batch)
        with torch.inference_mode():
            hf_model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(r.max_tokens for r in batch),
                min_new_tokens=max(r.max_tokens for r in batch),
                do_sample=False,
                pad_token_id=0,
            )
    return sum(r.max_tokens for r in requests), time.perf_counter() - start


class _NoTextTokenizer:
    """The workload is token ids only; text is not part of what is measured."""

    stop_token_ids = frozenset()

    def detokenizer(self):
        return self

    def add(self, token_id: int) -> str:
        return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", action="append", choices=["float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--hf-batch-sizes", default="1,8,32", help="best of these is the peer")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    requests = offline_workload(args.num_requests)
    model_dir = write_random_model()
    print(
        f"{len(requests)} requests, {sum(len(r.prompt_ids) for r in requests)} prompt tokens, "
        f"{sum(r.max_tokens for r in requests)} output tokens, {args.threads} threads"
    )
    print(f"{'dtype':<10}{'engine':<26}{'tok/s':>10}{'seconds':>10}")
    for dtype_name in args.dtype or ["float32", "bfloat16"]:
        dtype = getattr(torch, dtype_name)
        model = AutoModel.from_pretrained(model_dir, dtype=dtype)
        tokens, seconds = run_astrai(model, requests, args.max_batch_size)
        astrai_rate = tokens / seconds
        print(f"{dtype_name:<10}{'astrai':<26}{astrai_rate:>10.1f}{seconds:>10.1f}")
        del model
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        best = 0.0
        for batch_size in (int(b) for b in args.hf_batch_sizes.split(",")):
            tokens, seconds = run_transformers(hf_model, requests, batch_size)
            best = max(best, tokens / seconds)
            label = f"transformers (batch {batch_size})"
            print(f"{dtype_name:<10}{label:<26}{tokens / seconds:>10.1f}{seconds:>10.1f}")
        del hf_model
        print(f"{dtype_name:<10}{'astrai / best transformers':<26}{astrai_rate / best:>10.2f}x")


if __name__ == "__main__":
    main()
