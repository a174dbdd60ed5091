"""Batch-1 decode against the memory-bandwidth roofline, astrai and transformers, same run.

One 128-token prompt, 256 new tokens, on the SmolLM2-135M-shaped random model. The roofline
is the bandwidth of a large tensor copy (measured here, now) divided by the bytes of weights a
decode step reads; the read-only roofline does the same with the bandwidth of a large sum,
which only reads, like a decode step. Decode speed is timed from the first new token to the
last, so the prefill is not in it.

    python benchmarks/decode_roofline.py                   # fp32 and bf16, 2 threads
    python benchmarks/decode_roofline.py --dtype float32 --repeats 3
"""

from __future__ import annotations

import argparse
import queue
import random
import time

import torch
from machine import copy_bandwidth, read_bandwidth, weight_bytes_per_token
from offline_throughput import _NoTextTokenizer
from workload import SMOLLM2_135M, write_random_model

from astrai.inference import STOP, GenerationParams, InferenceEngine
from astrai.model import AutoModel


def astrai_decode_rate(model, prompt_ids: list[int], new_tokens: int, **settings) -> float:
    """Decode tokens/s of one request: tokens after the first over the time they took, on an
    engine with these EngineConfig settings."""
    stamps: queue.SimpleQueue = queue.SimpleQueue()
    params = GenerationParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    with InferenceEngine(model, _NoTextTokenizer(), max_batch_size=1, **settings) as engine:
        engine.submit(
            prompt_ids, params, lambda task, event: stamps.put((event, time.perf_counter()))
        )
        times = []
        while (item := stamps.get())[0] is not STOP:
            times.append(item[1])
    return (len(times) - 1) / (times[-1] - times[0])


def transformers_decode_rate(hf_model, prompt_ids: list[int], new_tokens: int) -> float:
    """Decode tokens/s of generate: (new_tokens - 1) over generate(new_tokens) - generate(1)."""
    ids = torch.tensor([prompt_ids])

    def generate(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            hf_model.generate(
                ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
        return time.perf_counter() - start

    prefill = min(generate(1) for _ in range(3))
    return (new_tokens - 1) / (generate(new_tokens) - prefill)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", action="append", choices=["float32", "bfloat16"])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="best of this many runs")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    rng = random.Random(0)
    prompt = [rng.randrange(SMOLLM2_135M["vocab_size"]) for _ in range(args.prompt_tokens)]
    model_dir = write_random_model()
    print(
        f"batch-1 decode: {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, "
        f"{args.threads} threads"
    )
    print(
        f"{'dtype':<10}{'engine':<14}{'tok/s':>8}{'roofline':>10}{'of roofline':>13}"
        f"{'GB/s':>7}{'MB/step':>9}{'of read-only roofline':>23}{'read GB/s':>11}"
    )
    for dtype_name in args.dtype or ["float32", "bfloat16"]:
        dtype = getattr(torch, dtype_name)
        model = AutoModel.from_pretrained(model_dir, dtype=dtype)
        step_bytes = weight_bytes_per_token(model)
        rate = max(astrai_decode_rate(model, prompt, args.new_tokens) for _ in range(args.repeats))
        del model
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        peer = max(
            transformers_decode_rate(hf_model, prompt, args.new_tokens) for _ in range(args.repeats)
        )
        del hf_model
        # Measured after the engines, on the same warm machine and the same load.
        bandwidth, read = copy_bandwidth(), read_bandwidth()
        roofline, read_roofline = bandwidth / step_bytes, read / step_bytes
        for name, tok_s in (("astrai", rate), ("transformers", peer)):
            print(
                f"{dtype_name:<10}{name:<14}{tok_s:>8.1f}{roofline:>10.1f}"
                f"{tok_s / roofline:>12.0%}{bandwidth / 1e9:>8.1f}{step_bytes / 1e6:>9.0f}"
                f"{tok_s / read_roofline:>22.0%}{read / 1e9:>11.1f}"
            )


if __name__ == "__main__":
    main()
