"""astrai on a CUDA GPU: batch-1 decode against the bandwidth roofline and transformers, CUDA
graphs against eager launches, offline throughput and 16 concurrent streams.

A random-weight bf16 model shaped like Llama 3.2 1B is made on the GPU (no download), saved,
and loaded back by astrai straight onto the device. Every figure comes from this one run:
the roofline from a device-to-device copy measured here, transformers' greedy generate on the
same weights as the peer. Prints a table and writes every number as JSON (--out).

    python benchmarks/gpu_bench.py --out gpu_report.json
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import tempfile
import time
from pathlib import Path

import torch
from offline_throughput import _NoTextTokenizer, run_astrai
from workload import LLAMA_1B, offline_workload

from astrai.inference import STOP, GenerationParams, InferenceEngine
from astrai.kernels import triton_ops
from astrai.model import AutoModel


def device_seconds(fn, repeats: int = 10) -> float:
    """Median seconds of fn on the GPU, timed with CUDA events after a warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def ceilings() -> dict[str, float]:
    """The GPU's copy bandwidth (bytes read + written per second, 4 GiB copied) and bf16
    matmul rate (8192^3, random data), measured now."""
    src = torch.randn(1 << 30, device="cuda")
    dst = torch.empty_like(src)
    bandwidth = 2 * src.nbytes / device_seconds(lambda: dst.copy_(src))
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    flops = 2 * 8192**3 / device_seconds(lambda: a @ b)
    return {"copy_bandwidth_GBps": bandwidth / 1e9, "bf16_matmul_TFLOPs": flops / 1e12}


def make_model(directory: Path):
    """The random bf16 1B-shaped transformers model on the GPU, saved to directory."""
    import transformers

    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_1B))
    hf = hf.to(torch.bfloat16).eval()
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(directory, safe_serialization=True)
    return hf


def decode_rate(engine: InferenceEngine, prompt: list[int], new_tokens: int):
    """(tokens/s between the first and the last token of one greedy request, its tokens)."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    params = GenerationParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.submit(prompt, params, lambda task, event: events.put((time.perf_counter(), event)))
    stamps, tokens = [], []
    while (item := events.get())[1] is not STOP:
        stamps.append(item[0])
        tokens += item[1].token_ids
    return (len(tokens) - 1) / (stamps[-1] - stamps[0]), tokens


def hf_decode_rate(hf, prompt: list[int], new_tokens: int) -> float:
    """transformers' greedy generate: new tokens past the first per second (prefill and
    first token timed apart and taken out)."""
    ids = torch.tensor([prompt], device="cuda")

    def generate(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    generate(8)  # warm-up
    first = min(generate(1) for _ in range(3))
    return (new_tokens - 1) / (generate(new_tokens) - first)


def streams(model, clients: int, new_tokens: int) -> dict[str, float]:
    """clients requests at once, each streamed: output tok/s, time to first token and
    between tokens (p50/p99, ms)."""
    requests = offline_workload(clients, (32, 512), (new_tokens, new_tokens), seed=1,
                                vocab_size=LLAMA_1B["vocab_size"])  # fmt: skip
    events: queue.SimpleQueue = queue.SimpleQueue()
    params = GenerationParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    with InferenceEngine(model, _NoTextTokenizer(), max_batch_size=clients) as engine:
        start = time.perf_counter()
        for i, request in enumerate(requests):
            engine.submit(
                request.prompt_ids,
                params,
                lambda task, event, i=i: events.put((i, time.perf_counter(), event)),
            )
        stamps: dict[int, list[float]] = {i: [] for i in range(clients)}
        done, tokens = 0, 0
        while done < clients:
            i, at, event = events.get()
            if event is STOP:
                done += 1
                continue
            stamps[i].append(at)
            tokens += len(event.token_ids)
        elapsed = time.perf_counter() - start
    ttft = sorted(s[0] - start for s in stamps.values())
    gaps = sorted(b - a for s in stamps.values() for a, b in zip(s, s[1:], strict=False))

    def pct(values: list[float], q: float) -> float:
        return 1e3 * values[min(len(values) - 1, int(q * len(values)))]

    return {
        "output_tok_s": tokens / elapsed,
        "ttft_p50_ms": pct(ttft, 0.5),
        "ttft_p99_ms": pct(ttft, 0.99),
        "itl_p50_ms": pct(gaps, 0.5),
        "itl_p99_ms": pct(gaps, 0.99),
    }


def kernel_profile(model, path: Path, steps: int = 20) -> None:
    """The GPU time of each kernel over eager batch-1 decode steps (128-token context),
    largest first, written to path: which kernels a step's GPU time goes to."""
    from torch.profiler import ProfilerActivity, profile

    prompt = list(range(1, 129))
    with InferenceEngine(model, _NoTextTokenizer(), max_batch_size=1, cuda_graphs=False) as engine:
        decode_rate(engine, prompt, 4)
        with profile(activities=[ProfilerActivity.CUDA]) as trace:
            decode_rate(engine, prompt, steps)
    table = trace.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    path.write_text(f"{steps} eager decode steps, batch 1, 128-token context\n{table}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("gpu_report.json"))
    args = parser.parse_args()
    report: dict[str, object] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        **ceilings(),
    }
    with tempfile.TemporaryDirectory() as directory:
        hf = make_model(Path(directory))
        prompt = torch.randint(0, LLAMA_1B["vocab_size"], (128,)).tolist()
        report["transformers_decode_tok_s"] = hf_decode_rate(hf, prompt, args.new_tokens)
        del hf
        torch.cuda.empty_cache()
        start = time.perf_counter()
        model = AutoModel.from_pretrained(directory, dtype=torch.bfloat16, device="cuda")
        report["load_seconds"] = time.perf_counter() - start
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    report["weight_GB_per_token"] = weight_bytes / 1e9
    roofline = report["copy_bandwidth_GBps"] * 1e9 / weight_bytes
    report["roofline_tok_s"] = roofline
    # (graphs, small ops on Triton kernels); the last is the default engine
    variants = {
        "eager": (False, True),
        "graphs_torch_small_ops": (True, False),
        "graphs": (True, True),
    }
    outputs = {}
    for name, (graphs, triton_small_ops) in variants.items():
        triton_ops.available = triton_small_ops
        with InferenceEngine(
            model, _NoTextTokenizer(), max_batch_size=1, cuda_graphs=graphs
        ) as engine:
            decode_rate(engine, prompt, 16)  # compiles the prefill kernels first
            rate, outputs[name] = decode_rate(engine, prompt, args.new_tokens)
            report[name] = {"decode_tok_s": rate, "of_roofline": rate / roofline}
            if graphs:  # the GPU's time for one replayed step, the rest of a step is the host's
                replay = engine.scheduler.executor.cuda_steps.graphs[1].graph.replay
                step_ms = device_seconds(replay, repeats=50) * 1e3
                report[name].update(gpu_ms_per_step=step_ms, host_ms_per_step=1e3 / rate - step_ms)
    triton_ops.available = True
    report["graphs_over_eager"] = report["graphs"]["decode_tok_s"] / report["eager"]["decode_tok_s"]
    report["graphs_over_transformers"] = (
        report["graphs"]["decode_tok_s"] / report["transformers_decode_tok_s"]
    )
    report["graph_output_equals_eager"] = outputs["graphs"] == outputs["eager"]
    try:  # a breakdown only: the report stands without it
        kernel_profile(model, args.out.with_name("gpu_kernels.txt"))
    except Exception as error:
        print(f"kernel profile failed: {error!r}")
    requests = offline_workload(args.num_requests, vocab_size=LLAMA_1B["vocab_size"])
    tokens, seconds = run_astrai(model, requests, args.num_requests)
    report["offline_64_tok_s"] = tokens / seconds
    report["streams_16"] = streams(model, 16, 128)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    graphs = report["graphs"]
    print(
        f"\nbatch-1 decode: graphs {graphs['decode_tok_s']:.0f} tok/s "
        f"({graphs['of_roofline']:.0%} of {roofline:.0f} roofline; GPU "
        f"{graphs['gpu_ms_per_step']:.2f} ms + host {graphs['host_ms_per_step']:.2f} ms a step), "
        f"with PyTorch small ops {report['graphs_torch_small_ops']['decode_tok_s']:.0f}, eager "
        f"{report['eager']['decode_tok_s']:.0f}, transformers "
        f"{report['transformers_decode_tok_s']:.0f}; graphs/eager "
        f"{report['graphs_over_eager']:.2f}x; offline {report['offline_64_tok_s']:.0f} tok/s"
    )


if __name__ == "__main__":
    main()
