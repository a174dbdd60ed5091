"""Train astrai's built-in demo model and its tokenizer from Python's own documentation.

The corpus is English prose every Python install carries: the module, class and function
docstrings of the standard library (gathered with `ast`) and the `pydoc_data.topics` pages.
About 2% of the documents, chosen by a hash of their text, are held out; their perplexity is
reported in the model card and in metrics.json.

    python scripts/train_demo_model.py --out astrai/assets/demo [--minutes 22 | --steps N]

Everything is seeded and the data order is fixed, so a fixed --steps on the same Python and
torch versions gives the same model (the corpus itself changes with the Python version).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import platform
import pydoc_data.topics
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from astrai.config import ModelConfig
from astrai.model import AutoModel, Transformer

SEED = 0
HELDOUT_PERCENT = 2
SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 4096
SEQ_LEN = 256
BATCH_SIZE = 16
PEAK_LR = 3e-3
WARMUP_STEPS = 30
CALIBRATION_STEPS = 20
AUTOCAST = False  # fp32 measured faster than bf16 autocast on CPU for this size
SAMPLE_PROMPTS = [
    "<s>Return the",
    "<s>The json module",
    "<s><|im_start|>user\nWhat does os.path.join() do?<|im_end|>\n<|im_start|>assistant\n",
]
SCORE_CHUNK_LEN = 256  # held-out perplexity: fixed-length chunks, each scored after a <s>
SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def model_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB_SIZE,
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=2,
        head_dim=32,
        dim_ffn=768,
        max_len=2048,
        tie_weight=True,
    )


def stdlib_docstrings() -> list[tuple[str, str, str]]:
    """(kind, qualified name, docstring) for every docstring in the stdlib, first seen wins."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found, seen = [], set()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        for filename in sorted(f for f in filenames if f.endswith(".py")):
            path = Path(dirpath, filename)
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue  # a few stdlib files are deliberately broken or not UTF-8
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            module = module.removesuffix(".__init__")
            for kind, name, doc in _docstrings(tree, module):
                if doc not in seen:
                    seen.add(doc)
                    found.append((kind, name, doc))
    return found


def _docstrings(node: ast.AST, name: str) -> Iterator[tuple[str, str, str]]:
    kinds = {ast.Module: "module", ast.ClassDef: "class"}
    doc = ast.get_docstring(node)
    if doc:
        yield kinds.get(type(node), "function"), name, doc
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _docstrings(child, f"{name}.{child.name}")


def is_heldout(text: str) -> bool:
    return int(hashlib.sha256(text.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def chat_example(kind: str, name: str, doc: str) -> str | None:
    """A ChatML exchange asking what a public object is, answered by its docstring's summary."""
    summary = doc.split("\n\n")[0].strip()
    if len(summary) < 20 or any(part.startswith("_") for part in name.split(".")):
        return None
    question = {
        "module": f"What is the {name} module for?",
        "class": f"What is {name}?",
        "function": f"What does {name}() do?",
    }[kind]
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{summary}<|im_end|>\n"


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": model_config().max_len,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    generation_config = {
        "bos_token_id": ids["<s>"],
        "eos_token_id": [ids["</s>"], ids["<|im_end|>"]],
    }
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")


def token_stream(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    """All training documents as one stream: <s> document </s> <s> document </s> ..."""
    eos = tokenizer.token_to_id("</s>")
    ids = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def init_weights(model: Transformer) -> None:
    """GPT-2 style init: N(0, 0.02), residual output projections scaled by depth.

    PyTorch's default N(0, 1) embedding would make the tied lm_head's first logits huge.
    """
    residual_std = 0.02 / math.sqrt(2 * model.config.n_layers)
    for name, param in model.named_parameters():
        if param.dim() < 2:
            continue  # RMSNorm weights stay at 1
        is_residual = name.endswith(("wo.weight", "w2.weight"))
        torch.nn.init.normal_(param, std=residual_std if is_residual else 0.02)


def learning_rate(step: int, steps: int | None) -> float:
    """Linear warmup to PEAK_LR, then cosine decay over the rest of steps to a tenth of it."""
    if step < WARMUP_STEPS or steps is None:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
    return PEAK_LR * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(
    model: Transformer, stream: torch.Tensor, steps: int | None, minutes: float
) -> tuple[int, float, float]:
    """Train on seeded random windows of the stream; returns steps, wall seconds, last loss.

    With steps None, the speed of the first CALIBRATION_STEPS (still inside warmup, where the
    schedule does not depend on the total) fixes the total to fit the time budget; passing
    that total as steps reproduces the run exactly.
    """
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=PEAK_LR,
        betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(SEED)
    offsets = torch.arange(SEQ_LEN + 1)
    model.train()
    start = time.perf_counter()
    step = 0
    while steps is None or step < steps:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps)
        starts = torch.randint(0, len(stream) - SEQ_LEN - 1, (BATCH_SIZE, 1), generator=generator)
        window = stream[starts + offsets]  # [BATCH_SIZE, SEQ_LEN + 1]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=AUTOCAST):
            logits = model.forward_dense(window[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        elapsed = time.perf_counter() - start
        if step % 25 == 0 or step + 1 == steps:
            print(f"step {step:5d}  loss {loss.item():.3f}  {elapsed:7.0f}s", flush=True)
        step += 1
        if steps is None and step == CALIBRATION_STEPS:
            steps = max(WARMUP_STEPS + 1, round(minutes * 60 * step / elapsed))
            print(f"{elapsed / step:.2f} s/step: training for {steps} steps", flush=True)
    model.eval()
    return steps, time.perf_counter() - start, loss.item()


@torch.no_grad()
def heldout_perplexity(model: Transformer, tokenizer: Tokenizer, text: str) -> tuple[float, int]:
    """exp(mean NLL) over fixed-length chunks of the held-out text, each after a <s>.

    tests/test_demo_model.py repeats this procedure; keep the two the same.
    """
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    n_chunks = len(ids) // SCORE_CHUNK_LEN
    chunks = torch.tensor(ids[: n_chunks * SCORE_CHUNK_LEN]).view(n_chunks, SCORE_CHUNK_LEN)
    bos = torch.full((n_chunks, 1), tokenizer.token_to_id("<s>"))
    logprobs = model.token_logprobs(torch.cat([bos, chunks], dim=1))  # [n_chunks, CHUNK_LEN]
    return math.exp(-logprobs.double().mean().item()), chunks.numel()


@torch.no_grad()
def greedy_continuation(model: Transformer, tokenizer: Tokenizer, prompt: str, n: int) -> str:
    """Prompt and greedy continuation on the dense path, up to a stop token, for the card."""
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    stop = {tokenizer.token_to_id("</s>"), tokenizer.token_to_id("<|im_end|>")}
    for _ in range(n):
        ids.append(int(model.forward_dense(torch.tensor([ids]))[0, -1].argmax()))
        if ids[-1] in stop:
            break
    return tokenizer.decode(ids, skip_special_tokens=False)


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def write_model_card(out: Path, facts: dict) -> None:
    samples = "\n\n".join(f"```\n{text}\n```" for text in facts["samples"])
    card = f"""# astrai demo model

A tiny Llama-architecture language model and byte-level BPE tokenizer that ship inside the
astrai package, so `astrai generate` and `astrai serve` work on a fresh machine with no
download. It is a demo: it has read about {facts["train_bytes"] / 1e6:.1f} MB of Python's
documentation and writes text that is only roughly English, in the style of a docstring.
Do not use it for anything but trying astrai out.

## Corpus

English prose of the Python {facts["python"]} standard library, which every Python install
carries: the module, class and function docstrings of the `.py` files under
`sysconfig.get_paths()["stdlib"]` (gathered with `ast`, test directories and site-packages
skipped, duplicates removed) and the {facts["topics"]} pages of `pydoc_data.topics`.
{facts["documents"]} documents in all; {facts["heldout_documents"]} of them
({HELDOUT_PERCENT}%, chosen by a SHA-256 hash of their text) are held out in `heldout.txt`,
separated by blank lines.
The training stream also holds {facts["chat_examples"]} ChatML exchanges made from the
training docstrings ("What does json.dumps() do?" answered by the docstring's summary), so
that the model learns the chat template and to end a reply with `<|im_end|>`.

## Model

| | |
|---|---|
| architecture | Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU, tied embeddings) |
| parameters | {facts["params"]:,} |
| config | dim {facts["config"]["dim"]}, {facts["config"]["n_layers"]} layers, \
{facts["config"]["n_heads"]} query / {facts["config"]["n_kv_heads"]} KV heads of \
{facts["config"]["head_dim"]}, FFN {facts["config"]["dim_ffn"]} |
| vocabulary | {facts["config"]["vocab_size"]} byte-level BPE tokens; `<s>`, `</s>`, \
`<|im_start|>`, `<|im_end|>` |
| weights | bf16 safetensors, {facts["weight_bytes"]:,} bytes |
| context | trained on {SEQ_LEN}-token windows; `max_len` {facts["config"]["max_len"]} |

## Training

- {facts["train_steps"]} AdamW steps of {BATCH_SIZE} x {SEQ_LEN} tokens: \
{facts["train_tokens"]:,} tokens, {facts["epochs"]:.1f} passes over the \
{facts["stream_tokens"]:,}-token training stream
- peak learning rate {PEAK_LR}, {WARMUP_STEPS} warmup steps, cosine decay to a tenth; \
weight decay 0.1; gradient clipping at 1.0; {facts["precision"]}; seed {SEED}
- {facts["minutes"]:.1f} minutes wall time on {facts["hardware"]}, {facts["threads"]} torch \
thread(s), torch {facts["torch"]}
- final training loss {facts["final_loss"]:.3f}; the stream includes the easy, templated chat \
exchanges, so it sits well below the held-out loss

## Held-out perplexity

**{facts["heldout_perplexity"]:.2f}** over the first {facts["heldout_tokens"]:,} tokens of
`heldout.txt`, with the bf16 weights as shipped: the text is tokenized once, cut into chunks of
{SCORE_CHUNK_LEN} tokens, each chunk is scored after a `<s>` with
`Transformer.token_logprobs`, and the perplexity is exp of the mean negative log-likelihood
over all scored tokens. The same figure is in `metrics.json`; `tests/test_demo_model.py`
recomputes it.

## Samples

Greedy decoding of the shipped bf16 weights (dense path, at most 40 new tokens, special
tokens shown):

{samples}

## Reproduce

From a checkout, with astrai installed (`pip install -e .`):

```
{facts["command"]}
```

{facts["budget_note"]}`--steps` fixes the schedule, so the command repeats the run: the same
Python, torch and tokenizers versions give the same corpus, tokenizer, data order and
schedule. A different Python version has different docstrings and so a different model.
"""
    (out / "README.md").write_text(card)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("astrai/assets/demo"))
    parser.add_argument(
        "--minutes", type=float, default=22.0, help="training time budget (default %(default)s)"
    )
    parser.add_argument(
        "--steps", type=int, help="a fixed number of optimizer steps instead of a time budget"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="torch threads; on cores shared with other work, 1 is faster (default %(default)s)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    args.out.mkdir(parents=True, exist_ok=True)

    documents = stdlib_docstrings()
    topics = [text for _, text in sorted(pydoc_data.topics.topics.items())]
    texts = list(dict.fromkeys([doc for _, _, doc in documents] + topics))
    train_texts = [text for text in texts if not is_heldout(text)]
    heldout_text = "\n\n".join(text for text in texts if is_heldout(text)) + "\n"
    chats = [chat_example(kind, name, doc) for kind, name, doc in documents if not is_heldout(doc)]
    chats = [chat for chat in chats if chat]
    (args.out / "heldout.txt").write_text(heldout_text)

    tokenizer = train_tokenizer(train_texts + chats)
    save_tokenizer(tokenizer, args.out)
    order = torch.randperm(len(train_texts) + len(chats)).tolist()
    stream = token_stream(tokenizer, [(train_texts + chats)[i] for i in order])
    print(f"{len(texts)} documents, {len(chats)} chat examples, {len(stream)} tokens", flush=True)

    model = Transformer(model_config())
    init_weights(model)
    steps, seconds, final_loss = train(model, stream, args.steps, args.minutes)
    model.to(torch.bfloat16).save_pretrained(args.out)

    shipped = AutoModel.from_pretrained(args.out, dtype=torch.bfloat16)
    perplexity, heldout_tokens = heldout_perplexity(shipped, tokenizer, heldout_text)
    print(f"held-out perplexity {perplexity:.3f} over {heldout_tokens} tokens", flush=True)
    metrics = {
        "heldout_perplexity": round(perplexity, 4),
        "heldout_tokens": heldout_tokens,
        "score_chunk_len": SCORE_CHUNK_LEN,
        "dtype": "bfloat16",
        "train_steps": steps,
        "train_tokens": steps * BATCH_SIZE * SEQ_LEN,
        "train_seconds": round(seconds, 1),
    }
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")

    samples = [greedy_continuation(shipped, tokenizer, prompt, 40) for prompt in SAMPLE_PROMPTS]
    config = model_config()
    budget_note = ""
    if args.steps is None:
        budget_note = (
            f"The run had a {args.minutes:g}-minute budget (`--minutes`) instead of `--steps`;\n"
            "the speed of its first steps set the step count. "
        )
    write_model_card(
        args.out,
        {
            **metrics,
            "python": platform.python_version(),
            "topics": len(topics),
            "documents": len(texts),
            "heldout_documents": sum(is_heldout(text) for text in texts),
            "chat_examples": len(chats),
            "train_bytes": sum(len(text.encode()) for text in train_texts),
            "params": sum(p.numel() for p in shipped.parameters()),
            "config": {k: getattr(config, k) for k in config.__dataclass_fields__},
            "weight_bytes": (args.out / "model.safetensors").stat().st_size,
            "stream_tokens": len(stream),
            "epochs": metrics["train_tokens"] / len(stream),
            "precision": "bf16 autocast" if AUTOCAST else "fp32",
            "minutes": seconds / 60,
            "hardware": f"{os.cpu_count()} cores of an {cpu_name()}",
            "threads": args.threads,
            "budget_note": budget_note,
            "torch": torch.__version__,
            "final_loss": final_loss,
            "samples": samples,
            "command": "python scripts/train_demo_model.py "
            f"--out {args.out} --steps {steps} --threads {args.threads}",
        },
    )
    print(f"wrote {args.out} in {seconds / 60:.1f} minutes of training", flush=True)


if __name__ == "__main__":
    main()
