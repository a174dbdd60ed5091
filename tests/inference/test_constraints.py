"""Constrained decoding: whatever token a sampler picks among the allowed ones, the output
matches the constraint; states rewind, rebuild and fork exactly; bad specs fail clearly.

Walks draw from random logits through the real masks (batched, with free rows in the batch),
on the test tokenizer (its model's vocab is wider than the tokenizer's) and on SmolLM2's.
The random logits favour tokens with closing characters, so outputs stay short; which tokens
are allowed is the mask's alone, and every draw is one of them.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import torch
from tiny_models import TINY, real_gguf

from astrai.inference.constraints import (
    BatchMasker,
    Constraint,
    ConstraintCompiler,
    ConstraintError,
    unpack_bitmask,
)
from astrai.inference.sample import (
    MinPStrategy,
    PenaltyStrategy,
    SamplingBatch,
    SamplingPipeline,
    TemperatureStrategy,
    TopKStrategy,
    TopPStrategy,
    sample,
)
from astrai.inference.task import GenerationParams
from astrai.tokenize import AutoTokenizer

POINT = {
    "type": "object",
    "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
    "required": ["x", "y"],
    "additionalProperties": False,
}
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}},
                        "required": ["city"],
                    },
                },
                "required": ["id", "address"],
            }
        },
        "required": ["user"],
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "pages": {"type": "integer"},
            "isbn": {"type": "string"},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "count": {"type": "integer", "minimum": 10, "maximum": 99},
            "delta": {"type": "number", "exclusiveMinimum": -5, "exclusiveMaximum": 5},
        },
        "required": ["ratio", "count", "delta"],
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-\\d{4}$"}},
        "required": ["code"],
    },
    {"type": "string", "minLength": 3, "maxLength": 8},
    {
        "$defs": {"point": POINT},
        "type": "object",
        "required": ["start", "end"],
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
    },
    {
        "$defs": {
            "node": {
                "type": "object",
                "required": ["value", "children"],
                "properties": {
                    "value": {"type": "integer"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
            }
        },
        "$ref": "#/$defs/node",
    },
    {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]}},
    {
        "oneOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                "required": ["kind", "r"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"kind": {"const": "square"}, "side": {"type": "number"}},
                "required": ["kind", "side"],
                "additionalProperties": False,
            },
        ]
    },
    {
        "type": "object",
        "properties": {
            "version": {"const": 2},
            "enabled": {"type": "boolean"},
            "note": {"type": ["string", "null"]},
        },
        "required": ["version", "enabled", "note"],
    },
    {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"],
            "additionalProperties": False,
        },
    },
    {
        "type": "object",
        "properties": {
            "when": {"type": "string", "format": "date"},
            "id": {"type": "string", "format": "uuid"},
        },
        "required": ["when", "id"],
    },
    {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3},
    {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]},
        ]
    },
    {
        "type": "array",
        "maxItems": 3,
        "items": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2},
    },
    {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
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
                    "location": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                },
            },
        },
    },
]
REGEXES = [
    r"\d{3}-\d{4}",
    r"(yes|no|maybe)",
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
    r"[A-Z][a-z]{2,5}( [A-Z][a-z]{2,5})?",
    r"-?(0|[1-9]\d{0,3})(\.\d{1,2})?",
]
CHOICES = ["Paris", "New York", "東京", 'say "hi"', "a", "ab"]
LARK = 'start: term (("+" | "-") term)*\nterm: /[0-9]{1,3}/'
GBNF = 'root ::= "(" [a-c]+ ")"'
MAX_STEPS = 300


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """A few [rows, vocab] tensors a step: on a shared CPU intra-op threads only add waits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tokenizer_dir):
    """The test tokenizer (400 tokens) with the tiny models' wider vocab (512)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert tokenizer.vocab_size < TINY["vocab_size"]
    return tokenizer, ConstraintCompiler(tokenizer, TINY["vocab_size"])


@pytest.fixture(scope="module")
def smollm2():
    tokenizer = AutoTokenizer.from_pretrained(real_gguf())
    return tokenizer, ConstraintCompiler(tokenizer)


@pytest.fixture(params=["tiny", "smollm2"])
def vocabulary(request):
    """Each walk test runs on the test tokenizer and on SmolLM2's."""
    return request.getfixturevalue(request.param)


def shaped_logits(tokenizer, vocab_size: int) -> torch.Tensor:
    """A bias for the random logits: closing characters and stop tokens up, pure whitespace
    down, so a walk ends in tens of tokens rather than thousands."""
    bias = torch.zeros(vocab_size)
    for i in range(tokenizer.vocab_size):
        text = tokenizer.token_bytes(i)
        if i in tokenizer.stop_token_ids or any(c in text for c in b'"}])'):
            bias[i] = 8.0
        elif text and not text.strip():
            bias[i] = -8.0
    return bias


def walk(tokenizer, compiler, constraints, seed=0):
    """Sample every constraint in one batch with a free row between each, from random logits
    masked as the sampler masks them, until each ends; returns (texts, token lists)."""
    vocab = compiler.vocab_size
    bias = shaped_logits(tokenizer, vocab)
    states = {i: compiler.compile(c).new_state() for i, c in enumerate(constraints)}
    tokens = {i: [] for i in states}
    ended = set()  # rows that drew EOS
    masker = BatchMasker(2 * len(constraints), vocab)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(MAX_STEPS):
        live = [i for i, state in states.items() if i not in ended and not state.is_finished()]
        if not live:
            break
        batch = [row for i in live for row in (states[i], None)]  # free rows interleaved
        logits = torch.randn(len(batch), vocab, generator=generator) + bias
        raw = logits.clone()
        mask = masker.fill(batch)
        mask.apply(logits)
        assert torch.equal(logits[1::2], raw[1::2]), "a free row's logits changed"
        allowed = unpack_bitmask(mask.bitmask, vocab)
        assert not allowed[:, tokenizer.vocab_size :].any(), "a token past the tokenizer allowed"
        drawn = torch.multinomial(logits[0::2].softmax(-1), 1, generator=generator)[:, 0]
        for i, token in zip(live, drawn.tolist(), strict=True):
            if token in tokenizer.stop_token_ids:
                assert states[i].accepts_end(), "EOS allowed before the output is complete"
                ended.add(i)
                continue
            states[i].advance(token)  # raises on a token the constraint does not allow
            tokens[i].append(token)
    assert all(i in ended or s.is_finished() for i, s in states.items()), "walk past MAX_STEPS"
    return [tokenizer.decode(tokens[i]) for i in states], [tokens[i] for i in states]


def test_json_schema_walks_validate(vocabulary):
    tokenizer, compiler = vocabulary
    texts, _ = walk(tokenizer, compiler, [Constraint.json_schema(s) for s in SCHEMAS])
    for schema, text in zip(SCHEMAS, texts, strict=True):
        jsonschema.validate(
            json.loads(text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
        )


def test_json_object_walks_give_objects(vocabulary):
    tokenizer, compiler = vocabulary
    texts, _ = walk(tokenizer, compiler, [Constraint.json_object()] * 4, seed=1)
    assert all(isinstance(json.loads(text), dict) for text in texts)


def test_regex_choice_and_grammar_walks_match(vocabulary):
    tokenizer, compiler = vocabulary
    constraints = [Constraint.regex(p) for p in REGEXES]
    constraints += [Constraint.choice(CHOICES)] * 6
    constraints += [Constraint.grammar(LARK), Constraint.grammar(GBNF)]
    texts, _ = walk(tokenizer, compiler, constraints, seed=2)
    for pattern, text in zip(REGEXES, texts, strict=False):
        assert re.fullmatch(pattern, text), (pattern, text)
    assert all(text in CHOICES for text in texts[len(REGEXES) : -2])
    assert re.fullmatch(r"\d{1,3}([+-]\d{1,3})*", texts[-2])
    assert re.fullmatch(r"\([a-c]+\)", texts[-1])


def test_only_end_allowed_once_complete(tiny):
    tokenizer, compiler = tiny
    state = compiler.compile(Constraint.choice(["a", "ab"])).new_state()
    masker = BatchMasker(1, compiler.vocab_size)
    for token in tokenizer.encode("a", add_special_tokens=False):
        state.advance(token)
    allowed = unpack_bitmask(masker.fill([state]).bitmask, compiler.vocab_size)[0]
    assert state.accepts_end() and not state.is_finished()  # "ab" may still follow
    assert set(allowed.nonzero()[:, 0].tolist()) > tokenizer.stop_token_ids
    state.advance(tokenizer.encode("b", add_special_tokens=False)[0])
    assert state.is_finished()
    allowed = unpack_bitmask(masker.fill([state]).bitmask, compiler.vocab_size)[0]
    assert set(allowed.nonzero()[:, 0].tolist()) == tokenizer.stop_token_ids


def test_special_and_padding_tokens_never_allowed_as_text(vocabulary):
    tokenizer, compiler = vocabulary
    state = compiler.compile(Constraint.regex("[^0-9]{1,10}")).new_state()
    mask = BatchMasker(1, compiler.vocab_size).fill([state])
    allowed = unpack_bitmask(mask.bitmask, compiler.vocab_size)[0]
    special = [i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == ""]
    assert special and not allowed[special].any()  # <|im_start|> is no text
    assert not allowed[tokenizer.vocab_size :].any()
    assert allowed[: tokenizer.vocab_size].sum() > 200  # text tokens are


@pytest.mark.parametrize("eos_logit", [-1e4, float("-inf")])
def test_sampler_picks_eos_when_only_eos_allowed(tiny, eos_logit):
    """Greedy and random rows both end, even when every allowed logit is -inf already."""
    tokenizer, compiler = tiny
    state = compiler.compile(Constraint.choice(["ab"])).new_state()
    for token in tokenizer.encode("ab", add_special_tokens=False):
        state.advance(token)
    logits = torch.full((2, compiler.vocab_size), 50.0)
    logits[:, sorted(tokenizer.stop_token_ids)] = eos_logit
    BatchMasker(2, compiler.vocab_size).fill([state, state.fork()]).apply(logits)
    params = [GenerationParams(temperature=0.0), GenerationParams(temperature=1.0, seed=3)]
    batch = SamplingBatch.build(params, [[], []], [[], []], "cpu")
    assert set(sample(logits, batch).token_ids) <= tokenizer.stop_token_ids


def test_mask_before_filters_keeps_draws_allowed(smollm2):
    """The integration order: penalties, the mask, then temperature, top-k, top-p and min-p.
    Every draw is allowed, and a greedy row takes the most likely allowed token."""
    tokenizer, compiler = smollm2
    state = compiler.compile(Constraint.regex(r"[0-9]{2}")).new_state()
    rows = 64
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, compiler.vocab_size, generator=generator) * 5
    digits = [tokenizer.encode(d, add_special_tokens=False)[0] for d in "0123456789"]
    params = [GenerationParams(temperature=0.0)] + [
        GenerationParams(
            temperature=0.8, top_k=5, top_p=0.5, min_p=0.2, repetition_penalty=1.5, seed=i
        )
        for i in range(1, rows)
    ]
    batch = SamplingBatch.build(params, [digits[:3]] * rows, [[]] * rows, "cpu")
    processed = PenaltyStrategy().apply(logits, batch)
    mask = BatchMasker(rows, compiler.vocab_size).fill([state.fork() for _ in range(rows)])
    mask.apply(processed)
    filters = SamplingPipeline(
        [TemperatureStrategy(), TopKStrategy(), TopPStrategy(), MinPStrategy()]
    )
    drawn = sample(processed, batch, pipeline=filters).token_ids
    allowed = unpack_bitmask(mask.bitmask, compiler.vocab_size)[0]
    assert all(allowed[token] for token in drawn)
    assert drawn[0] == int(logits[0].masked_fill(~allowed, float("-inf")).argmax())


def test_rollback_and_rebuild_give_the_masks_of_a_fresh_walk(smollm2):
    tokenizer, compiler = smollm2
    constraint = Constraint.json_schema(SCHEMAS[-1])
    _, (tokens,) = walk(tokenizer, compiler, [constraint], seed=4)
    compiled = compiler.compile(constraint)
    masker = BatchMasker(1, compiler.vocab_size)

    def mask_of(state):
        return masker.fill([state]).bitmask.clone()

    fresh = [mask_of(compiled.new_state(tokens[:k])) for k in range(len(tokens) + 1)]
    assert len({tuple(m.flatten().tolist()) for m in fresh}) > 3, "walk too short to tell"
    state = compiled.new_state(tokens)
    for back in (1, 3, len(tokens) // 2):
        state.rollback(back)
        assert torch.equal(mask_of(state), fresh[state.num_tokens])
        for token in tokens[state.num_tokens : state.num_tokens + back - 1]:
            state.advance(token)
        assert torch.equal(mask_of(state), fresh[state.num_tokens])
    with pytest.raises(ValueError, match="cannot roll back"):
        state.rollback(state.num_tokens + 1)


def test_fork_is_independent(smollm2):
    tokenizer, compiler = smollm2
    compiled = compiler.compile(Constraint.json_schema(SCHEMAS[0]))
    masker = BatchMasker(2, compiler.vocab_size)
    prefix = tokenizer.encode('{"name": "Ada"', add_special_tokens=False)
    more = tokenizer.encode(', "age": ', add_special_tokens=False)
    state = compiled.new_state(prefix)
    fork = state.fork()
    for token in more:
        fork.advance(token)
    mask = masker.fill([state, fork]).bitmask.clone()
    assert torch.equal(mask[0], masker.fill([compiled.new_state(prefix)]).bitmask[0])
    assert torch.equal(mask[1], masker.fill([compiled.new_state(prefix + more)]).bitmask[0])
    assert not torch.equal(mask[0], mask[1])


def test_advance_refuses_a_disallowed_token(tiny):
    tokenizer, compiler = tiny
    state = compiler.compile(Constraint.regex("[0-9]+")).new_state()
    with pytest.raises(RuntimeError, match="breaks the constraint"):
        state.advance(tokenizer.encode("x", add_special_tokens=False)[0])


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Constraint.json_schema("{not json"), "not valid JSON"),
        (lambda: Constraint.json_schema("[1, 2]"), "must be a JSON object"),
        (lambda: Constraint.choice([]), "non-empty list"),
        (lambda: Constraint.choice(["a", ""]), "non-empty strings"),
        (lambda: Constraint.grammar("  "), "non-empty"),
        (lambda: Constraint.regex(3), "must be a string"),
    ],
)
def test_malformed_specs_raise(build, message):
    with pytest.raises(ConstraintError, match=message):
        build()


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (
            Constraint.json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/b"}}}),
            "'/\\$defs/b' does not exist",
        ),
        (Constraint.json_schema({"type": "colour"}), "colour"),
        (Constraint.regex("a(b"), "unclosed group"),
        (Constraint.grammar("start: foo"), "foo"),
        (Constraint.grammar("root ::= ("), "GBNF"),
    ],
)
def test_uncompilable_specs_raise_constraint_error(tiny, constraint, message):
    with pytest.raises(ConstraintError, match=message) as error:
        tiny[1].compile(constraint)
    assert isinstance(error.value, ValueError)  # the server's 400
    assert constraint.kind in str(error.value)


def test_compile_cache_shares_and_evicts(tokenizer_dir, monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    compiler = ConstraintCompiler(tokenizer, cache_size=2)
    builds = []
    build = compiler._build
    monkeypatch.setattr(compiler, "_build", lambda c: builds.append(c) or build(c))
    a = compiler.compile(Constraint.json_schema(SCHEMAS[0]))
    assert compiler.compile(Constraint.json_schema(json.dumps(SCHEMAS[0]))) is a
    b = compiler.compile(Constraint.regex("b+"))
    assert b is not a
    compiler.compile(Constraint.json_schema(SCHEMAS[0]))  # a is now the most recent
    compiler.compile(Constraint.regex("c+"))  # evicts b
    assert compiler.compile(Constraint.json_schema(SCHEMAS[0])) is a
    assert len(builds) == 3  # a, b and c, each once
    assert compiler.compile(Constraint.regex("b+")) is not b


def test_compile_from_many_threads_gives_one_object(tiny):
    compiler = tiny[1]
    # Large enough that the threads compile it at the same time (llguidance drops the GIL).
    constraint = Constraint.json_schema(
        {
            "type": "object",
            "properties": {f"p{i}": {"pattern": f"^x{i}[a-z]+$"} for i in range(300)},
        }
    )
    barrier = threading.Barrier(8)

    def compile_together(_):
        barrier.wait()
        return compiler.compile(constraint)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(compile_together, range(8)))
    assert all(r is results[0] for r in results)


def test_from_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert Constraint.from_response_format({"type": "text"}) is None
    assert Constraint.from_response_format({"type": "json_object"}) == Constraint.json_object()
    assert Constraint.from_response_format(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    ) == Constraint.json_schema(schema)
    with pytest.raises(ConstraintError, match="json_schema.schema"):
        Constraint.from_response_format({"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(ConstraintError, match="'structural_tag' is not supported"):
        Constraint.from_response_format({"type": "structural_tag"})


def test_from_structured_outputs_and_guided_fields():
    schema = {"type": "array"}
    cases = {
        "json": (schema, Constraint.json_schema(schema)),
        "regex": ("a+", Constraint.regex("a+")),
        "choice": (["x", "y"], Constraint.choice(["x", "y"])),
        "grammar": (LARK, Constraint.grammar(LARK)),
    }
    for key, (value, expected) in cases.items():
        assert Constraint.from_structured_outputs({key: value, "disable_fallback": True}) == (
            expected
        )
        assert Constraint.from_guided({f"guided_{key}": value, "model": "m"}) == expected
    assert Constraint.from_structured_outputs({"json_object": True}) == Constraint.json_object()
    assert Constraint.from_structured_outputs({"json": None, "json_object": False}) is None
    assert Constraint.from_guided({"model": "m"}) is None
    with pytest.raises(ConstraintError, match="give only one"):
        Constraint.from_structured_outputs({"regex": "a", "choice": ["a"]})
    with pytest.raises(ConstraintError, match="option\\(s\\) whitespace_pattern are not supported"):
        Constraint.from_structured_outputs({"regex": "a", "whitespace_pattern": " "})
