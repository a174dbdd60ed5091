"""The quant_linear kernel's arithmetic rate: one thread, W hot in the L2 cache.

Where a CPU path is bound by its instructions rather than by memory (AVX2 without vpdpbusd,
on a core that splits 256-bit operations in two), decode speed follows this rate, not the
read bandwidth: two cores streaming a 1B model cannot beat twice this figure. It is also how
to judge a change to the kernel on a noisy machine: --builds loads several builds of the
extension into one process and times them in alternation, so that they share the noise.

    python benchmarks/quant_hot.py                    # the built kernel
    python benchmarks/quant_hot.py --builds old.so,new.so --rows 1,2
    python benchmarks/quant_hot.py --precision int8   # x in one int8 term (llama.cpp's)
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from builds import chosen_builds
from gguf import GGMLQuantizationType
from quant_rows import random_weight

from astrai.config import ACTIVATION_PRECISIONS
from astrai.kernels import native
from astrai.kernels.kernel_plan import ACTIVATION_TERMS, DEFAULT_PREFETCH


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="q4_0,q4_1,q8_0,q4_k,q6_k,q5_0")
    parser.add_argument("--rows", default="1,2")
    parser.add_argument("--isa", default="avx2", help="the kernel's CPU path")
    parser.add_argument("--builds", help="comma-separated .so files (default: the built one)")
    parser.add_argument("--out-features", type=int, default=256, help="W's rows (fits L2)")
    parser.add_argument("--in-features", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=40, help="alternations, the best kept")
    parser.add_argument("--threads", type=int, default=1, help="the kernel's OpenMP threads")
    parser.add_argument(
        "--precision", default=ACTIVATION_PRECISIONS[0], choices=ACTIVATION_PRECISIONS,
        help="the activation precision x is quantized at (the default: astrai's)",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # the kernels share torch's OpenMP runtime
    names, builds = chosen_builds(args.builds, "_quant_linear", native.quant_linear)
    shape_text = f"W {args.out_features} x {args.in_features}, x at {args.precision}"
    print(f"path {args.isa}, {shape_text}, GB/s of W on {args.threads} thread(s)\n")
    print("| type | rows | " + " | ".join(names) + " |")
    print("|---|---:|" + "---:|" * len(builds))
    rng = np.random.default_rng(0)
    shape = (args.out_features, args.in_features)
    for name in args.types.upper().split(","):
        qtype = GGMLQuantizationType[name]
        weight = random_weight(qtype, shape, rng)
        for rows in (int(r) for r in args.rows.split(",")):
            x, out = torch.randn(rows, shape[1]), torch.empty(rows, shape[0])
            packed = weight.packed
            call = (out.data_ptr(), x.data_ptr(), packed.data_ptr(), packed.nbytes, 0, rows)
            call += (*shape[::-1], int(qtype), False, ACTIVATION_TERMS[args.precision], args.isa)
            call += (DEFAULT_PREFETCH,)
            best = [float("inf")] * len(builds)
            for _ in range(args.rounds):
                for k, build in enumerate(builds):
                    started = time.perf_counter()
                    for _ in range(20):
                        build.linear(*call)
                    best[k] = min(best[k], (time.perf_counter() - started) / 20)
            rates = " | ".join(f"{weight.nbytes() / b / 1e9:.2f}" for b in best)
            print(f"| {name} | {rows} | {rates} |", flush=True)


if __name__ == "__main__":
    main()
