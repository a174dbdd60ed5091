"""The quant_linear kernel at 1 to a few rows of x on a stack of weights larger than the cache.

A decode step is one row; a speculative check of K guesses is K + 1. This times the C kernel
(the function a recorded step calls) over the linears of a model shaped like Llama 3.2 1B
(16 layers: q, k, v, o, gate, up, down), random blocks of each GGUF type with real-sized
scales, so that every pass streams its weights from memory: GB/s against the machine's read
bandwidth (the roofline of one row), and GMAC/s a core (what extra rows cost once the weights
are read). The peer, timed in the same run at the same rows: PyTorch's F.linear on dense bf16
weights of the same shapes, what the model would run without quantized weights.

    python benchmarks/quant_rows.py                          # Q4_1, Q8_0, Q4_K, Q6_K, Q4_0
    python benchmarks/quant_rows.py --types q4_1 --rows 1,2,3,4,5,6 --isa avx2
    python benchmarks/quant_rows.py --precision int8   # x in one int8 term (llama.cpp's)
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from machine import read_bandwidth
from workload import LLAMA_1B

from astrai.config import ACTIVATION_PRECISIONS
from astrai.kernels import native
from astrai.kernels.kernel_plan import ACTIVATION_TERMS, DEFAULT_PREFETCH, widest_quantized_isa
from astrai.kernels.quant_ops import QuantizedWeight

# where each type's fp16 scales lie in its GGUF block
SCALES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}


def random_weight(qtype: GGMLQuantizationType, shape: tuple[int, int], rng) -> QuantizedWeight:
    """W [out, in] in random blocks of qtype whose fp16 scales are 0.01."""
    weights, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (shape[0] * shape[1] // weights, nbytes), dtype=np.uint8)
    for at in SCALES[qtype.name]:
        blocks[:, at : at + 2] = np.full((len(blocks), 1), 0.01, np.float16).view(np.uint8)
    return QuantizedWeight.from_gguf(blocks.reshape(-1), qtype, shape)


def layer_shapes(layers: int) -> list[tuple[int, int]]:
    """(out_features, in_features) of the 1B shape's linears, in a step's order."""
    dim, ffn = LLAMA_1B["hidden_size"], LLAMA_1B["intermediate_size"]
    kv = dim // LLAMA_1B["num_attention_heads"] * LLAMA_1B["num_key_value_heads"]
    shapes = [(dim, dim), (kv, dim), (kv, dim), (dim, dim), (ffn, dim), (ffn, dim), (dim, ffn)]
    return shapes * layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="q4_1,q8_0,q4_k,q6_k,q4_0")
    parser.add_argument("--rows", default="1,2,4,5,6,8")
    parser.add_argument("--layers", type=int, default=LLAMA_1B["num_hidden_layers"])
    parser.add_argument("--isa", help="the kernel's CPU path (default: the widest)")
    parser.add_argument("--repeats", type=int, default=8, help="passes, the best kept")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--precision", default=ACTIVATION_PRECISIONS[0], choices=ACTIVATION_PRECISIONS,
        help="the activation precision x is quantized at (the default: astrai's)",
    )  # fmt: skip
    args = parser.parse_args()
    terms = ACTIVATION_TERMS[args.precision]
    if native.quant_linear is None:
        raise SystemExit("the C quant-linear kernel is not built")
    torch.set_num_threads(args.threads)
    isa = args.isa or widest_quantized_isa()
    bandwidth = read_bandwidth()
    print(
        f"{args.layers} layers of the 1B shape, {args.threads} threads, path "
        f"{isa}, x at {args.precision}, read bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s (1 GiB sum)\n"
    )
    rows_timed = sorted({1, *(int(r) for r in args.rows.split(","))})
    shapes = layer_shapes(args.layers)
    rng = np.random.default_rng(0)
    peer = {}  # rows -> seconds of a pass of F.linear on dense bf16 weights
    dense = [torch.randn(shape, dtype=torch.bfloat16) for shape in shapes]
    for rows in rows_timed:
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=torch.bfloat16) for w in dense}
        peer[rows] = best_pass([partial(F.linear, inputs[w.shape[1]], w) for w in dense], args)
    del dense
    print("| type | rows | ms a pass | GB/s | of read bandwidth | GMAC/s a core | x one row | "
          "dense bf16 F.linear ms | its time / ours |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.types.upper().split(","):
        qtype = GGMLQuantizationType[name]
        weights = [random_weight(qtype, shape, rng) for shape in shapes]
        nbytes = sum(w.nbytes() for w in weights)
        macs = sum(w.shape[0] * w.shape[1] for w in weights)
        one_row = None
        for rows in rows_timed:
            inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
            outputs = [torch.empty(rows, w.shape[0]) for w in weights]
            calls = [
                partial(native.quant_linear.linear, out.data_ptr(),
                        inputs[w.shape[1]].data_ptr(), w.packed.data_ptr(), w.packed.nbytes, 0,
                        rows, w.shape[1], w.shape[0], int(w.qtype), False, terms, isa,
                        DEFAULT_PREFETCH)
                for w, out in zip(weights, outputs, strict=True)
            ]  # fmt: skip
            best = best_pass(calls, args)
            one_row = one_row or best
            gmacs = macs * rows / best / 1e9 / args.threads
            print(
                f"| {name} | {rows} | {best * 1e3:.1f} | {nbytes / best / 1e9:.1f} | "
                f"{nbytes / best / bandwidth:.0%} | {gmacs:.0f} | {best / one_row:.2f} | "
                f"{peer[rows] * 1e3:.1f} | {peer[rows] / best:.2f}x |",
                flush=True,
            )


def best_pass(calls: list, args) -> float:
    """Seconds of the fastest of args.repeats passes over the calls, after one to warm up."""
    best = float("inf")
    for _ in range(args.repeats + 1):
        started = time.perf_counter()
        for call in calls:
            call()
        best = min(best, time.perf_counter() - started)
    return best


if __name__ == "__main__":
    main()
