"""InferenceEngine: the synchronous, streaming and asyncio faces of the scheduler loop."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import aclosing, closing
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image

from astrai.config import POOLINGS, ConfigError, EngineConfig
from astrai.distributed.executor import TensorParallelExecutor
from astrai.distributed.launch import ShardedModel
from astrai.inference.constraints import CompiledConstraint, Constraint, ConstraintCompiler
from astrai.inference.executor import ModelExecutor
from astrai.inference.kv_cache import PagedCache
from astrai.inference.mrope import MRopePositions
from astrai.inference.scheduler import InferenceScheduler
from astrai.inference.speculative import (
    DraftModelProposer,
    NgramProposer,
    SpeculationStats,
    Speculator,
)
from astrai.inference.task import (
    STOP,
    GenerationParams,
    InvalidParamsError,
    PromptImage,
    PromptTooLongError,
    RequestError,
    Task,
    TaskCallback,
    TaskDelta,
    TaskManager,
    TaskResult,
)
from astrai.model.automodel import resolve_dtype
from astrai.model.lora import AdapterTable, LoraAdapter, read_adapter
from astrai.model.vision.decode import ImageError
from astrai.model.vision.tiled_image import TiledImage, expand_image_tokens

log = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant")
# An embedding task computes its prompt and samples nothing.
EMBEDDING_PARAMS = GenerationParams(max_tokens=0)


@dataclass(frozen=True)
class GenerationRequest:
    """A chat request: messages rendered through the model's chat template, plus settings.

    A message's content is a string, or a list of parts: {"type": "text", "text": str} and, for
    a model with a vision encoder, {"type": "image", "image": PIL.Image.Image}, an image placed
    where its part is.
    """

    messages: tuple[dict[str, Any], ...]
    params: GenerationParams = field(default_factory=GenerationParams)
    stream: bool = False

    def __post_init__(self) -> None:
        messages = tuple(self.messages)
        if not messages:
            raise RequestError("messages must hold at least one message")
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise RequestError(f"messages[{i}] must be a dict with 'role' and 'content'")
            if message.get("role") not in CHAT_ROLES:
                raise RequestError(
                    f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                    f"got {message.get('role')!r}"
                )
            content = message.get("content")
            if isinstance(content, list):
                for j, part in enumerate(content):
                    _check_part(part, f"messages[{i}].content[{j}]")
            elif not isinstance(content, str):
                raise RequestError(f"messages[{i}].content must be a string or a list of parts")
        object.__setattr__(self, "messages", messages)

    @property
    def images(self) -> list[Image.Image]:
        """The images of the messages' parts, in order."""
        return [
            part["image"]
            for message in self.messages
            if isinstance(message["content"], list)
            for part in message["content"]
            if part["type"] == "image"
        ]

    def rendered_messages(self, placeholder: str) -> list[dict[str, str]]:
        """The messages with string contents, as a chat template takes them (render_parts)."""
        return [
            {
                **message,
                "content": message["content"]
                if isinstance(message["content"], str)
                else render_parts(
                    [p["text"] if p["type"] == "text" else p["image"] for p in message["content"]],
                    placeholder,
                ),
            }
            for message in self.messages
        ]


def _check_part(part: Any, where: str) -> None:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return
    if kind == "image" and isinstance(part.get("image"), Image.Image):
        return
    raise RequestError(
        f"{where} must be {{'type': 'text', 'text': str}} or "
        f"{{'type': 'image', 'image': PIL.Image.Image}}, got {part!r:.80}"
    )


@dataclass(frozen=True)
class ImagePrompt(Sequence[int]):
    """A prompt with images, as InferenceEngine.image_prompt makes it: its token ids, each
    image's placeholder expanded to the tokens the image stands for, and its images,
    preprocessed, in order. As a sequence it is its token ids."""

    token_ids: list[int]
    images: tuple[PromptImage, ...]

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, index):
        return self.token_ids[index]


def image_placeholder(vision: torch.nn.Module, tokenizer: Any) -> str:
    """The text a chat message's image part renders as for a model's vision module: its image
    token, within the tokens the model's chat template writes around it (placeholder_ids), on
    a line of its own where the family's template puts it so (image_part_ends_line: LLaVA's
    `<image>\n`; Qwen2-VL's runs on into the next part)."""
    text = "".join(tokenizer.id_to_token(token) for token in vision.placeholder_ids)
    return f"{text}\n" if vision.image_part_ends_line else text


def render_parts(parts: Sequence[str | Any], placeholder: str) -> str:
    """A message's content parts as one string: text parts as they are, each image part (any
    part that is not a str) as the model's image placeholder (image_placeholder)."""
    return "".join(part if isinstance(part, str) else placeholder for part in parts)


@dataclass
class StreamEvent:
    """One event of a request: a delta of sample `index`, or (last for that index) its result.

    Sample s of prompt p has index p * n + s, the choice numbering OpenAI uses.
    """

    index: int
    delta: TaskDelta | None = None
    result: TaskResult | None = None


@dataclass
class EngineStats:
    running: int
    waiting: int
    pages_total: int
    pages_free: int
    pages_owned: int
    pages_cached: int
    prefix_hit_rate: float
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    speculative_steps: int = 0  # decode rows that carried guessed tokens
    proposed_tokens: int = 0  # guessed tokens the target checked
    accepted_tokens: int = 0  # guessed tokens the target kept


Prompt = str | GenerationRequest
# What embed takes: a text or token-id list, or a list of either.
EmbeddingInput = str | Sequence[int] | Sequence[str | Sequence[int]]


class _MergedStream:
    """The events of every task of one request, merged into one stream of StreamEvent.

    The tasks share one callback that queues (task, event) in arrival order; each index gets
    its deltas, then exactly one event carrying its result. Constructing it submits the request
    all or nothing (InferenceEngine.submit_all), because the queue must exist before the tasks.
    """

    _open = 0  # until the request is submitted, so __del__ of a refused one is a no-op

    def __init__(
        self,
        engine: InferenceEngine,
        prompts: Sequence[Sequence[int]],
        params: GenerationParams,
        put: Callable[[tuple[Task, TaskDelta | object]], None],
        pooling: str | None = None,
    ) -> None:
        self._engine = engine
        groups = engine.submit_all(
            prompts, params, lambda task, event: put((task, event)), pooling=pooling
        )
        self.tasks = [task for group in groups for task in group]
        self._index = {task.id: i for i, task in enumerate(self.tasks)}
        self._open = len(self.tasks)

    def _event(self, task: Task, event: TaskDelta | object) -> StreamEvent:
        if event is STOP:
            self._open -= 1
            return StreamEvent(self._index[task.id], result=task.result())
        return StreamEvent(self._index[task.id], delta=event)

    def abort(self) -> None:
        """End every unfinished sample; idempotent. Their result events still arrive."""
        if self._open:
            for task in self.tasks:
                self._engine.abort(task)

    def close(self) -> None:
        """Abort the request and end the iteration now."""
        self.abort()
        self._open = 0

    def __del__(self) -> None:
        self.abort()


class SyncRequestStream(_MergedStream):
    """A request's events as a blocking iterator; close() or dropping it aborts the request."""

    def __init__(
        self, engine: InferenceEngine, prompts, params: GenerationParams, pooling: str | None = None
    ) -> None:
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        super().__init__(engine, prompts, params, self._events.put, pooling)

    def __iter__(self) -> SyncRequestStream:
        return self

    def __next__(self) -> StreamEvent:
        if not self._open:
            raise StopIteration
        return self._event(*self._events.get())


class RequestStream(_MergedStream):
    """A request's events as an async iterator; created inside a running event loop.

    Dropping it before the end (break, cancellation, aclose(), garbage collection) aborts the
    request. Events cross from the loop thread with call_soon_threadsafe, never by polling.
    """

    def __init__(
        self, engine: InferenceEngine, prompts, params: GenerationParams, pooling: str | None = None
    ) -> None:
        loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        super().__init__(
            engine,
            prompts,
            params,
            lambda item: loop.call_soon_threadsafe(self._events.put_nowait, item),
            pooling,
        )

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamEvent:
        if not self._open:
            raise StopAsyncIteration
        try:
            item = await self._events.get()
        except BaseException:
            self.abort()
            raise
        return self._event(*item)

    async def aclose(self) -> None:
        self.close()


class InferenceEngine:
    """Continuous batching over a paged KV cache, run by one background thread.

    Use it as a context manager so the loop thread stops and in-flight requests end cleanly.
    """

    def __init__(
        self,
        model: torch.nn.Module | ShardedModel,
        tokenizer: Any,
        config: EngineConfig | None = None,
        **overrides,
    ) -> None:
        """model: the model to run, or rank 0's shard of a tensor-parallel one with its group
        (astrai.distributed.load_sharded's ShardedModel), which the engine closes with itself;
        config (or its fields as keywords): how to run it."""
        self.config = replace(config or EngineConfig(), **overrides)
        self._group = None
        if isinstance(model, ShardedModel):
            model, self._group = model.model, model.group
        group_size = 1 if self._group is None else self._group.size
        if group_size != self.config.tensor_parallel_size:
            raise ConfigError(
                f"tensor_parallel_size is {self.config.tensor_parallel_size} but the model is "
                f"loaded for {group_size} ranks; load it with "
                "astrai.distributed.load_sharded(path, tensor_parallel_size)"
            )
        self.model = model
        self.tokenizer = tokenizer
        model_config = model.config
        self.max_seq_len = self.config.max_seq_len or model_config.max_len
        if self.max_seq_len > model_config.max_len:
            raise ConfigError(
                f"max_seq_len {self.max_seq_len} exceeds the model's context of "
                f"{model_config.max_len} tokens"
            )
        weight = next(model.parameters())
        self._cuda_graphs = self._takes_cuda_graphs(weight.device)
        page_size = self.config.page_size
        kv_shape = (model_config.n_layers, model_config.n_kv_heads, model_config.head_dim)
        kv_dtype = self.config.kv_cache_dtype
        kv_dtype = weight.dtype if kv_dtype == "auto" else resolve_dtype(kv_dtype)
        budget_pages = PagedCache.pages_for_budget(
            self.config.kv_cache_memory, *kv_shape, page_size, kv_dtype, weight.device
        )
        # More pages than the engine can use at once would only reserve memory.
        if self.config.max_total_tokens is None:
            usable_pages = self.config.max_batch_size * -(-self.max_seq_len // page_size)
            use = f"{self.config.max_batch_size} x max_seq_len {self.max_seq_len}"
        else:
            usable_pages = -(-self.config.max_total_tokens // page_size)
            use = f"max_total_tokens {self.config.max_total_tokens}"
        self.cache = PagedCache(
            *kv_shape,
            min(budget_pages, usable_pages),
            page_size,
            dtype=kv_dtype,
            device=weight.device,
            enable_prefix_cache=self.config.enable_prefix_cache,
        )
        page_bytes = self.cache.kv.nbytes // self.cache.n_pages
        sized_by = f"for {use}"
        if budget_pages < usable_pages:
            budget = self.config.kv_cache_memory
            budget = f"{budget / 1e6:.1f} MB" if budget > 1 else f"{budget:.0%} of free memory"
            sized_by = (
                f"capped by kv_cache_memory, {budget} ({use} would take "
                f"{usable_pages * page_bytes / 1e6:.0f} MB)"
            )
        log.info(
            "weights %.0f MB %s on %s; KV cache %.1f MB %s reserved, touched only as tokens are "
            "written: %d tokens in %d pages of %d, %s",
            model.weight_bytes() / 1e6,
            weight.dtype,
            weight.device,
            self.cache.kv.nbytes / 1e6,
            kv_dtype,
            self.cache.n_pages * page_size,
            self.cache.n_pages,
            page_size,
            sized_by,
        )
        self.pooling = self.config.pooling or "last"  # an embedding's, unless it names one
        self.manager = TaskManager(self.config.max_waiting)
        speculator = self._speculator()
        # A speculating task samples a row for each guess besides its own.
        rows = self.config.max_batch_size * (
            1 + (self.config.num_speculative_tokens if speculator else 0)
        )
        self.adapters = self._adapters()
        if self._group is None:
            executor = ModelExecutor(
                model,
                self.cache.kv,
                self.cache.tasks.pages,
                max_batch_size=rows,
                # an embedding engine never decodes: no decode step to record
                cuda_graphs=self._cuda_graphs and self.config.task != "embed",
                adapters=self.adapters,
                max_seq_len=self.max_seq_len,
                batch_invariant=self.config.batch_invariant,
                activation_precision=self.config.activation_precision,
            )
        else:
            if self._cuda_graphs:  # asked for by default: EngineConfig refuses them if given
                log.info(
                    "decode steps run eagerly: CUDA graphs are not replayed under tensor "
                    "parallelism (tensor_parallel_size %d)",
                    self._group.size,
                )
            executor = TensorParallelExecutor(
                self._group,
                model,
                self.cache,
                max_batch_size=rows,
                batch_invariant=self.config.batch_invariant,
                activation_precision=self.config.activation_precision,
            )
        self.scheduler = InferenceScheduler(
            executor, self.cache, self.manager, self.config, speculator
        )
        self._compiler: ConstraintCompiler | None = None  # made with the first constraint
        self._compiler_lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="astrai-scheduler", daemon=True)
        self._thread.start()

    def _takes_cuda_graphs(self, device: torch.device) -> bool:
        """Whether decode steps on device may replay from CUDA graphs: on CUDA, unless
        config.cuda_graphs turns them off or LoRA adapters are loaded; a cuda_graphs setting
        given off CUDA is refused."""
        asked = self.config.cuda_graphs
        if device.type == "cuda" and asked is None and self.config.lora_slots:
            # EngineConfig refuses graphs asked for beside adapters
            log.info("decode steps run eagerly: CUDA graphs do not follow LoRA adapters")
            return False
        if device.type == "cuda":
            return asked is not False
        if asked is not None:
            flag = "--cuda-graphs" if asked else "--no-cuda-graphs"
            raise ConfigError(
                f"cuda_graphs={asked} ({flag}) applies to CUDA; this model is on {device}, "
                "whose decode steps replay recorded kernel calls instead; drop the option"
            )
        return False

    def _adapters(self) -> AdapterTable | None:
        """The config's LoRA adapters, read and checked against the model, in a table with
        room for config.lora_slots; None when the config asks for no adapter."""
        slots = self.config.lora_slots
        if not slots:
            return None
        adapters = [read_adapter(name, path, self.model) for name, path in self.config.adapters]
        rank = self.config.max_lora_rank or max((a.rank for a in adapters), default=16)
        table = AdapterTable(self.model, slots, rank)
        for adapter in adapters:
            table.add(adapter)
        log.info(
            "LoRA adapters %s loaded: %d of %d slots taken, rank up to %d",
            [a.name for a in adapters],
            len(adapters),
            slots,
            rank,
        )
        return table

    def load_adapter(self, name: str, path: str) -> LoraAdapter:
        """Read the LoRA adapter at path and serve it as name (LoraError if it cannot be)."""
        if self.adapters is None:
            raise ConfigError(
                "this engine holds no LoRA adapter slots; start it with max_loras (--max-loras)"
            )
        adapter = read_adapter(name, path, self.model)
        self.adapters.add(adapter)
        return adapter

    def unload_adapter(self, name: str) -> None:
        """Stop serving the adapter called name; requests already running under it finish."""
        if self.adapters is None:
            raise ConfigError("this engine holds no LoRA adapters")
        self.adapters.remove(name)

    def adapter_names(self) -> list[str]:
        return [] if self.adapters is None else self.adapters.names()

    def _speculator(self) -> Speculator | None:
        """The speculative decoding the config asks for; a draft model is loaded here, in the
        target's dtype and on its device, with a KV pool of as many tokens as the target's in
        the target's KV dtype."""
        config = self.config
        if config.speculative is None:
            return None
        if config.speculative == "ngram":
            return Speculator(NgramProposer(), config.num_speculative_tokens)
        from astrai.model import AutoModel
        from astrai.model.weights.hub import resolve_model

        weight = next(self.model.parameters())
        draft = AutoModel.from_pretrained(
            resolve_model(config.draft_model), dtype=weight.dtype, device=weight.device
        )
        if draft.config.vocab_size != self.model.config.vocab_size:
            raise ConfigError(
                f"the draft model's vocabulary has {draft.config.vocab_size} tokens and the "
                f"target's {self.model.config.vocab_size}; a draft model must share the "
                "target's tokenizer"
            )
        shape = (draft.config.n_layers, draft.config.n_kv_heads, draft.config.head_dim)
        cache = PagedCache(
            *shape,
            self.cache.n_pages,
            self.cache.page_size,
            dtype=self.cache.kv.k_cache.dtype,
            device=weight.device,
            enable_prefix_cache=False,
        )
        log.info(
            "draft model %s: weights %.0f MB, KV cache %.0f MB",
            config.draft_model,
            draft.weight_bytes() / 1e6,
            cache.kv.nbytes / 1e6,
        )
        executor = ModelExecutor(
            draft,
            cache.kv,
            cache.tasks.pages,
            cuda_graphs=self._cuda_graphs,
            batch_invariant=config.batch_invariant,
            activation_precision=config.activation_precision,
        )
        proposer = DraftModelProposer(executor, cache)
        return Speculator(proposer, config.num_speculative_tokens)

    def __enter__(self) -> InferenceEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _loop(self) -> None:
        try:
            self.scheduler.run_forever(self._stopped)
        except BaseException as exc:
            log.exception("the scheduler loop crashed")
            self.manager.close()
            self.scheduler.abort_all(f"the engine loop crashed: {exc}")
            self._stopped.set()

    @property
    def is_running(self) -> bool:
        """False once the loop has stopped, by close() or by a crash, or once a tensor-parallel
        rank is gone (noticed even while idle)."""
        ranks_alive = self._group is None or self._group.failure is None
        return ranks_alive and self._thread.is_alive() and not self._stopped.is_set()

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt plus output) one request can ever hold."""
        return min(self.max_seq_len, self.cache.n_pages * self.cache.page_size)

    def close(self) -> None:
        """Stop the loop; requests still in flight end with finish_reason 'abort', so their
        callers get RequestAbortedError, and a submit from now on raises EngineClosedError."""
        self.manager.close()
        self._stopped.set()
        self.manager.wakeup.set()
        self._thread.join()
        if self._group is not None:
            self._group.close()
        if self.adapters is not None:
            self.adapters.close()
        if self.scheduler.invariant_error is not None:
            raise self.scheduler.invariant_error

    # -- submitting -------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int] | ImagePrompt:
        """A prompt's token ids; an ImagePrompt for a chat request with images."""
        if isinstance(prompt, GenerationRequest):
            images = prompt.images
            if not images:
                return list(self.tokenizer.apply_chat_template(list(prompt.messages)))
            messages = prompt.rendered_messages(self.image_placeholder)
            return self.image_prompt(self.tokenizer.apply_chat_template(messages), images)
        if not isinstance(prompt, str):
            raise RequestError(f"a prompt must be a str or a GenerationRequest, got {prompt!r}")
        return self.tokenizer.encode(prompt)

    @property
    def image_placeholder(self) -> str:
        """The text a chat message's image part renders as (the model's image token, within
        the tokens its chat template writes around it, then a newline where it writes one); a
        RequestError for a model without a vision encoder."""
        return image_placeholder(self.check_images(0), self.tokenizer)

    def check_images(self, n_images: int) -> torch.nn.Module:
        """The model's vision encoder, for a prompt of n_images images; a RequestError when the
        model has none or the prompt holds more images than a request may."""
        vision = self.model.vision
        if vision is None:
            raise RequestError(
                "the prompt holds images, but this model reads text only (it has no vision "
                "encoder); send text, or serve a vision-language model"
            )
        limit = self.config.max_images_per_request
        if n_images > limit:
            raise RequestError(
                f"the prompt holds {n_images} images, over the limit of {limit} per request "
                "(the operator sets it with --max-images-per-request)"
            )
        return vision

    def submit_all(
        self,
        prompts: Sequence[Sequence[int] | ImagePrompt],
        params: GenerationParams,
        callback: TaskCallback,
        pooling: str | None = None,
    ) -> list[list[Task]]:
        """Queue params.n tasks of every prompt (token ids, or an ImagePrompt), all or none;
        callback(task, TaskDelta | STOP) runs on the loop.

        Every prompt is checked, params.constraint compiled (ConstraintError) and the tasks go
        into the queue in one step, so a refused prompt, a bad constraint or a queue without
        room for all of them raises before any task could run. pooling ("last" or "mean")
        makes embedding tasks (params EMBEDDING_PARAMS, with a lora or not), which end once
        their prompt is computed with TaskResult.embedding; an engine of task "embed" takes no
        other.
        """
        if self.scheduler.invariant_error is not None:
            raise self.scheduler.invariant_error
        self._check_task(params, pooling)
        prompts = [self._checked(ids, params) for ids in prompts]
        self._check_token_ids(params)
        compiled = None if params.constraint is None else self.compile(params.constraint)
        groups = [
            self._sample_tasks(ids, images, params, callback, compiled, pooling)
            for ids, images in prompts
        ]
        tasks = [task for group in groups for task in group]
        if params.lora is not None:
            if self.adapters is None:
                raise RequestError(
                    f"lora {params.lora!r}: this engine serves no LoRA adapters; load them with "
                    "loras (--lora NAME=PATH)"
                )
            adapter = self.adapters.acquire(params.lora, tasks)
            for task in tasks:
                task.adapter = adapter
        for task in tasks:
            task.kv_root = self._kv_root(task)
        self.manager.add_tasks(tasks)
        return groups

    def submit(
        self,
        prompt_ids: Sequence[int] | ImagePrompt,
        params: GenerationParams,
        callback: TaskCallback,
    ) -> list[Task]:
        """Queue params.n tasks of one prompt; callback(task, TaskDelta | STOP) runs on the loop."""
        [tasks] = self.submit_all([prompt_ids], params, callback)
        return tasks

    def compile(self, constraint: Constraint) -> CompiledConstraint:
        """The constraint compiled for this model (cached); raises ConstraintError, a
        ValueError, for one the grammar library refuses.

        submit compiles too; a server calls this first off its event loop (asyncio.to_thread):
        a new schema takes milliseconds, and the first constraint of an engine indexes the
        vocabulary (about half a second per 50k tokens).
        """
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = ConstraintCompiler(self.tokenizer, self.model.config.vocab_size)
        return self._compiler.compile(constraint)

    def _kv_root(self, task: Task) -> bytes | None:
        """The key the prefix cache files task's pages under (TaskPages.root): its adapter's,
        the rotation a long prompt's tokens take (astrai.model.rope), and the digest of every
        image of its prompt (a page before the first image is keyed by them too: simple, and
        never wrong); None if none of these."""
        parts = [
            None if task.adapter is None else task.adapter.prefix_key,
            self.model.rope.length_key(len(task.prompt_ids)),
            *(image.digest for image in task.images),
        ]
        parts = [part for part in parts if part is not None]
        return hashlib.blake2b(b"|".join(parts), digest_size=16).digest() if parts else None

    def _check_task(self, params: GenerationParams, pooling: str | None) -> None:
        """A generation request to an embedding engine, or an embedding with sampling
        settings, is refused."""
        if pooling is None:
            if self.config.task == "embed":
                raise RequestError(
                    "this engine serves embeddings only (task embed, astrai serve --task "
                    "embed) and generates no text; ask for embeddings, or serve the model "
                    "without --task embed"
                )
            return
        if pooling not in POOLINGS:
            raise RequestError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        if replace(params, lora=None) != EMBEDDING_PARAMS:
            raise RequestError(
                "an embedding samples nothing: give it EMBEDDING_PARAMS (with a lora or not)"
            )

    def _check_token_ids(self, params: GenerationParams) -> None:
        """Token ids in the params must be the model's, or indexing its logits would fail."""
        vocab = self.model.config.vocab_size
        for name, ids in (
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids),
            ("stop_token_ids", params.stop_token_ids),
            ("thinking_budget", params.thinking_budget.end_ids if params.thinking_budget else ()),
        ):
            outside = sorted(t for t in ids if t >= vocab)
            if outside:
                raise InvalidParamsError(
                    f"{name} holds token ids {outside[:5]} outside the model's vocabulary "
                    f"[0, {vocab})"
                )

    def _checked(
        self, prompt: Sequence[int] | ImagePrompt, params: GenerationParams
    ) -> tuple[list[int], list[PromptImage]]:
        """The prompt's token ids (each image placeholder expanded to its tokens) and images; a
        request that could never run is refused now, not truncated."""
        if isinstance(prompt, ImagePrompt):
            prompt_ids, images = list(prompt.token_ids), list(prompt.images)
        else:
            prompt_ids, images = list(prompt), []
            vision = self.model.vision
            if vision is not None and vision.image_token_id in prompt_ids:
                raise RequestError(
                    "the prompt holds the image token but no image; send the image with it "
                    "(an image part of the request, or InferenceEngine.image_prompt)"
                )
        if not prompt_ids:
            raise RequestError("the prompt is empty; give at least one token")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestError(f"prompt token ids must lie in [0, {vocab})")
        n, new = len(prompt_ids), params.max_tokens
        if n + new > self.max_seq_len:
            raise PromptTooLongError(n, new, self.max_seq_len, "the maximum sequence length")
        pool_tokens = self.cache.n_pages * self.cache.page_size
        if n + new > pool_tokens:
            raise PromptTooLongError(n, new, pool_tokens, "the KV cache pool")
        return prompt_ids, images

    def image_prompt(self, token_ids: Sequence[int], images: Sequence[Image.Image]) -> ImagePrompt:
        """The prompt of token_ids that hold one placeholder token (the model's image token)
        where each image goes: each placeholder expanded to the tokens its image stands for
        (as transformers' processor of the model expands `<image>`: LLaVA's a run of image
        tokens, Idefics3's a run per tile within its layout text), the images preprocessed
        (each tile a PromptImage); a RequestError for a model without vision, too many images
        or a miscount."""
        token_ids = list(token_ids)
        vision = self.check_images(len(images))
        image_token = vision.image_token_id
        placeholders = token_ids.count(image_token)
        if placeholders != len(images):
            raise RequestError(
                f"the prompt holds {placeholders} image placeholder(s) but {len(images)} "
                "image(s) came with it; give one placeholder token per image"
            )
        expanded, tiles = expand_image_tokens(
            token_ids,
            [self._tiled(vision, image, k) for k, image in enumerate(images)],
            image_token,
            lambda text: self.tokenizer.encode(text, add_special_tokens=False),
        )
        return ImagePrompt(
            expanded,
            tuple(
                PromptImage(
                    image.pixel_values[i],
                    _pixels_digest(image.pixel_values[i], image.feature_rows),
                    start,
                    image.tokens_per_tile,
                    image.grid,
                    image.bidirectional,
                    image.feature_rows,
                )
                for image, i, start in tiles
            ),
        )

    @staticmethod
    def _tiled(vision: torch.nn.Module, image: Image.Image, index: int) -> TiledImage:
        """The image preprocessed for the model; a RequestError naming it for one the model
        cannot read (Qwen2-VL's, too narrow)."""
        try:
            return vision.tile(image)
        except ImageError as exc:
            raise RequestError(f"image {index + 1}: {exc}") from None

    def _sample_tasks(
        self,
        prompt_ids: list[int],
        images: list[PromptImage],
        params: GenerationParams,
        callback: TaskCallback,
        compiled: CompiledConstraint | None,
        pooling: str | None = None,
    ) -> list[Task]:
        """The n tasks of one prompt; each sample has its own constraint state."""
        grids = [(image.start, image.grid) for image in images if image.grid is not None]
        mrope = MRopePositions.of(len(prompt_ids), grids) if grids else None
        tasks: list[Task] = []
        for i in range(params.n):
            sample_params = params
            if params.seed is not None and i:  # each sample its own stream, reproducibly
                sample_params = replace(params, seed=(params.seed + i) % (1 << 63))
            tasks.append(
                Task(
                    prompt_ids,
                    sample_params,
                    callback,
                    self.tokenizer.detokenizer(),
                    self.tokenizer.stop_token_ids,
                    parent=tasks[0] if tasks else None,
                    constraint=None if compiled is None else compiled.new_state(),
                    pooling=pooling,
                    images=images,
                    mrope=mrope,
                )
            )
        return tasks

    def abort(self, task: Task | int) -> None:
        self.manager.abort(task.id if isinstance(task, Task) else task)

    # -- synchronous API --------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: GenerationParams | None = None,
        *,
        stream: bool | None = None,
        **param_overrides: Any,
    ):
        """A prompt gives a str (a list of n for n > 1); a list of prompts gives a list.

        stream=True yields text pieces for one prompt, (index, piece) pairs for a list.
        """
        single = isinstance(prompts, str | GenerationRequest)
        if stream is None:
            stream = single and isinstance(prompts, GenerationRequest) and prompts.stream
        if not stream:
            results = self.generate_results(prompts, params, **param_overrides)
            return _map_results(results, lambda r: r.text)
        items = [prompts] if single else list(prompts)
        params = self._params(items, params, param_overrides)
        if params.n != 1:
            raise RequestError("stream=True supports n=1 only; use submit_async for n > 1")
        stream = SyncRequestStream(self, [self.encode(item) for item in items], params)
        return self._stream_text(stream, single)

    def generate_results(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: GenerationParams | None = None,
        **param_overrides: Any,
    ):
        """Like generate, but each sample is a TaskResult (ids, finish reason, counts)."""
        single = isinstance(prompts, str | GenerationRequest)
        items = [prompts] if single else list(prompts)
        params = self._params(items, params, param_overrides)
        results = self._results(
            SyncRequestStream(self, [self.encode(item) for item in items], params)
        )
        n = params.n
        shaped = [results[i] if n == 1 else results[i : i + n] for i in range(0, len(results), n)]
        return shaped[0] if single else shaped

    def embed(
        self, inputs: EmbeddingInput, pooling: str | None = None, lora: str | None = None
    ) -> torch.Tensor:
        """L2-normalized embeddings, float32: [dim] for one text or token-id list, [n, dim] for
        a list of them. Each is the model's final hidden states (after the final norm, under
        the LoRA adapter lora names, if any) of the input's tokens pooled by pooling, "last"
        or "mean" (default: self.pooling). A text is encoded as generate encodes it, with the
        tokenizer's special tokens."""
        single = isinstance(inputs, str) or (
            bool(inputs) and all(isinstance(t, int) for t in inputs)
        )
        items = [inputs] if single else list(inputs)
        if not items:
            raise RequestError("embed needs at least one input")
        prompts = [self.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in items]
        params = replace(EMBEDDING_PARAMS, lora=lora)
        results = self._results(SyncRequestStream(self, prompts, params, pooling or self.pooling))
        vectors = F.normalize(torch.stack([r.embedding for r in results]), dim=-1)
        return vectors[0] if single else vectors

    @staticmethod
    def _results(stream: SyncRequestStream) -> list[TaskResult]:
        """Every task's result, in submission order, once all have ended; the first that
        failed raises its typed error."""
        results: list[TaskResult | None] = [None] * len(stream.tasks)
        with closing(stream):
            for event in stream:
                if event.result is not None:
                    results[event.index] = event.result
        for result in results:
            result.raise_for_status()
        return results

    @staticmethod
    def _stream_text(stream: SyncRequestStream, single: bool) -> Iterator:
        with closing(stream):
            for event in stream:
                if event.result is not None:
                    event.result.raise_for_status()
                elif event.delta.text:
                    yield event.delta.text if single else (event.index, event.delta.text)

    def _params(
        self, items: Sequence[Prompt], params: GenerationParams | None, overrides: dict
    ) -> GenerationParams:
        """The params given, else the first chat request's, else the defaults; then overrides."""
        if params is None:
            requests = [p for p in items if isinstance(p, GenerationRequest)]
            params = requests[0].params if requests else GenerationParams()
        return replace(params, **overrides) if overrides else params

    # -- asyncio API ------------------------------------------------------------------------

    def submit_all_async(
        self, prompts: Sequence[Sequence[int] | ImagePrompt], params: GenerationParams
    ) -> RequestStream:
        """Queue every prompt's samples, all or none (errors raise here), and return their
        events merged into one async iterator.

        Call it inside a running event loop. Stopping the iteration early, cancelling the
        consuming task or calling abort() ends the request and frees its pages.
        """
        return RequestStream(self, prompts, params)

    def embed_async(
        self,
        prompts: Sequence[Sequence[int]],
        pooling: str | None = None,
        lora: str | None = None,
    ) -> RequestStream:
        """Queue an embedding task of every token-id prompt, all or none (errors raise here),
        and return their events: each ends with a TaskResult whose embedding is the pooled
        final hidden states, not normalized (pooling as embed takes it)."""
        params = replace(EMBEDDING_PARAMS, lora=lora)
        return RequestStream(self, prompts, params, pooling or self.pooling)

    def submit_async(
        self, prompt_ids: Sequence[int] | ImagePrompt, params: GenerationParams
    ) -> RequestStream:
        """submit_all_async for one prompt: its n samples' events as an async iterator."""
        return self.submit_all_async([prompt_ids], params)

    async def generate_async(
        self, prompt: Prompt, params: GenerationParams | None = None, **param_overrides: Any
    ) -> AsyncIterator[str]:
        """Stream the text pieces of one prompt (n = 1) under asyncio."""
        params = self._params([prompt], params, param_overrides)
        if params.n != 1:
            raise RequestError("generate_async supports n=1 only; use submit_async for n > 1")
        async with aclosing(self.submit_async(self.encode(prompt), params)) as stream:
            async for event in stream:
                if event.result is not None:
                    event.result.raise_for_status()
                elif event.delta.text:
                    yield event.delta.text

    def get_stats(self) -> EngineStats:
        cache = self.cache.stats()
        stats = self.scheduler.stats
        speculator = self.scheduler.speculator
        guesses = speculator.stats if speculator is not None else SpeculationStats()
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=self.manager.num_waiting,
            pages_total=cache.n_pages,
            pages_free=cache.free,
            pages_owned=cache.owned,
            pages_cached=cache.cached,
            prefix_hit_rate=cache.hit_rate,
            prompt_tokens=stats.prompt_tokens,
            generation_tokens=stats.generation_tokens,
            preemptions=stats.preemptions,
            speculative_steps=guesses.steps,
            proposed_tokens=guesses.proposed,
            accepted_tokens=guesses.accepted,
        )


def _map_results(results, fn):
    if isinstance(results, TaskResult):
        return fn(results)
    return [_map_results(r, fn) for r in results]


def _pixels_digest(pixel_values: torch.Tensor, feature_rows: torch.Tensor | None) -> bytes:
    """A tile's key in the prefix cache: a hash of its pixel values and their shape (two images
    of one size and different pixels, or of the same bytes laid out otherwise, differ), and of
    the features its tokens take (LLaVA-NeXT's depend on the image's size too)."""
    digest = hashlib.blake2b(repr(tuple(pixel_values.shape)).encode(), digest_size=16)
    digest.update(pixel_values.numpy().tobytes())
    if feature_rows is not None:
        digest.update(feature_rows.numpy().tobytes())
    return digest.digest()
