"""The small ops of a batch-1 decode step: PyTorch eager, torch.compile and astrai's kernels.

Between the linears, a decode layer runs rope, the residual add with RMSNorm, and SwiGLU on
one token. Each is a few microseconds of eager dispatch; a compiled region adds its own
guard and call overhead; astrai runs each as one C call (astrai/kernels/csrc/fused_ops.c). Prints
microseconds per call for the three, same run.

    python benchmarks/compile_small_ops.py
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from workload import SMOLLM2_135M

from astrai import kernels as fused_ops


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def add_and_norm(h: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
    summed = h + residual
    return F.rms_norm(summed, weight.shape, weight, 1e-5), summed


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def microseconds(fn, *inputs, calls: int = 3000) -> float:
    for _ in range(50):
        fn(*inputs)
    start = time.perf_counter()
    for _ in range(calls):
        fn(*inputs)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dim, ffn = SMOLLM2_135M["hidden_size"], SMOLLM2_135M["intermediate_size"]
    heads = SMOLLM2_135M["num_attention_heads"] + SMOLLM2_135M["num_key_value_heads"]
    head_dim = dim // SMOLLM2_135M["num_attention_heads"]

    def add_and_norm_kernel(h, residual, weight):
        return fused_ops.add_rms_norm(h, residual, weight, 1e-5)

    # (name, PyTorch formula, astrai's fused op, inputs)
    cases = [
        (
            "rope",
            rope,
            fused_ops.apply_rope,
            [torch.randn(1, heads, head_dim)] + [torch.randn(1, 1, head_dim)] * 2,
        ),
        (
            "add + rmsnorm",
            add_and_norm,
            add_and_norm_kernel,
            [torch.randn(1, dim), torch.randn(1, dim), torch.randn(dim)],
        ),
        ("swiglu", swiglu, fused_ops.silu_and_mul, [torch.randn(1, 2 * ffn)]),
    ]
    print(f"one token, {args.threads} threads; microseconds per call")
    print(
        f"{'op':<16}{'eager':>8}{'compiled':>10}{'astrai':>8}{'compiled / eager':>18}"
        f"{'astrai / eager':>16}{'compile s':>11}"
    )
    with torch.inference_mode():
        for name, fn, kernel, inputs in cases:
            torch.testing.assert_close(kernel(*inputs), fn(*inputs))
            eager, fused = microseconds(fn, *inputs), microseconds(kernel, *inputs)
            compiled_fn = torch.compile(fn, dynamic=False)
            start = time.perf_counter()
            compiled_fn(*inputs)
            compile_seconds = time.perf_counter() - start
            compiled = microseconds(compiled_fn, *inputs)
            print(
                f"{name:<16}{eager:>8.1f}{compiled:>10.1f}{fused:>8.1f}"
                f"{compiled / eager:>17.1f}x{fused / eager:>15.2f}x{compile_seconds:>11.1f}"
            )


if __name__ == "__main__":
    main()
