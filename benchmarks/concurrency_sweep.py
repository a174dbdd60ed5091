"""Throughput against the number of concurrent requests, astrai and transformers, same run.

For each concurrency c, c requests (random 128-token prompts, 128 new tokens each, EOS
ignored) start together: astrai gets them all at once, transformers runs them as one static
batch. Equal lengths mean the peer pads nothing, its best case. Prints output tokens/s and
writes benchmarks/plots/throughput_vs_concurrency.png.

    python benchmarks/concurrency_sweep.py                     # fp32, c = 1 .. 32
    python benchmarks/concurrency_sweep.py --dtype bfloat16 --concurrency 1,4,16
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import matplotlib
import torch
from offline_throughput import run_astrai, run_transformers
from workload import SMOLLM2_135M, Request, write_random_model

from astrai.model import AutoModel

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

PLOT = Path(__file__).parent / "plots" / "throughput_vs_concurrency.png"


def requests(count: int, prompt_tokens: int, new_tokens: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    vocab = SMOLLM2_135M["vocab_size"]
    return [
        Request([rng.randrange(vocab) for _ in range(prompt_tokens)], new_tokens)
        for _ in range(count)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--concurrency", default="1,2,4,8,16,32")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plot", type=Path, default=PLOT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    dtype = getattr(torch, args.dtype)
    model_dir = write_random_model()
    model = AutoModel.from_pretrained(model_dir, dtype=dtype)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    levels = [int(c) for c in args.concurrency.split(",")]
    run_astrai(model, requests(2, 16, 4, seed=-1), 2)  # warm-up
    print(
        f"{args.dtype}, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens each, "
        f"{args.threads} threads"
    )
    print(f"{'concurrent':>10}{'astrai tok/s':>14}{'transformers tok/s':>20}{'ratio':>8}")
    ours, peers = [], []
    for c in levels:
        batch = requests(c, args.prompt_tokens, args.new_tokens, seed=c)
        tokens, seconds = run_astrai(model, batch, max_batch_size=c)
        ours.append(tokens / seconds)
        tokens, seconds = run_transformers(hf_model, batch, batch_size=c)
        peers.append(tokens / seconds)
        print(f"{c:>10}{ours[-1]:>14.1f}{peers[-1]:>20.1f}{ours[-1] / peers[-1]:>7.2f}x")

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(levels, ours, "o-", label="astrai (continuous batching)")
    ax.plot(levels, peers, "s--", label="transformers generate (static batch)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"SmolLM2-135M shape, {args.dtype}, {args.threads} CPU threads")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=120)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
