"""Speculative decoding on the real SmolLM2-135M-Instruct GGUF, against llama.cpp's lookup.

Three workloads, greedy, each a chat request to the instruct model: editing code (the prompt
holds most of the answer), summarizing a given text, and open-ended chat. For each, astrai's
decode tokens/s without speculation and with n-gram speculation (prompt lookup) at batch 1
and at batch 8 (eight variants submitted at once), the acceptance rate and the mean number
of guesses kept per check, whether the output equals the output without speculation (it
must: greedy output does not change), and `llama-lookup` (llama.cpp's prompt-lookup
decoding, the same prompt text, greedy, --spec-draft-n-max K) beside the batch-1 figure.

Decode tokens/s counts the tokens that arrive after the last request's first token over the
time since: prefill left out, as llama-lookup's "decoded" line leaves it out. The
end-to-end ratio beside it counts all tokens from submit to the last one, prefill included
(the same for both runs, so it dilutes the gain). The roofline is batch-1 decode without
speculation at the machine's read bandwidth: speculation can pass it, since one weight read
then yields several tokens.

    LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin python benchmarks/speculative.py  # ~4 min
"""

from __future__ import annotations

import argparse
import queue
import re
import subprocess
import time
from pathlib import Path

import torch
from machine import read_bandwidth
from vs_llamacpp import decode_weight_bytes, llama_cpp_bin, smollm2_gguf

from astrai.inference import STOP, GenerationParams, GenerationRequest, InferenceEngine
from astrai.model import AutoModel
from astrai.tokenize import AutoTokenizer

CODE = '''def load_records(path, limit=None):
    """Read a CSV file of records and return them as dictionaries."""
    records = []
    with open(path, newline="") as handle:
        header = handle.readline().strip().split(",")
        for number, line in enumerate(handle):
            if limit is not None and number >= limit:
                break
            values = line.strip().split(",")
            record = dict(zip(header, values))
            record["line"] = number + 2
            records.append(record)
    return records


def total_by_key(records, key, field):
    """Sum the numeric field of the records, grouped by key."""
    totals = {}
    for record in records:
        group = record[key]
        amount = float(record[field])
        totals[group] = totals.get(group, 0.0) + amount
    return totals
'''

ARTICLE = (
    "The city council met on Tuesday evening to discuss the new public library, which has been "
    "under construction for two years. The building, designed by a local architect, will hold "
    "more than two hundred thousand books, a children's reading room, a small theatre and a "
    "workshop where residents can borrow tools and learn to repair furniture and bicycles. "
    "Council members praised the project but raised concerns about the budget: the cost has "
    "risen by fifteen percent since the plans were approved, mostly because of the price of "
    "steel and the delays caused by an unusually wet winter. The mayor said the library would "
    "open in the spring as planned, and that the extra cost would be covered by a grant from "
    "the regional government and by donations from local businesses. Residents who spoke at "
    "the meeting asked for longer opening hours on weekends and for a bus stop near the main "
    "entrance. The council agreed to study both requests and to report back next month."
)

WORKLOADS = {
    "code editing": [
        f"Rename the variable `records` to `rows` in this Python code and return the whole "
        f"code:\n\n{CODE}",
        f"Rename the function `load_records` to `read_rows` in this Python code and return the "
        f"whole code:\n\n{CODE}",
        f"Add type hints to this Python code and return the whole code:\n\n{CODE}",
        f"Rename the variable `totals` to `sums` in this Python code and return the whole "
        f"code:\n\n{CODE}",
    ],
    "summarization": [
        f"Summarize this article in three sentences:\n\n{ARTICLE}",
        f"What did the residents ask for? Answer from this article:\n\n{ARTICLE}",
        f"List the facts about the budget in this article:\n\n{ARTICLE}",
        f"Write a headline and a short summary of this article:\n\n{ARTICLE}",
    ],
    "open chat": [
        "Write a short story about a dragon who learns to cook.",
        "What are some good habits for staying healthy while working from home?",
        "Explain how a bicycle gear system works.",
        "Give me ideas for a birthday party for a ten-year-old.",
    ],
}


def prompts_of(workload: str, count: int) -> list[GenerationRequest]:
    texts = WORKLOADS[workload]
    return [
        GenerationRequest(messages=[{"role": "user", "content": texts[i % len(texts)]}])
        for i in range(count)
    ]


def timed(engine, prompts, max_tokens, repeats):
    """(decode tokens/s, end-to-end tokens/s, outputs): the best of repeats after a warm-up run
    of the prompts submitted at once. Decode: the tokens that arrived after the last request's
    first token over the time since (prefill left out, as llama-lookup's figure leaves it out);
    end to end: all tokens over the time from submit to the last token."""
    params = GenerationParams(max_tokens=max_tokens, temperature=0.0)
    ids = [engine.encode(prompt) for prompt in prompts]
    run_once(engine, ids, params)  # warm-up: records the steps, learns timings
    runs = [run_once(engine, ids, params) for _ in range(repeats)]
    return max(r[0] for r in runs), max(r[1] for r in runs), runs[-1][2]


def run_once(engine, ids, params):
    """timed()'s figures for one run."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    started = time.perf_counter()
    groups = engine.submit_all(
        ids, params, lambda task, delta: events.put((task.id, delta, time.perf_counter()))
    )
    outputs = {task.id: [] for group in groups for task in group}
    first, arrivals, stopped = {}, [], 0  # arrivals: (time, tokens) of each delta
    while stopped < len(outputs):
        task_id, delta, at = events.get()
        if delta is STOP:
            stopped, last = stopped + 1, at
        elif delta.token_ids:
            first.setdefault(task_id, at)
            outputs[task_id] += delta.token_ids
            arrivals.append((at, len(delta.token_ids)))
    decoding = max(first.values())  # from here on every request decodes
    decode = sum(n for at, n in arrivals if at > decoding) / (last - decoding)
    tokens = sum(len(out) for out in outputs.values())
    return decode, tokens / (last - started), list(outputs.values())


def run_lookup(bin_dir: Path, gguf: Path, text: str, max_tokens: int, draft: int, threads: int):
    """llama-lookup's (tokens/s, acceptance rate) on the prompt text, greedy."""
    run = subprocess.run(
        [str(bin_dir / "llama-lookup"), "-m", str(gguf), "-p", text, "-n", str(max_tokens)]
        + ["--spec-draft-n-max", str(draft), "--temp", "0", "-t", str(threads), "-c", "2048"]
        + ["--no-repack"],
        capture_output=True,
        text=True,
    )
    log = run.stdout + run.stderr
    speed = re.search(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s", log)
    accept = re.search(r"accept\s*=\s*([\d.]+)%", log)
    if run.returncode != 0 or speed is None:
        return None, None
    return float(speed.group(1)), float(accept.group(1)) / 100 if accept else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-tokens", type=int, default=4, help="guesses per check (K)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs, the best kept")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-llama-cpp", action="store_true")
    args = parser.parse_args()

    gguf = smollm2_gguf()
    model = AutoModel.from_pretrained(gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf)
    bandwidth = read_bandwidth()
    roofline = bandwidth / decode_weight_bytes(model)
    bin_dir = None if args.no_llama_cpp else llama_cpp_bin()
    print(
        f"SmolLM2-135M-Instruct Q4_1, {args.threads} threads, K={args.num_tokens}, "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s, decode roofline {roofline:.0f} tok/s"
    )
    rows = []
    times: dict[int, float] = {}
    for workload in WORKLOADS:
        for batch in (1, 8):
            prompts = prompts_of(workload, batch)
            # One engine at a time: a second engine's idle thread keeps an OpenMP pool of its
            # own, and two pools on the cores make every parallel region sleep at its barrier.
            with InferenceEngine(model, tokenizer, enable_prefix_cache=False) as plain:
                slow, slow_total, expected = timed(plain, prompts, args.max_tokens, args.repeats)
            with InferenceEngine(
                model,
                tokenizer,
                enable_prefix_cache=False,
                speculative="ngram",
                num_speculative_tokens=args.num_tokens,
            ) as guessing:
                fast, fast_total, outputs = timed(guessing, prompts, args.max_tokens, args.repeats)
                stats = guessing.get_stats()
                times.update(guessing.scheduler.speculator.times.seconds)
            proposed, accepted = stats.proposed_tokens, stats.accepted_tokens
            checks = stats.speculative_steps
            lookup = ""
            if bin_dir is not None and batch == 1:
                text = tokenizer.apply_chat_template(prompts[0].messages, tokenize=False)
                speed, accept = run_lookup(
                    bin_dir, gguf, text, args.max_tokens, args.num_tokens, args.threads
                )
                lookup = "crashed" if speed is None else f"{speed:.1f} ({accept:.0%} kept)"
                if speed is not None:
                    lookup += f", astrai {fast / speed:.2f}x"
            rows.append(
                f"| {workload} | {batch} | {slow:.1f} | {fast:.1f} | {fast / slow:.2f}x "
                f"| {fast_total / slow_total:.2f}x "
                f"| {accepted / max(proposed, 1):.0%} | {accepted / max(checks, 1):.2f} "
                f"| {outputs == expected} | {fast / roofline:.0%} | {lookup} |"
            )
            print(rows[-1], flush=True)
    print(
        "\n| workload | batch | astrai decode tok/s | with n-gram speculation | speed-up | "
        "end to end (prefill in) | guesses kept | kept per check | same output | of roofline "
        "| llama-lookup decode tok/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|")
    print("\n".join(rows))
    print("\nforward-pass time by rows, as the engines measured it (what the policy weighs):")
    print("  ".join(f"{rows}: {seconds * 1e3:.1f} ms" for rows, seconds in sorted(times.items())))


if __name__ == "__main__":
    main()
