"""Structured output and the sampling fields the APIs need, through the engine end to end.

On a random-weight model the mask alone must make every output valid: nothing in the model
knows JSON. The schemas bound their strings, numbers and keys, since such a model has no
reason to ever close an open string or stop adding digits. Constrained and free requests
share batches, chunked prefill, preemption and reruns without changing anyone's tokens.
"""

from __future__ import annotations

import json
import queue
import random
import re
from dataclasses import replace

import jsonschema
import pytest
import torch
from tiny_models import make_engine

from astrai.inference import STOP, GenerationParams
from astrai.inference import executor as executor_module
from astrai.inference.constraints import (
    BatchMasker,
    Constraint,
    ConstraintCompiler,
    ConstraintError,
)
from astrai.inference.sample import SamplingBatch, SamplingPipeline, sample
from astrai.inference.task import InvalidParamsError

SCHEMAS = [
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": -999, "maximum": 999},
        "minItems": 2,
        "maxItems": 5,
    },
    {"type": "string", "enum": ["red", "green", "blue"]},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "shade": {"enum": [1, 2, 3]}},
        "required": ["color", "shade"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 10000},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 20}},
                        "required": ["city"],
                        "additionalProperties": False,
                    },
                },
                "required": ["id", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "pages": {"type": "integer", "minimum": 1, "maximum": 2000},
            "isbn": {"type": "string", "pattern": "^[0-9]{13}$"},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 1},
            "count": {"type": "integer", "minimum": 10, "maximum": 99},
            "delta": {
                "type": "number",
                "multipleOf": 0.25,
                "exclusiveMinimum": -5,
                "exclusiveMaximum": 5,
            },
        },
        "required": ["ratio", "count", "delta"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    {"type": "string", "pattern": "^[a-z]{2,6}@[a-z]{2,6}\\.(com|org)$"},
    {"type": "string", "minLength": 3, "maxLength": 8},
    {
        "type": "array",
        "maxItems": 3,
        "items": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "maxLength": 8},
                "qty": {"type": "integer", "minimum": 1, "maximum": 99},
            },
            "required": ["sku", "qty"],
            "additionalProperties": False,
        },
    },
    {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "number", "multipleOf": 0.25, "minimum": -10, "maximum": 10},
                    "y": {"type": "number", "multipleOf": 0.25, "minimum": -10, "maximum": 10},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "version": {"const": 2},
            "enabled": {"type": "boolean"},
            "note": {"type": ["string", "null"], "maxLength": 10},
        },
        "required": ["version", "enabled", "note"],
        "additionalProperties": False,
    },
    {
        "oneOf": [
            {
                "type": "object",
                "properties": {
                    "kind": {"const": "circle"},
                    "r": {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 9},
                },
                "required": ["kind", "r"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {
                    "kind": {"const": "square"},
                    "side": {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 9},
                },
                "required": ["kind", "side"],
                "additionalProperties": False,
            },
        ]
    },
    {"type": "array", "items": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}, "maxItems": 4},
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 10},
    {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "enum": ["a", "b", "c"]},
                "maxItems": 3,
            },
            "score": {"type": "number", "multipleOf": 0.25, "minimum": -1, "maximum": 1},
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "patternProperties": {"^[a-z]{1,4}$": {"type": "integer", "minimum": 0, "maximum": 9}},
        "additionalProperties": False,
        "maxProperties": 3,
    },
    {
        "type": "array",
        "prefixItems": [
            {"type": "string", "maxLength": 5},
            {"type": "integer", "minimum": 0, "maximum": 100},
        ],
        "items": False,
        "minItems": 2,
    },
    {
        "type": "object",
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {
                "type": "object",
                "required": ["location", "unit"],
                "additionalProperties": False,
                "properties": {
                    "location": {"type": "string", "maxLength": 16},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                },
            },
        },
    },
    {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": 2,
                    "maxItems": 2,
                },
            }
        },
        "required": ["matrix"],
        "additionalProperties": False,
    },
]


def generated_schema(seed: int, depth: int = 0) -> dict:
    """A random object schema whose every value is bounded (the random-weight model never
    closes an open string or stops a number on its own): ints, enums, booleans, numbers,
    short strings, small arrays and nested objects, some properties optional."""
    rng = random.Random(seed)
    leaves = [
        {"type": "integer", "minimum": -50, "maximum": 50},
        {"type": "string", "enum": ["on", "off", "auto"]},
        {"type": "boolean"},
        {"type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": 8},
        {"type": "string", "maxLength": 6},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
        {"type": ["integer", "null"], "minimum": 0, "maximum": 5},
    ]
    names = rng.sample(["id", "kind", "size", "label", "flag", "rate", "items", "mode"], 4)
    properties = {}
    for name in names[: rng.randint(1, 4)]:
        nest = depth == 0 and rng.random() < 0.25
        properties[name] = generated_schema(seed * 31 + 7, 1) if nest else rng.choice(leaves)
    required = [name for name in properties if rng.random() < 0.7]
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


# 23 written by hand above, 27 generated: 50 in all
SCHEMAS += [generated_schema(seed) for seed in range(27)]
PROMPTS = ["Hello", "The quick brown fox", "你好世界", "def add(a, b):", "Numbers 0 1 2"]
REGEXES = [r"\d{3}-\d{4}", r"(yes|no|maybe)", r"[A-Z][a-z]{2,5}( [A-Z][a-z]{2,5})?", r"[ab]{5}"]


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    with make_engine(model, tokenizer) as engine:
        yield engine


def kv_bytes(model):
    c = model.config
    return c.n_layers * 2 * c.n_kv_heads * c.head_dim * 4


def run_together(engine, prompts, params):
    """Submit each (prompt ids, params) right after the last, so they share steps; one result
    per task."""
    events = queue.SimpleQueue()
    tasks = [
        task
        for ids, p in zip(prompts, params, strict=True)
        for task in engine.submit(ids, p, lambda task, event: events.put(event))
    ]
    remaining = len(tasks)
    while remaining:
        remaining -= events.get(timeout=120) is STOP
    return [task.result() for task in tasks]


def schema_params(schema, **settings):
    settings.setdefault("temperature", 0.0)
    return GenerationParams(max_tokens=200, constraint=Constraint.json_schema(schema), **settings)


def assert_valid(result, schema):
    assert result.finish_reason == "stop", result.text
    jsonschema.validate(json.loads(result.text), schema)


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schema_output_validates_streamed_or_not(engine, index):
    schema = SCHEMAS[index]
    prompt = PROMPTS[index % len(PROMPTS)]
    result = engine.generate_results(prompt, schema_params(schema))
    assert_valid(result, schema)
    assert "".join(engine.generate(prompt, schema_params(schema), stream=True)) == result.text
    sampled = engine.generate_results(prompt, schema_params(schema, temperature=1.0, seed=index))
    assert_valid(sampled, schema)


def test_json_object_regex_and_choice(engine):
    result = engine.generate_results(
        "Hello", max_tokens=100, temperature=0, constraint=Constraint.json_object()
    )
    assert result.finish_reason == "stop"
    assert isinstance(json.loads(result.text), dict)
    for i, pattern in enumerate(REGEXES):
        result = engine.generate_results(
            PROMPTS[i], max_tokens=50, seed=i, constraint=Constraint.regex(pattern)
        )
        assert re.fullmatch(pattern, result.text), (pattern, result.text)
    options = ["alpha", "beta", "gamma delta"]
    texts = engine.generate(
        PROMPTS, max_tokens=20, seed=5, constraint=Constraint.choice(options), n=3
    )
    assert {text for group in texts for text in group} <= set(options)


def test_a_complete_output_ends_the_request_without_eos(engine, tokenizer):
    """Once the grammar is complete the request ends, reason "stop", with no EOS sampled:
    even with ignore_eos, which would otherwise run it to max_tokens."""
    for ignore_eos in (False, True):
        result = engine.generate_results(
            "Hello",
            max_tokens=50,
            temperature=0,
            ignore_eos=ignore_eos,
            constraint=Constraint.choice(["alpha", "beta"]),
        )
        assert (result.text, result.finish_reason) in (("alpha", "stop"), ("beta", "stop"))
        assert not set(result.token_ids) & tokenizer.stop_token_ids


def test_n_samples_each_follow_the_constraint(engine):
    schema = SCHEMAS[1]
    samples = engine.generate_results("Hello", schema_params(schema, temperature=1.0, seed=3, n=4))
    for result in samples:
        assert_valid(result, schema)
    assert len({r.text for r in samples}) > 1  # each sample walks its own state
    greedy = engine.generate_results("Hello", schema_params(schema, n=3))
    assert [r.token_ids for r in greedy] == [
        engine.generate_results("Hello", schema_params(schema)).token_ids
    ] * 3


def mixed_requests(tokenizer):
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 400) for _ in range(rng.randint(1, 60))] for _ in range(10)]
    free = GenerationParams(max_tokens=24, temperature=0.0)
    params = [schema_params(SCHEMAS[i]) if i % 2 else free for i in range(len(prompts))]
    return prompts, params


def test_a_mixed_batch_keeps_every_greedy_output(model, tokenizer):
    prompts, params = mixed_requests(tokenizer)
    with make_engine(model, tokenizer) as engine:
        alone = [run_together(engine, [p], [q])[0] for p, q in zip(prompts, params, strict=True)]
        together = run_together(engine, prompts, params)
    # chunked prefill: prompt chunks beside constrained decodes, masks on sampling rows only
    with make_engine(model, tokenizer, max_num_batched_tokens=16) as engine:
        chunked = run_together(engine, prompts, params)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [r.token_ids for r in chunked] == [r.token_ids for r in alone]
    for result, p in zip(together, params, strict=True):
        if p.constraint is not None:
            assert_valid(result, json.loads(p.constraint.spec))
    # the free requests really are unconstrained: their text is not JSON
    assert not any(
        r.text.startswith(("{", "["))
        for r, p in zip(together, params, strict=True)
        if p.constraint is None
    )


def test_rerun_steps_advance_each_constraint_once(model, tokenizer, monkeypatch):
    """Every batched step fails after its tokens are drawn, so the scheduler reruns each
    request alone: a state moved by the failed step would be one token ahead."""
    prompts, params = mixed_requests(tokenizer)
    with make_engine(model, tokenizer) as engine:
        expected = run_together(engine, prompts, params)

        def fail_batched(logits, batch, pipeline=None):
            drawn = sample(logits, batch, pipeline)
            if len(drawn.token_ids) > 1:
                raise RuntimeError("batched step failed")
            return drawn

        monkeypatch.setattr(executor_module, "sample", fail_batched)
        results = run_together(engine, prompts, params)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert all(r.finish_reason in ("stop", "length") for r in results)


def test_preemption_recomputes_and_keeps_constrained_outputs(model, tokenizer):
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 400) for _ in range(60)] for _ in range(4)]
    pattern = r"[a-z]{100}"
    params = [
        GenerationParams(
            max_tokens=100, temperature=0.8 * (i % 2), seed=i, constraint=Constraint.regex(pattern)
        )
        for i in range(4)
    ]
    with make_engine(model, tokenizer) as engine:
        expected = run_together(engine, prompts, params)
    # 16 pages of 16 tokens hold the four prompts, not their outputs as well
    with make_engine(model, tokenizer, kv_cache_memory=16 * 16 * kv_bytes(model)) as engine:
        results = run_together(engine, prompts, params)
        stats = engine.get_stats()
    assert stats.preemptions > 0
    assert stats.pages_owned == 0
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    for result in results:
        assert result.finish_reason == "stop"
        assert re.fullmatch(pattern, result.text)


def test_a_bad_constraint_is_refused_before_anything_runs(model, tokenizer):
    with make_engine(model, tokenizer) as engine:
        before = engine.get_stats()
        bad = Constraint.json_schema({"type": "object", "properties": {"a": {"type": "nope"}}})
        with pytest.raises(ConstraintError, match="json_schema"):
            engine.generate(["Hello", "Hi"], max_tokens=10, constraint=bad)
        with pytest.raises(ConstraintError, match="regex"):
            engine.generate("Hello", max_tokens=10, constraint=Constraint.regex("(unclosed"))
        after = engine.get_stats()
        assert (after.waiting, after.running, after.prompt_tokens) == (0, 0, before.prompt_tokens)
        result = engine.generate_results(
            "Hello", max_tokens=20, temperature=0, constraint=Constraint.choice(["yes", "no"])
        )
        assert result.text in ("yes", "no")
    with pytest.raises(InvalidParamsError, match="Constraint"):
        GenerationParams(constraint={"type": "object"})


def token_of(tokenizer, text):
    [token] = tokenizer.encode(text, add_special_tokens=False)
    return token


def test_logit_bias_forces_and_bans_tokens(engine, tokenizer):
    greedy = GenerationParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    free = engine.generate_results("Hello", greedy).token_ids
    forced = token_of(tokenizer, " fox")
    biased = engine.generate_results("Hello", greedy, logit_bias={forced: 100}).token_ids
    assert biased == [forced] * 8
    banned = engine.generate_results("Hello", greedy, logit_bias={free[0]: -100}).token_ids
    assert free[0] not in banned
    # a bias beyond the range is clamped, a small one moves nothing
    assert GenerationParams(logit_bias={forced: 1e9}).logit_bias == {forced: 100.0}
    assert engine.generate_results("Hello", greedy, logit_bias={forced: 1e-9}).token_ids == free
    # a batch where one row is biased leaves the others' tokens alone
    prompts = [tokenizer.encode("Hello")] * 2
    mixed = run_together(engine, prompts, [greedy, replace(greedy, logit_bias={forced: 100})])
    assert [r.token_ids for r in mixed] == [free, [forced] * 8]


def test_logit_bias_is_validated(engine, model):
    vocab = model.config.vocab_size
    with pytest.raises(InvalidParamsError, match="outside the model's vocabulary"):
        engine.generate("Hello", max_tokens=2, logit_bias={vocab: 5})
    for bad in ({-1: 1.0}, {"3": 1.0}, {3: float("nan")}, {3: "x"}, [(3, 1.0)]):
        with pytest.raises(InvalidParamsError, match="logit_bias"):
            GenerationParams(logit_bias=bad)
    assert engine.get_stats().waiting == 0


def test_allowed_token_ids_limit_what_is_sampled(engine, tokenizer, model):
    allowed = tuple(tokenizer.encode(" quick brown lazy dog", add_special_tokens=False))
    for seed in range(3):
        result = engine.generate_results(
            "Hello", max_tokens=12, seed=seed, ignore_eos=True, allowed_token_ids=allowed
        )
        assert set(result.token_ids) <= set(allowed)
        assert len(set(result.token_ids)) > 1
    greedy = engine.generate_results(
        "Hello", max_tokens=6, temperature=0, ignore_eos=True, allowed_token_ids=allowed[:1]
    )
    assert greedy.token_ids == [allowed[0]] * 6
    with pytest.raises(InvalidParamsError, match="allowed_token_ids"):
        engine.generate("Hello", max_tokens=2, allowed_token_ids=(model.config.vocab_size,))
    with pytest.raises(InvalidParamsError, match="allowed_token_ids"):
        GenerationParams(allowed_token_ids=(-1,))


def test_min_tokens_holds_back_eos_stop_tokens_and_stop_strings(engine, tokenizer):
    eos = min(tokenizer.stop_token_ids)
    eager = GenerationParams(max_tokens=20, temperature=0.0, logit_bias={eos: 100})
    assert engine.generate_results("Hello", eager).token_ids == [eos]
    held = engine.generate_results("Hello", eager, min_tokens=5)
    assert held.token_ids[5:] == [eos] and eos not in held.token_ids[:5]
    assert held.finish_reason == "stop"
    # a stop token id is held back the same way
    fox = token_of(tokenizer, " fox")
    stop_id = GenerationParams(
        max_tokens=20, temperature=0.0, logit_bias={fox: 100}, stop_token_ids=(fox,)
    )
    assert engine.generate_results("Hello", stop_id).token_ids == [fox]
    assert len(engine.generate_results("Hello", stop_id, min_tokens=3).token_ids) == 4
    # a stop string found before min_tokens is passed over
    text = engine.generate("Hello", max_tokens=12, temperature=0.0, ignore_eos=True)
    stop = text[:2]
    assert (
        engine.generate("Hello", max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]) == ""
    )
    late = engine.generate(
        "Hello", max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop], min_tokens=6
    )
    assert late.startswith(stop) and len(late) > len(stop)
    with pytest.raises(InvalidParamsError, match="min_tokens"):
        GenerationParams(max_tokens=4, min_tokens=5)
    with pytest.raises(InvalidParamsError, match="min_tokens"):
        GenerationParams(min_tokens=-1)


def test_rows_without_the_fields_keep_their_logits_bit_for_bit(tokenizer, model):
    """In one batch, rows with a bias, allowed tokens, min_tokens or a grammar mask change
    where they should and the plain rows between them come back as they went in."""
    vocab = model.config.vocab_size
    state = ConstraintCompiler(tokenizer, vocab).compile(Constraint.regex("[0-9]+")).new_state()
    plain = GenerationParams(temperature=0.0)
    params = [
        plain,
        GenerationParams(temperature=0.0, logit_bias={7: 100.0, 9: -100.0}),
        plain,
        GenerationParams(temperature=0.0, allowed_token_ids=(7, 8)),
        GenerationParams(temperature=0.0, min_tokens=2, stop_token_ids=(5,)),
        plain,
        plain,  # its grammar mask
    ]
    rows = len(params)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    mask = BatchMasker(rows, vocab).fill([None] * (rows - 1) + [state])
    batch = SamplingBatch.build(
        params,
        [[]] * rows,
        [[]] * rows,
        "cpu",
        stop_token_ids=[{1, 3, 5}] * rows,
        mask=mask,
    )
    processed = SamplingPipeline()(logits, batch)
    for row in (0, 2, 5):
        assert torch.equal(processed[row], logits[row])
    assert processed[1, 7] == logits[1, 7] + 100 and processed[1, 9] == logits[1, 9] - 100
    assert torch.isfinite(processed[3]).nonzero()[:, 0].tolist() == [7, 8]
    assert torch.isinf(processed[4]).nonzero()[:, 0].tolist() == [1, 3, 5]
    digits = {tokenizer.encode(d, add_special_tokens=False)[0] for d in "0123456789"}
    assert set(torch.isfinite(processed[6]).nonzero()[:, 0].tolist()) >= digits
    assert torch.isinf(processed[6]).sum() > vocab // 2
    assert not torch.equal(processed, logits)  # nor are the inputs changed in place
    assert torch.equal(logits, torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)))
