"""The cost of serving LoRA adapters: astrai with adapters against astrai without, and against
transformers + PEFT, in the same run.

A random-weight SmolLM2-135M-shaped model and random rank-16 adapters on all seven linears
of every layer (PEFT's layout). Measured:

- batch-1 decode tok/s (128-token prompt, 128 new tokens): the base model, one adapter, and
  transformers + PEFT with that adapter;
- offline throughput of 64 requests (offline_throughput.py's workload) spread round-robin
  over 1, 4 and 16 adapters loaded at once, against the same requests on the base model,
  and transformers + PEFT's mixed-adapter batches (generate's adapter_names) on the first
  --peer-requests of the 4-adapter workload, in batches of 8.

    python benchmarks/lora.py
    python benchmarks/lora.py --num-requests 16 --adapters 1,4
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from offline_throughput import run_astrai
from safetensors.torch import save_file
from workload import SMOLLM2_135M, Request, left_padded, offline_workload, write_random_model

from astrai.model import AutoModel

TARGETS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def write_adapter(directory: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter directory with random A and B on every linear of every layer."""
    shape = SMOLLM2_135M
    dim, ffn = shape["hidden_size"], shape["intermediate_size"]
    kv = dim // shape["num_attention_heads"] * shape["num_key_value_heads"]
    sizes = {  # (in, out)
        "q_proj": (dim, dim), "k_proj": (dim, kv), "v_proj": (dim, kv), "o_proj": (dim, dim),
        "gate_proj": (dim, ffn), "up_proj": (dim, ffn), "down_proj": (ffn, dim),
    }  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape["num_hidden_layers"]):
        for block, names in TARGETS.items():
            for name in names:
                in_features, out_features = sizes[name]
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
                b = torch.randn(out_features, rank, generator=generator) * 0.02
                tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": [n for names in TARGETS.values() for n in names],
        "task_type": "CAUSAL_LM",
        "bias": "none",
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def run_peft(peft_model, requests: list[Request], names: list[str], batch_size: int) -> float:
    """transformers + PEFT: left-padded static batches, each row under its adapter; tok/s."""
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        ids, mask = left_padded(batch)
        new = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            peft_model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                adapter_names=names[first : first + batch_size],
            )
    return sum(r.max_tokens for r in requests) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--adapters", default="1,4,16", help="adapter counts to spread over")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--peer-requests", type=int, default=16)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import peft
    import transformers

    counts = [int(n) for n in args.adapters.split(",")]
    root = Path(tempfile.mkdtemp(prefix="astrai-lora-"))
    model_dir = write_random_model(root / "base")
    paths = {
        f"a{i}": str(write_adapter(root / f"a{i}", args.rank, i)) for i in range(max(*counts, 4))
    }
    model = AutoModel.from_pretrained(model_dir)
    print(f"{args.threads} threads, float32, rank {args.rank} on all 7 linears of 30 layers")

    decode = offline_workload(1, (128, 128), (128, 128))
    one = {"a0": paths["a0"]}
    base_tokens, base_seconds = run_astrai(model, decode, 1)
    lora_tokens, lora_seconds = run_astrai(model, decode, 1, one, ["a0"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    peft_model = peft.PeftModel.from_pretrained(hf, paths["a0"], adapter_name="a0").eval()
    peft_rate = run_peft(peft_model, decode, ["a0"], 1)
    base_rate, lora_rate = base_tokens / base_seconds, lora_tokens / lora_seconds
    print("batch-1 decode, tok/s")
    print(f"  astrai base {base_rate:.1f}, astrai + 1 adapter {lora_rate:.1f} "
          f"({lora_rate / base_rate:.0%} of base), transformers + PEFT {peft_rate:.1f} "
          f"(astrai {lora_rate / peft_rate:.2f}x)")  # fmt: skip

    requests = offline_workload(args.num_requests)
    base_tokens, base_seconds = run_astrai(model, requests, 64)
    base_rate = base_tokens / base_seconds
    print(f"offline, {len(requests)} requests, tok/s: astrai base {base_rate:.1f}")
    for count in counts:
        names = [f"a{i % count}" for i in range(len(requests))]
        loras = {f"a{i}": paths[f"a{i}"] for i in range(count)}
        tokens, seconds = run_astrai(model, requests, 64, loras, names)
        rate = tokens / seconds
        print(f"  {count:>2} adapters: astrai {rate:.1f} ({rate / base_rate:.0%} of base)")
    peer_requests = requests[: args.peer_requests]
    names = [f"a{i % 4}" for i in range(len(peer_requests))]
    for i in range(1, 4):
        peft_model.load_adapter(paths[f"a{i}"], adapter_name=f"a{i}")
    peer = run_peft(peft_model, peer_requests, names, 8)
    loras = {f"a{i}": paths[f"a{i}"] for i in range(4)}
    tokens, seconds = run_astrai(model, peer_requests, 64, loras, names)
    rate = tokens / seconds
    print(f"  4 adapters, first {len(peer_requests)} requests: astrai {rate:.1f}, "
          f"transformers + PEFT (batches of 8) {peer:.1f} (astrai {rate / peer:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
