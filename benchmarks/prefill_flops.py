"""Prefill of one 512-token prompt against the machine's matmul rate, astrai and transformers.

The matmul rates are square bf16 and fp32 matmuls measured in the same run (up to 2048^3, less
where a dtype has no fast kernel and one product would take seconds). A prefill's
work is counted as the FLOPs of its matmuls: the projections and MLP of every layer on every
token, causal attention (QK^T and PV), and the lm_head on the last
row only, which is all either engine needs to produce the first token.

    python benchmarks/prefill_flops.py                     # fp32 and bf16, 2 threads
"""

from __future__ import annotations

import argparse
import queue
import random
import time

import torch
from machine import best_seconds, matmul_rate
from offline_throughput import _NoTextTokenizer
from workload import SMOLLM2_135M, write_random_model

from astrai.inference import STOP, GenerationParams, InferenceEngine
from astrai.model import AutoModel


def prefill_flops(model, num_tokens: int) -> float:
    """Matmul FLOPs of a prefill of num_tokens tokens that ends with one row of logits."""
    config = model.config
    layer_weights = sum(p.numel() for p in model.layers.parameters() if p.dim() == 2)
    attention = 2 * config.n_layers * config.n_heads * config.head_dim * num_tokens**2
    lm_head = 2 * config.dim * config.vocab_size
    return 2 * num_tokens * layer_weights + attention + lm_head


def astrai_prefill_seconds(engine: InferenceEngine, prompt_ids: list[int]) -> float:
    """Seconds from submitting a request with max_tokens=1 to its end (the first token)."""
    done: queue.SimpleQueue = queue.SimpleQueue()
    params = GenerationParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.submit(prompt_ids, params, lambda task, event: event is STOP and done.put(None))
    done.get()
    return time.perf_counter() - start


def hf_prefill_seconds(hf_model, prompt_ids: list[int], repeats: int) -> float:
    """Best seconds of generate(max_new_tokens=1): one prefill and its first token."""
    ids = torch.tensor([prompt_ids])

    def prefill() -> None:
        with torch.inference_mode():
            hf_model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)

    return best_seconds(prefill, repeats=repeats, warmup=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", action="append", choices=["float32", "bfloat16"])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5, help="best of this many runs")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    rng = random.Random(0)
    model_dir = write_random_model()
    vocab = SMOLLM2_135M["vocab_size"]
    # A fresh prompt per run, so the prefix cache cannot serve a later run from an earlier one.
    prompts = [
        [rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(args.repeats + 1)
    ]
    bf16_rate, fp32_rate = matmul_rate(torch.bfloat16), matmul_rate(torch.float32)
    print(
        f"prefill of one {args.prompt_tokens}-token prompt, {args.threads} threads; square "
        f"matmuls: bf16 {bf16_rate / 1e9:.1f} GFLOP/s, fp32 {fp32_rate / 1e9:.1f}"
    )
    # On a CPU without AVX-512 bf16 matmuls crawl, and the fp32 rate is the honest yardstick.
    print(
        f"{'dtype':<10}{'engine':<14}{'ms':>8}{'GFLOP/s':>9}{'of bf16 matmul':>16}"
        f"{'of fp32 matmul':>16}"
    )
    for dtype_name in args.dtype or ["float32", "bfloat16"]:
        dtype = getattr(torch, dtype_name)
        model = AutoModel.from_pretrained(model_dir, dtype=dtype)
        flops = prefill_flops(model, args.prompt_tokens)
        with InferenceEngine(model, _NoTextTokenizer(), max_batch_size=1) as engine:
            astrai_prefill_seconds(engine, prompts[-1])  # warm-up
            seconds = min(astrai_prefill_seconds(engine, p) for p in prompts[:-1])
        del model
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        peer_seconds = hf_prefill_seconds(hf_model, prompts[0], args.repeats)
        del hf_model
        for name, secs in (("astrai", seconds), ("transformers", peer_seconds)):
            rate = flops / secs
            print(
                f"{dtype_name:<10}{name:<14}{secs * 1e3:>8.0f}{rate / 1e9:>9.0f}"
                f"{rate / bf16_rate:>15.0%}{rate / fp32_rate:>16.0%}"
            )


if __name__ == "__main__":
    main()
