"""Where a step's time goes on the offline workload: the model's forward pass against the rest.

The rest is the host side of a step -- admission, planning, page tables and the cache view,
sampling, appending tokens, stop checks and callbacks -- and should stay small against the
model. Steps are bucketed by how many decodes they ran; steps that also ran prompt chunks are
reported apart.

    python benchmarks/step_profile.py                      # 64 requests, fp32
    python benchmarks/step_profile.py --num-requests 16
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from offline_throughput import run_astrai
from workload import offline_workload, write_random_model

from astrai.inference.executor import ModelExecutor
from astrai.inference.scheduler import InferenceScheduler
from astrai.model import AutoModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = AutoModel.from_pretrained(write_random_model(), dtype=getattr(torch, args.dtype))
    # One entry per step that ran the model: [decodes, prompt tokens, forward s, step s]
    steps: list[list] = []
    execute, step = ModelExecutor.execute, InferenceScheduler.step
    model_forward = model.forward

    def timed_execute(executor: ModelExecutor, chunks):
        decodes = sum(chunk.length == 1 for chunk in chunks)
        steps.append([decodes, sum(c.length for c in chunks) - decodes, 0.0, 0.0])
        return execute(executor, chunks)

    def timed_forward(*inputs, **kwargs):
        start = time.perf_counter()
        logits = model_forward(*inputs, **kwargs)
        steps[-1][2] = time.perf_counter() - start
        return logits

    def timed_step(scheduler: InferenceScheduler) -> bool:
        before = len(steps)
        start = time.perf_counter()
        ran = step(scheduler)
        if len(steps) > before:
            steps[-1][3] = time.perf_counter() - start
        return ran

    model.forward = timed_forward
    ModelExecutor.execute, InferenceScheduler.step = timed_execute, timed_step
    try:
        tokens, seconds = run_astrai(model, offline_workload(args.num_requests), 64)
    finally:
        ModelExecutor.execute, InferenceScheduler.step = execute, step

    print(f"{tokens} output tokens in {seconds:.1f} s ({tokens / seconds:.1f} tok/s)")
    buckets: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for decodes, prompt_tokens, forward, total in steps:
        low = decodes // 8 * 8
        key = "with prompt chunks" if prompt_tokens else f"{low:>2}-{low + 7} decodes"
        buckets[key].append((total, forward))
    print(f"{'steps':<20}{'count':>6}{'ms/step':>9}{'forward':>9}{'host':>8}{'host %':>8}")
    for key in sorted(buckets):
        rows = buckets[key]
        step_ms = 1e3 * sum(s for s, _ in rows) / len(rows)
        forward_ms = 1e3 * sum(f for _, f in rows) / len(rows)
        host_ms = step_ms - forward_ms
        print(
            f"{key:<20}{len(rows):>6}{step_ms:>9.1f}{forward_ms:>9.1f}{host_ms:>8.2f}"
            f"{host_ms / step_ms:>8.1%}"
        )


if __name__ == "__main__":
    main()
