"""Constrained decoding: JSON, JSON-schema, regex, choice and grammar constraints as token masks.

The grammar work is llguidance's, chosen over xgrammar by measurement (benchmarks/README.md):
it refuses what it cannot enforce instead of dropping it, compiles a schema in a fraction of a
millisecond, and builds masks lazily with bounded work per token. The pieces, by who holds them:

- `Constraint`, the immutable spec a request carries (hashable: the cache key), built from
  OpenAI's `response_format` or vLLM's `structured_outputs` / `guided_*` fields;
- `ConstraintCompiler`, one per engine (tokenizer and model vocab): a thread-safe LRU cache,
  called off the scheduler's thread (the server through `asyncio.to_thread`); what the
  library refuses raises `ConstraintError`, a ValueError, before the request is queued;
- `ConstraintState`, one per sequence, from `CompiledConstraint.new_state()`: `advance` with
  each accepted token, `is_finished`, `rollback` (rejected speculative tokens), `fork`;
- `BatchMasker`, one per engine: `fill(states)` writes the step's bitmask rows of the
  constrained sequences at once (in parallel, GIL released, so it may overlap the forward
  pass), and the `TokenMask` it returns masks the logits with `apply`.

In the sampler the mask goes after the penalties and logit bias and before temperature, top-k,
top-p and min-p, so each filter works among the allowed tokens and a masked logit stays -inf
through all of them; it goes on the processed copy, since logprobs are of the raw logits. A
row whose allowed tokens all have -inf logits gets them at 0 (a uniform draw among them), so a
masked token is never drawn and a row that allows only EOS always draws EOS. Tokens past the
tokenizer's vocabulary (a model's padded rows) are never allowed.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import llguidance

# torch is imported where a tensor is made, so that GenerationParams, which holds a Constraint,
# loads without it: `astrai --help` builds its flags from GenerationParams' fields.
if TYPE_CHECKING:
    import torch
    from torch import Tensor

from astrai.tokenize.tokenizer import Tokenizer

ConstraintKind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]


class ConstraintError(ValueError):
    """A constraint that is malformed or that the grammar library cannot compile."""


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match; hashable, so equal constraints share a compilation.

    spec is the schema as JSON text (json_schema), the pattern (regex), the options (choice),
    the Lark or GBNF text (grammar), or "" (json_object: any JSON object). Build it with the
    class methods, which check and normalise what they are given.
    """

    kind: ConstraintKind
    spec: str | tuple[str, ...] = ""

    @classmethod
    def json_object(cls) -> Constraint:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> Constraint:
        """A JSON schema as a dict or JSON text; key order is kept, as it orders the output."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ConstraintError(f"the JSON schema is not valid JSON: {exc}") from exc
        if not isinstance(schema, Mapping):
            raise ConstraintError(
                f"a JSON schema must be a JSON object, got {type(schema).__name__}"
            )
        return cls("json_schema", json.dumps(schema, ensure_ascii=False, separators=(",", ":")))

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        if not isinstance(pattern, str):
            raise ConstraintError(f"a regex must be a string, got {type(pattern).__name__}")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Constraint:
        if isinstance(options, str) or not options:
            raise ConstraintError("choice needs a non-empty list of strings")
        if not all(isinstance(option, str) and option for option in options):
            raise ConstraintError(f"choice options must be non-empty strings, got {options!r}")
        return cls("choice", tuple(options))

    @classmethod
    def grammar(cls, text: str) -> Constraint:
        """A context-free grammar in Lark (llguidance's dialect) or GBNF (llama.cpp's)."""
        if not isinstance(text, str) or not text.strip():
            raise ConstraintError("a grammar must be non-empty Lark or GBNF text")
        return cls("grammar", text)

    @classmethod
    def from_response_format(cls, response_format: Mapping[str, Any]) -> Constraint | None:
        """OpenAI's response_format: text (None), json_object, or json_schema.

        `strict` needs nothing more: the mask makes every output follow the schema.
        """
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind == "json_schema":
            json_schema = response_format.get("json_schema")
            if not isinstance(json_schema, Mapping) or json_schema.get("schema") is None:
                raise ConstraintError(
                    "response_format of type json_schema needs json_schema.schema, the schema "
                    "the output must follow"
                )
            return cls.json_schema(json_schema["schema"])
        raise ConstraintError(
            f"response_format type {kind!r} is not supported; use text, json_object or json_schema"
        )

    @classmethod
    def from_structured_outputs(cls, fields: Mapping[str, Any]) -> Constraint | None:
        """vLLM's structured_outputs object: one of json, regex, choice, grammar, json_object.

        disable_fallback is honoured as it is (there is one backend and no fallback); any other
        option that is set raises, so a request is never served without what it asked for.
        """
        given = {k: v for k, v in fields.items() if v is not None and v is not False}
        given.pop("disable_fallback", None)
        unknown = sorted(set(given) - set(_STRUCTURED_OUTPUT_KINDS))
        if unknown:
            raise ConstraintError(
                f"structured_outputs option(s) {', '.join(unknown)} are not supported; give "
                f"one of {', '.join(_STRUCTURED_OUTPUT_KINDS)}"
            )
        if len(given) > 1:
            raise ConstraintError(
                f"structured_outputs gives {', '.join(sorted(given))}; give only one constraint"
            )
        if not given:
            return None
        ((key, value),) = given.items()
        return _STRUCTURED_OUTPUT_KINDS[key](cls, value)

    @classmethod
    def from_guided(cls, fields: Mapping[str, Any]) -> Constraint | None:
        """vLLM's older request fields guided_json, guided_regex, guided_choice, guided_grammar
        (the other guided_* options are the server's to accept or refuse)."""
        return cls.from_structured_outputs(
            {key: fields.get(f"guided_{key}") for key in ("json", "regex", "choice", "grammar")}
        )


_STRUCTURED_OUTPUT_KINDS = {
    "json": lambda cls, value: cls.json_schema(value),
    "regex": lambda cls, value: cls.regex(value),
    "choice": lambda cls, value: cls.choice(value),
    "grammar": lambda cls, value: cls.grammar(value),
    "json_object": lambda cls, value: cls.json_object(),
}


# JSON laid out as json.dumps does (", " and ": ", no other whitespace) unless a schema's own
# "x-guidance" says otherwise: free whitespace carries nothing, and a model can spend every
# token it has on it (a small one stuck in a run of newlines never closes the object).
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# Integers without bounds get those of the integers JSON carries exactly (2**53 - 1, as RFC 8259
# advises): an unbounded one is where a small model writes "1111..." until max_tokens.
_INTEGER_BOUNDS = {"minimum": -(2**53 - 1), "maximum": 2**53 - 1}
# Keywords whose value is a schema, or a list or a map of them.
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_OPEN_OBJECT_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_schema(schema: Any, in_all_of: bool = False) -> Any:
    """A JSON schema as astrai enforces it: an object that lists its properties takes no
    others unless it says so (xgrammar's strict mode, vLLM's default), so no key is written
    twice (llguidance keeps listed keys unique, not additional ones), and an integer without
    bounds is held to the exactly representable range. Objects in an allOf stay open, since
    each branch lists only its own part of the properties."""
    if not isinstance(schema, Mapping):
        return schema
    closed = dict(schema)
    for key in _SUBSCHEMA:
        if key in closed:
            closed[key] = closed_schema(closed[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [closed_schema(item) for item in closed[key]]
    if isinstance(closed.get("allOf"), list):
        closed["allOf"] = [closed_schema(item, in_all_of=True) for item in closed["allOf"]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(closed.get(key), Mapping):
            closed[key] = {name: closed_schema(sub) for name, sub in closed[key].items()}
    lists_properties = isinstance(closed.get("properties"), Mapping) and closed["properties"]
    if lists_properties and not in_all_of and not any(k in closed for k in _OPEN_OBJECT_KEYS):
        closed["additionalProperties"] = False
    is_integer = closed.get("type") == "integer"
    bounded = any(
        k in closed for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
    )
    if is_integer and not bounded:
        closed.update(_INTEGER_BOUNDS)
    return closed


def _grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for a constraint (it reports errors when a matcher is built)."""
    try:
        if constraint.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=_JSON_LAYOUT
            )
        if constraint.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(
                closed_schema(json.loads(constraint.spec)), defaults=_JSON_LAYOUT
            )
        if constraint.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(constraint.spec)
        if constraint.kind == "choice":
            return llguidance.grammar_from("choice", list(constraint.spec))
        return llguidance.grammar_from("grammar", constraint.spec)
    except ValueError as exc:
        raise ConstraintError(f"invalid {constraint.kind}: {exc}") from exc


class _VocabBytes:
    """The vocabulary as llguidance's TokenizerWrapper reads it, through the public Tokenizer
    API (so GGUF and Hugging Face tokenizers alike), padded to the model's vocab size with
    empty tokens, which llguidance never allows: the model's extra rows are masked off."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        eos = sorted(tokenizer.stop_token_ids)
        self.eos_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else eos[0]
        self.bos_token_id = tokenizer.bos_token_id
        n = tokenizer.vocab_size
        self.tokens = [tokenizer.token_bytes(i) for i in range(n)] + [b""] * (vocab_size - n)
        # Special tokens are the ones decoding skips; a grammar never produces them as text.
        self.special_token_ids = [
            i for i in range(n) if tokenizer.decode([i], skip_special_tokens=True) == ""
        ]

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


class ConstraintCompiler:
    """Compiles constraints for one tokenizer and model; thread-safe, cached by constraint.

    vocab_size is the model's (its logits' width), which may exceed the tokenizer's; the
    compiler costs about half a second per 50k tokens, once.
    """

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int | None = None, cache_size: int = 256
    ) -> None:
        vocab_size = tokenizer.vocab_size if vocab_size is None else vocab_size
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(
                f"the model's vocab size {vocab_size} is below the tokenizer's "
                f"{tokenizer.vocab_size}; they belong to different models"
            )
        if not tokenizer.stop_token_ids:
            raise ValueError(
                "the tokenizer has no EOS or stop token, which a constrained output needs to end "
                "on; name eos_token_id in generation_config.json"
            )
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_VocabBytes(tokenizer, vocab_size)),
            eos_token=sorted(tokenizer.stop_token_ids),
        )
        self._cache: OrderedDict[Constraint, CompiledConstraint] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> CompiledConstraint:
        """The compiled constraint, from the cache or built now (the GIL is released while
        llguidance builds it); raises ConstraintError for what the library refuses."""
        with self._lock:
            compiled = self._cache.get(constraint)
            if compiled is not None:
                self._cache.move_to_end(constraint)
                return compiled
        compiled = CompiledConstraint(constraint, self._build(constraint))
        with self._lock:
            # Another thread may have compiled it meanwhile: keep one object per constraint.
            compiled = self._cache.setdefault(constraint, compiled)
            self._cache.move_to_end(constraint)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _build(self, constraint: Constraint) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._tokenizer, _grammar_text(constraint), log_level=0)
        if not matcher.is_error():
            # Some errors surface only with the first mask; computing it here also keeps its
            # cost off the scheduler's step.
            matcher.compute_bitmask()
        if matcher.is_error():
            raise ConstraintError(f"invalid {constraint.kind}: {matcher.get_error()}")
        return matcher


class CompiledConstraint:
    """A compiled constraint; shared by every request that carries it, never mutated."""

    def __init__(self, constraint: Constraint, matcher: llguidance.LLMatcher) -> None:
        self.constraint = constraint
        self._matcher = matcher

    def new_state(self, token_ids: Sequence[int] = ()) -> ConstraintState:
        """A sequence's state at its start, or after token_ids (rebuilding a preempted or
        restored sequence from its output); copying the compiled matcher costs microseconds."""
        state = ConstraintState(self._matcher.deep_copy())
        for token_id in token_ids:
            state.advance(token_id)
        return state


class ConstraintState:
    """One sequence's place in its constraint: which tokens may come next, and whether the
    output is complete. Owned by the scheduler's thread, like the rest of a task."""

    def __init__(self, matcher: llguidance.LLMatcher, num_tokens: int = 0) -> None:
        self._matcher = matcher
        self.num_tokens = num_tokens  # tokens advanced over, what rollback can undo

    def advance(self, token_id: int) -> None:
        """Take the sampled token. A token the mask did not allow is a bug in the caller."""
        if not self._matcher.consume_token(token_id):
            raise RuntimeError(
                f"token {token_id} breaks the constraint after {self.num_tokens} tokens: "
                f"{self._matcher.get_error()}"
            )
        self.num_tokens += 1

    def is_finished(self) -> bool:
        """The output is complete and nothing but EOS may follow: end the request (reason
        "stop") without sampling again."""
        return self._matcher.is_stopped()

    def accepts_end(self) -> bool:
        """The output so far is complete (the mask then allows EOS; more may still follow)."""
        return self._matcher.is_accepting()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens (rejected speculative tokens, a rewound sequence)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_tokens} tokens")
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"rollback failed: {self._matcher.get_error()}")
        self.num_tokens -= num_tokens

    def fork(self) -> ConstraintState:
        """An independent copy at the same place, for a sample of n > 1 that branches here."""
        return ConstraintState(self._matcher.deep_copy(), self.num_tokens)


@dataclass
class TokenMask:
    """One step's masks: the batch rows that are constrained and their allowed tokens."""

    rows: Tensor  # [R] int64, rows of the batch's logits
    bitmask: Tensor  # [R, ceil(V / 32)] int32: bit j of word w allows token 32 * w + j
    all_rows: bool  # rows is every row of the batch, in order

    def apply(self, logits: Tensor) -> Tensor:
        """Set every disallowed logit of [B, V] logits to -inf, in place; returns logits."""
        bias = bitmask_to_bias(self.bitmask.to(logits.device), logits.shape[-1])  # [R, V]
        rows = self.rows.to(logits.device)
        if self.all_rows:
            logits.add_(bias)
        else:
            logits.index_add_(0, rows, bias)
        # A row whose allowed tokens are all -inf (a penalty or bias put them there) would be
        # NaN after softmax; it draws uniformly among its allowed tokens instead.
        dead = logits.amax(dim=-1)[rows] == float("-inf")  # [R]
        if dead.any():
            logits[rows[dead]] = bias[dead]
        return logits


@functools.cache
def _byte_bias(device: torch.device) -> Tensor:
    """Byte value -> the additive mask of its 8 tokens, lowest bit first: 0 allowed, -inf not."""
    import torch

    bits = (torch.arange(256)[:, None] >> torch.arange(8) & 1).bool()
    return torch.where(bits, 0.0, float("-inf")).to(device)  # [256, 8]


def bitmask_to_bias(bitmask: Tensor, vocab_size: int) -> Tensor:
    """[R, W] int32 bitmask -> [R, vocab_size] float32, 0 where allowed and -inf where not:
    added to logits, it masks them in one pass (a table look-up per byte, no bit shifts)."""
    import torch

    table = _byte_bias(bitmask.device)
    # Little-endian int32 as bytes: byte i holds tokens 8i..8i+7.
    as_bytes = bitmask.contiguous().view(torch.uint8).view(-1).long()  # [R * 4W]
    return table.index_select(0, as_bytes).view(bitmask.shape[0], -1)[:, :vocab_size]


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """[R, W] int32 bitmask -> [R, vocab_size] bool, True where the token is allowed."""
    return bitmask_to_bias(bitmask, vocab_size) == 0


class BatchMasker:
    """Fills the step's masks of the constrained rows of a batch into one preallocated
    bitmask, the rows computed in parallel by llguidance's threads (GIL released)."""

    def __init__(self, max_batch_size: int, vocab_size: int, threads: int | None = None) -> None:
        import torch

        self.vocab_size = vocab_size
        self._bitmask = torch.zeros(max_batch_size, (vocab_size + 31) // 32, dtype=torch.int32)
        self._executor = llguidance.LLExecutor(num_threads=threads)

    def fill(self, states: Sequence[ConstraintState | None]) -> TokenMask | None:
        """The masks of a batch whose row i is states[i] (None: unconstrained, and a state in
        one row only); None when no row is constrained. The result is valid until the next
        fill."""
        rows = [i for i, state in enumerate(states) if state is not None]
        if not rows:
            return None
        if len(rows) > self._bitmask.shape[0]:  # llguidance writes through a raw pointer
            raise ValueError(
                f"{len(rows)} constrained rows, but the masker holds {self._bitmask.shape[0]}"
            )
        bitmask = self._bitmask[: len(rows)]  # [R, W], contiguous
        # What llguidance.torch.fill_next_token_bitmask_par does; importing that module would
        # import torch._dynamo (2 s) for a decorator astrai does not use.
        self._executor.unsafe_compute_mask_ptr(
            [(states[row]._matcher, slot) for slot, row in enumerate(rows)],
            bitmask.data_ptr(),
            bitmask.shape[1] * bitmask.element_size(),
            len(rows),
        )
        import torch

        return TokenMask(torch.tensor(rows), bitmask, all_rows=len(rows) == len(states))
