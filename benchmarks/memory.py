"""Resident memory of astrai and llama-server on the same GGUF files, in the same run.

For the real SmolLM2-135M-Instruct Q4_1 file and a random model shaped like Llama 3.2 1B
(vs_llamacpp.llama_1b_gguf, quantized to Q4_1 by llama-quantize), as /proc/<pid>/smaps_rollup
counts it, anonymous memory and mapped files apart:

- astrai's load: what AutoModel.from_pretrained adds to a fresh process that has imported
  astrai (the figure tests/model/test_gguf_memory.py holds to 1.15x the file);
- each server after it answers /health, and after 64 requests (8 clients; 64-token prompts,
  16 new tokens, EOS ignored): `astrai serve` and `llama-server` with the same slots and
  context per slot (llama.cpp's plain path, --no-repack, as vs_llamacpp.py runs it). A server's
  figure holds the whole process: Python, PyTorch and the tokenizer for astrai, and each
  engine's KV cache as far as it has touched it (llama.cpp clears its cache at start).

    python benchmarks/memory.py                 # both files, ~10 min on 2 idle cores
    python benchmarks/memory.py --shapes smollm2 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from concurrency_sweep import requests as equal_requests
from vs_llamacpp import (
    astrai_server,
    cpu_name,
    gguf_file,
    llama_1b_gguf,
    llama_cpp_bin,
    llama_server,
    run_clients,
)

MB = 1e6
# astrai's load in a fresh process: (anonymous, file) bytes it adds
LOAD = """
import json, sys
from astrai.model import AutoModel

def resident():
    fields = {}
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup:
            name, value, *unit = line.split()
            if unit == ["kB"]:
                fields[name.rstrip(":")] = int(value) * 1024
    return fields["Anonymous"], fields["Rss"] - fields["Anonymous"]

before = resident()
model = AutoModel.from_pretrained(sys.argv[1])
print(json.dumps([now - then for now, then in zip(resident(), before)]))
"""


def resident(pid: int) -> tuple[int, int]:
    """(anonymous, file-mapped) resident bytes of process pid."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        name, value, *unit = line.split()
        if unit == ["kB"]:
            fields[name.rstrip(":")] = int(value) * 1024
    return fields["Anonymous"], fields["Rss"] - fields["Anonymous"]


def astrai_load(gguf: Path) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", LOAD, str(gguf)], capture_output=True, text=True, check=True
    )
    return tuple(json.loads(out.stdout.splitlines()[-1]))


def server_rows(name: str, started, server, args) -> list[tuple[str, tuple[int, int]]]:
    """The server's resident memory once up, and after the requests."""
    work = equal_requests(args.requests, args.prompt_tokens, args.new_tokens, seed=0)
    with started as process:
        loaded = resident(process.pid)
        run_clients(server, work, args.clients, stream=False)
        served = resident(process.pid)
    return [(f"{name}, loaded", loaded), (f"{name}, after {len(work)} requests", served)]


def row(gguf: Path, what: str, memory: tuple[int, int]) -> str:
    anonymous, mapped = memory
    size = gguf.stat().st_size
    total = anonymous + mapped
    return (
        f"| {gguf.name} | {what} | {anonymous / MB:.0f} | {mapped / MB:.0f} | {total / MB:.0f} "
        f"| {total / size:.2f}x |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="smollm2,1b", help="comma-separated: smollm2, 1b")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--slots", type=int, default=8, help="each server's batch / slots")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    bin_dir = llama_cpp_bin()
    workdir = Path(tempfile.mkdtemp(prefix="astrai-memory-"))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{cpu_name()}, {args.threads} threads; load average {load}; files, logs: {workdir}")
    lines = [
        "| file | process | anonymous MB | file-mapped MB | total MB | of the file |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for shape in args.shapes.split(","):
        source = llama_1b_gguf(workdir) if shape == "1b" else None
        gguf = gguf_file(bin_dir, "q4_1", workdir, args.threads, source)
        print(f"{gguf.name}: {gguf.stat().st_size / MB:.0f} MB")
        lines.append(row(gguf, "astrai, the load alone", astrai_load(gguf)))
        ours = astrai_server(gguf, args.slots, args.threads, "float32", workdir / "astrai.log")
        theirs = llama_server(bin_dir, gguf, args.slots, args.threads, workdir / "llama.log")
        for name, (started, server) in (("astrai serve", ours), ("llama-server", theirs)):
            lines += [
                row(gguf, what, memory) for what, memory in server_rows(name, started, server, args)
            ]
            print(lines[-1])
        if source is not None:  # 2 GB of F16 and its Q4_1 copy
            source.unlink()
            gguf.unlink()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
