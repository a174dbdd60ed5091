"""The paged decode attention kernel alone, at a few batches and context lengths.

SmolLM2-135M's heads (9 query heads over 3 kv heads of 64), fp32 q over an fp32 cache, each
decode's keys on pages of 16. For each (decodes, keys) shape: milliseconds a call, the best of
--rounds, and the cache bytes a call reads over that time against the machine's read bandwidth
measured in the same run. Warm, the call reads one layer's cache again and again (in L2/L3 when
it fits); with --cold, a pass calls the kernel on 30 layers' caches after 64 MB have been read,
as a decode step's weights leave the caches, and the figure is a layer's share of the pass.

--builds loads several builds of the extension into one process and times them in alternation
(as quant_hot.py does), so that a change to the kernel is judged on a noisy machine by builds
that share the noise; each build's outputs are checked equal to the first's.

    python benchmarks/decode_attention.py
    python benchmarks/decode_attention.py --builds old.so,new.so --cold --shapes 1x256,1x384
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
from builds import chosen_builds
from machine import read_bandwidth

from astrai.kernels import PagedDecode, native

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 9, 3, 64, 16
COLD_LAYERS = 30


def shape_calls(builds, decodes: int, keys: int, layers: int):
    """Per build, the kernel's calls on each of layers' caches for decodes of keys each (their
    pages shuffled in the pool), the outputs they write, and the tensors they read."""
    generator = torch.Generator().manual_seed(0)
    pages = decodes * -(-keys // PAGE_SIZE)
    k_cache = torch.randn(layers, pages, PAGE_SIZE, KV_HEADS, HEAD_DIM, generator=generator)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(pages, generator=generator).view(decodes, -1).contiguous()
    decode = PagedDecode(
        k_cache, v_cache, torch.arange(decodes), tables, torch.full((decodes,), keys)
    )
    q = torch.randn(decodes, HEADS, HEAD_DIM, generator=generator)
    outs = [torch.empty_like(q) for _ in builds]
    calls = [
        [
            partial(build.decode, *decode.kernel_call(layer, q, out, scale=HEAD_DIM**-0.5).args)
            for layer in range(layers)
        ]
        for build, out in zip(builds, outs, strict=True)
    ]
    return calls, outs, (k_cache, v_cache, decode, q)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x256,1x2048,8x256,8x2048,32x256",
                        help="DECODESxKEYS, comma-separated")  # fmt: skip
    parser.add_argument("--builds", help="comma-separated .so files (default: the built one)")
    parser.add_argument("--cold", action="store_true", help="30 layers after 64 MB read")
    parser.add_argument("--rounds", type=int, default=15, help="alternations, the best kept")
    parser.add_argument("--threads", type=int, default=2, help="the kernel's OpenMP threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # the kernel shares torch's OpenMP runtime
    names, builds = chosen_builds(args.builds, "_paged_attention", native.paged_attention)
    layers = COLD_LAYERS if args.cold else 1
    evict = torch.ones(16 << 20)  # 64 MB
    bandwidth = read_bandwidth()
    state = f"{layers} layers after 64 MB read" if args.cold else "one layer, warm"
    print(f"{args.threads} threads, {state}; read bandwidth {bandwidth / 1e9:.1f} GB/s")
    print("ms a layer's call, and its cache bytes over that time against the bandwidth\n")
    print("| decodes x keys | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(builds))
    for shape in args.shapes.split(","):
        decodes, keys = (int(n) for n in shape.split("x"))
        calls, outs, _alive = shape_calls(builds, decodes, keys, layers)
        best = [float("inf")] * len(builds)
        for _ in range(args.rounds):
            for k, layer_calls in enumerate(calls):
                for _ in range(1 if args.cold else 10):
                    if args.cold:
                        evict.sum()
                    started = time.perf_counter()
                    for call in layer_calls:
                        call()
                    best[k] = min(best[k], (time.perf_counter() - started) / layers)
        for name, out in zip(names[1:], outs[1:], strict=True):
            if not torch.equal(out, outs[0]):
                print(f"note: {name}'s outputs differ from {names[0]}'s")
        layer_bytes = 2 * decodes * keys * KV_HEADS * HEAD_DIM * 4
        cells = [f"{b * 1e3:.3f} ({layer_bytes / b / bandwidth:.0%})" for b in best]
        print(f"| {decodes} x {keys} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
