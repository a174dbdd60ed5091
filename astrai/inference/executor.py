"""Runs one planned step: flattens it into a single ragged batch, runs the model, samples."""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial, wraps

import numpy as np
import torch

from astrai.inference.attention import CacheView, DeviceCacheView, ragged_layout
from astrai.inference.constraints import BatchMasker, ConstraintState, TokenMask
from astrai.inference.kv_cache import KVStore
from astrai.inference.mrope import plain_positions
from astrai.inference.sample import SamplingBatch, SamplingPipeline, sample
from astrai.inference.step_batch import ImageRows, StepBatch
from astrai.inference.task import PromptImage, Task, TokenLogprob
from astrai.kernels import (
    SKINNY_MAX_ROWS,
    Arena,
    KernelPlan,
    StepGraph,
    data_addresses,
    tune_kernels,
)
from astrai.kernels.kernel_plan import DEFAULT_ACTIVATION_PRECISION
from astrai.kernels.paged_attention import PagedDecode
from astrai.model.lora import AdapterTable, row_adapters

log = logging.getLogger("astrai.executor")


@dataclass(eq=False)
class ScheduledChunk:
    """The tokens of one task that a step feeds: positions start .. start + length - 1.

    A speculative chunk is a decode row followed by draft, guessed tokens the step checks
    (speculative.py); the executor sets accepted to how many of them were kept.
    """

    task: Task
    start: int
    length: int
    draft: list[int] = field(default_factory=list)
    # A constrained task's grammar state after each draft token, for the masks of its rows.
    draft_states: list[ConstraintState] | None = None
    accepted: int = 0
    # Set by the executor too: the logprobs of the prompt tokens the chunk's rows predict (None
    # when the task wants none), and an embedding task's pooled final hidden states.
    prompt_logprobs: list[TokenLogprob] | None = None
    pooled: torch.Tensor | None = None

    @property
    def reaches_end(self) -> bool:
        """Whether the chunk feeds the task's last token (a prompt-only task's last chunk)."""
        return self.start + self.length == self.task.num_tokens + len(self.draft)

    @property
    def samples(self) -> bool:
        """A chunk that reaches the task's last token yields the logits of its next token,
        unless the task computes its prompt only."""
        return self.reaches_end and not self.task.prompt_only

    @property
    def scored_rows(self) -> int:
        """How many of the chunk's rows predict a prompt token whose logprob the task wants:
        every row before the prompt's last token."""
        if not self.task.needs_prompt_logprobs:
            return 0
        return max(0, min(self.start + self.length, len(self.task.prompt_ids) - 1) - self.start)

    def pooled_rows(self) -> range:
        """The rows (0 is the chunk's first) whose final hidden states an embedding task
        pools: every row for a mean, the prompt's last for "last"."""
        if self.task.pooling == "mean":
            return range(self.length)
        if self.task.pooling == "last" and self.reaches_end:
            return range(self.length - 1, self.length)
        return range(0)

    def token_ids(self) -> list[int]:
        """The chunk's token ids, sliced without building the task's whole prompt + output."""
        prompt, output = self.task.prompt_ids, self.task.output_ids
        end = self.start + self.length - len(self.draft)
        if self.start >= len(prompt):
            known = output[self.start - len(prompt) : end - len(prompt)]
        else:
            known = prompt[self.start : end] + output[: max(0, end - len(prompt))]
        return known + self.draft


class ExecutorFailedError(RuntimeError):
    """The executor can run no further step (a tensor-parallel rank is gone): the engine
    stops, where an ordinary step failure ends only the requests that fail alone."""


@dataclass
class SampledToken:
    task: Task
    token_id: int
    logprob: TokenLogprob | None


OMP_PAUSE_HARD = 2


def release_openmp_workers() -> None:
    """Free the calling thread's OpenMP worker pool (a no-op without OpenMP 5 in the process).

    The model runs on the scheduler's thread, but the thread that built the engine usually ran
    torch ops before (loading the weights) and so owns an idle pool of OpenMP workers. With one
    more pool than the cores can hold, libgomp stops spinning at barriers and sleeps instead,
    and every parallel op of a step pays a wake-up (benchmarks/README.md has the cost).
    """
    try:
        pause = ctypes.CDLL(None).omp_pause_resource_all
    except (AttributeError, OSError):
        return
    pause(OMP_PAUSE_HARD)


@dataclass
class RecordedStep:
    """A recorded forward of the layers for one batch size: its inputs, graph and outputs."""

    inputs: tuple[torch.Tensor, ...]  # h, cos and signed_sin, or token ids and positions
    graph: StepGraph
    # the last feed-forward output and the residual stream, or the LM head's output
    outputs: tuple[torch.Tensor, torch.Tensor] | torch.Tensor


class RecordedLayers:
    """The model's layers recorded once per batch size of up to SKINNY_MAX_ROWS rows on the
    CPU, and replayed: a few-row step is then its kernel calls and little else. A step that
    wants the logits of every row (a step of decodes) records the final norm and the LM head
    with them.

    A batch size whose forward cannot be recorded (an op outside the kernels, as Qwen3's q/k
    norm) runs the layers eagerly from then on. Graphs hold the weights' pointers, so weights
    that moved (.to(), load_state_dict(assign=True), .data = ...) drop them, found by a look
    at every parameter's address before a step. The weights' storage is held as well, so that
    a step of run_ids told the look may wait (a decode continuing the last step's) reads
    moved weights as they were, never freed memory; weights moved so stay allocated until the
    next look.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        # by (rows, head): head True takes in the final norm and the LM head, "ids" the
        # embedding and rope's lookups too (run_ids)
        self.steps: dict[tuple[int, bool | str], RecordedStep | None] = {}
        self.arena = Arena(SKINNY_MAX_ROWS)
        # Each module's parameter dict, which load_state_dict(assign=True) updates in place:
        # reading the weights' addresses through them costs little enough for every step.
        self.parameters = [m._parameters for m in model.modules() if m._parameters]
        # rope's tables that graphs from token ids read
        self.tables: tuple[torch.Tensor, ...] = ()
        self.addresses: list[int] = []
        self.held: list[torch.UntypedStorage] = []  # what the graphs read, kept alive
        self._check_addresses()

    def run(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        view: CacheView,
        head: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """What model.run_layers returns, or with head the LM head's output for every row
        (before Transformer.scaled_logits); views of the graph's buffers, valid until next run.
        A head that cannot be recorded (an op outside the kernels) runs after the recorded
        layers."""
        rows = h.shape[0]
        if rows > SKINNY_MAX_ROWS:
            return self._forward(head, h, cos, signed_sin, view)
        self._check_addresses()
        key = (rows, head)
        if self.steps.get(key, True) is None:
            if head:
                return self._head(*self.run(h, cos, signed_sin, view))
            return self.model.run_layers(h, cos, signed_sin, view)
        return self._replay_or_record(key, (h, cos, signed_sin), partial(self._forward, head), view)

    def run_ids(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        top: int,
        view: CacheView,
        continued: bool = False,
    ) -> torch.Tensor:
        """The LM head's output for every row of a step of token ids at positions [rows]
        (int64; top the highest position): with the embedding and rope's table lookups
        recorded too where they can be (one rope, an embedding of kernel calls alone), else
        run(..., head=True) after them. A view of the graph's buffers, valid until next run.

        continued: the step is the next decode of the last step's sequences, so a replay does
        not look at the weights' addresses (a look at every parameter, cold, is a part of a
        small model's step, benchmarks/README.md); weights moved while they decode are read as
        they were until a step that is not continued. A recording always looks, so that what
        it reads is held."""
        model, key = self.model, (len(ids), "ids")
        if key[0] > SKINNY_MAX_ROWS or self.steps.get(key, True) is None:
            return self.run(*model.embed(ids, positions, top=top), view, head=True)
        if not continued:
            self._check_addresses()
        if model.rope.tables is not None:
            # Such a graph reads rope's tables where they were when it was recorded: cover the
            # step's positions first (no recording grows them then), drop the graphs if the
            # tables moved (grown by another step, rebuilt after .to()), and hold the tables
            # the graphs read, whatever replaces them on the model (another engine's step).
            tables = model.rope.covering(top + 1, model.rope.tables[0].dtype)
            if data_addresses(tables) != data_addresses(self.tables):
                self.steps = {k: step for k, step in self.steps.items() if k[1] != "ids"}
                self.tables = tables

        if continued and key not in self.steps:
            self._check_addresses()

        def forward(ids, positions, attention):
            return self._forward(True, *model.embed(ids, positions, top=top), attention)

        recording = key not in self.steps
        outputs = self._replay_or_record(key, (ids, positions), forward, view)
        if recording:
            self.tables = model.rope.tables  # what the recording read
        return outputs

    def _replay_or_record(self, key, inputs: tuple, forward: Callable, view: CacheView):
        """forward(*inputs, attention) as the recorded step key: replayed, or recorded while
        running if key is new (the result is this step's either way; key then maps to None
        if the step cannot be recorded)."""
        step = self.steps.get(key)
        if step is None:
            static = tuple(t.clone() for t in inputs)
            graph = StepGraph(self.arena)
            with graph.record(self.model.layers):
                outputs = forward(*static, graph.attention(view))
            self.steps[key] = RecordedStep(static, graph, outputs) if graph.valid else None
            return outputs
        for static, new in zip(step.inputs, inputs, strict=True):
            static.copy_(new)
        step.graph.replay(view)
        return step.outputs

    def _check_addresses(self) -> None:
        """Drop every graph if a weight moved, and hold the weights' storage."""
        weights = self._weights()
        addresses = data_addresses(weights)
        if addresses != self.addresses:
            self.steps.clear()
            self.arena = Arena(SKINNY_MAX_ROWS)
            self.addresses = addresses
            self.held = [w.untyped_storage() for w in weights]
            self.tables = ()

    def _forward(self, head: bool, h, cos, signed_sin, attention):
        outputs = self.model.run_layers(h, cos, signed_sin, attention)
        return self._head(*outputs) if head else outputs

    def _head(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.model.output(self.model.final_hidden(h, residual, None))

    def _weights(self) -> list[torch.Tensor]:
        return [w for params in self.parameters for w in params.values() if w is not None]


class DecodeLayout:
    """A step of decodes alone on the C attention kernel, laid out once (its StepBatch and
    CacheView) and advanced in place while the same tasks decode step after step: each
    position and context length moves on by one, a table takes the page its next position
    opens, and the tokens are the ones just sampled. A step it cannot describe so (another
    task or order, a prompt chunk, guesses, a table wider than the layout's) is laid out
    afresh."""

    def __init__(self, tasks: list[Task], batch: StepBatch):
        self.tasks = tasks
        self.batch = batch
        self.view: CacheView | None = None  # made by the step that runs it first

    @classmethod
    def of(cls, chunks: Sequence[ScheduledChunk], batch: StepBatch, kv: KVStore):
        """The layout of the step of chunks laid out as batch, or None where it cannot be
        advanced in place."""
        plain = batch.decodes_only and batch.key_ends is None and PagedDecode.supports(kv.k_cache)
        if not plain or not all(map(_decodes_output, chunks)):
            return None
        return cls([chunk.task for chunk in chunks], batch)

    def advance(self, chunks: Sequence[ScheduledChunk], pages: Callable[[int], list[int]]):
        """The layout's StepBatch moved on to the step of chunks, or None (nothing changed)
        if the chunks are not each the next decode of the layout's tasks."""
        batch = self.batch
        if self.view is None or len(chunks) != len(self.tasks):
            return None
        starts, tables, page_size = batch.starts, batch.block_tables, batch.page_size
        opened: list[tuple[int, int, int]] = []  # row, table index, page
        for row, (chunk, task) in enumerate(zip(chunks, self.tasks, strict=True)):
            start = chunk.start
            if chunk.task is not task or start != starts[row] + 1 or not _decodes_output(chunk):
                return None
            if start % page_size == 0:
                index, table = start // page_size, pages(task.id)
                if index >= tables.shape[1] or index >= len(table):
                    return None
                opened.append((row, index, table[index]))
        for row, index, page in opened:
            tables[row, index] = page
            batch.table_lengths[row] = index + 1
        # Item by item: a NumPy or torch op on the arrays would cost more, run cold after the
        # weights went through the cache. The view's positions tensor shares starts.
        context_lens, token_ids = self.view.paged_decode.context_lens.numpy(), batch.token_ids
        for row, chunk in enumerate(chunks):
            starts[row] = chunk.start
            context_lens[row] = chunk.start + 1
            token_ids[row] = chunk.token_ids()[0]
        return batch


def _decodes_output(chunk: ScheduledChunk) -> bool:
    """Whether the chunk is a plain decode of a generated token (which samples the next one,
    and scores and pools nothing)."""
    return chunk.length == 1 and not chunk.draft and chunk.start >= len(chunk.task.prompt_ids)


class HostToDevice:
    """A step's int64 host arrays copied to the device in one transfer, through a pinned
    buffer reused from step to step (the copy overlaps the host's work; nothing waits on it)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"
        self.host = torch.empty(0, dtype=torch.int64)
        self.copied: torch.cuda.Event | None = None  # the last copy out of self.host

    def __call__(
        self, arrays: dict[str, np.ndarray], out: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """Views of one device buffer (out, if given, else a new one) holding the arrays."""
        total = sum(a.size for a in arrays.values())
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copy has read the buffer: refill it
        if self.host.numel() < total:
            self.host = torch.empty(2 * total, dtype=torch.int64, pin_memory=self.pinned)
        np.concatenate([a.ravel() for a in arrays.values()], out=self.host[:total].numpy())
        if out is None:
            out = torch.empty(total, dtype=torch.int64, device=self.device)
        out[:total].copy_(self.host[:total], non_blocking=self.pinned)
        if self.pinned:
            self.copied = torch.cuda.Event()
            self.copied.record()
        views, offset = {}, 0
        for name, array in arrays.items():
            views[name] = out[offset : offset + array.size].view(array.shape)
            offset += array.size
        return views


@dataclass
class CapturedDecode:
    """A decode step of a fixed number of rows captured as a CUDA graph: its packed inputs
    (ragged_layout's arrays back to back, refilled before each replay) and the logits it
    leaves."""

    inputs: torch.Tensor
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor


# Decode batch sizes a CUDA graph is captured for; a step pads its rows up to the next one.
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class CudaSteps:
    """The forward pass on CUDA: Triton paged attention over the ragged batch, and decode steps
    replayed from CUDA graphs, one per batch-size bucket (captured when the engine starts; a
    step pads its rows to its bucket), so a decode step is one graph launch. Steps with prompt
    chunks, or more decode rows than the largest bucket, run eagerly, as does every step of a
    model whose forward cannot be captured.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVStore,
        max_rows: int,
        max_seq_len: int,
        graphs: bool,
    ):
        self.model = model
        self.kv = kv
        self.n_heads = model.config.n_heads
        self.dim = model.config.dim
        self.upload = HostToDevice(kv.k_cache.device)
        self.buckets = [b for b in GRAPH_BATCH_SIZES if b < max_rows] if graphs else []
        if graphs and max_rows <= GRAPH_BATCH_SIZES[-1]:
            self.buckets.append(next(b for b in GRAPH_BATCH_SIZES if b >= max_rows))
        self.graphs: dict[int, CapturedDecode] = {}
        self.pool = None  # the memory pool the graphs share
        # Every recorded step's page tables are this wide: the pages of the longest sequence.
        self.table_width = min(-(-max_seq_len // kv.page_size), kv.n_pages)
        if self.buckets:
            start = time.perf_counter()
            for bucket in reversed(self.buckets):  # the largest first: the rest reuse its memory
                captured = self._capture(bucket)
                if captured is None:
                    break
                self.graphs[bucket] = captured
            log.info(
                "decode steps of %s rows captured as CUDA graphs in %.1f s",
                sorted(self.graphs),
                time.perf_counter() - start,
            )

    def forward(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ModelExecutor.forward's logits and hidden states; logits from a graph are valid
        until the next step."""
        n_seqs = batch.n_seqs
        if self.graphs and n_seqs <= self.buckets[-1] and batch.decodes_only:
            bucket = next(b for b in self.buckets if b >= n_seqs)
            captured = self.graphs[bucket]
            self.upload(ragged_layout(batch, 1, bucket - n_seqs, self.table_width), captured.inputs)
            captured.graph.replay()
            # pooling rows come with prompt chunks, which take no graph: none here
            hidden = None if batch.hidden_rows is None else captured.logits.new_empty(0, self.dim)
            if batch.logits_of_every_row:
                return captured.logits[:n_seqs], hidden
            rows = torch.from_numpy(batch.logit_rows).to(captured.logits.device)
            return captured.logits[rows], hidden
        view = DeviceCacheView.build(
            self.kv, batch, self.n_heads, self.upload, logit_rows=batch.logit_rows,
            rope_positions=batch.rope_positions,
        )  # fmt: skip
        hidden = None if batch.hidden_rows is None else torch.from_numpy(batch.hidden_rows)
        return self._run(view, view.fields["logit_rows"], hidden, batch.images)

    def _run(
        self,
        view: DeviceCacheView,
        rows: torch.Tensor | None,
        hidden_rows: torch.Tensor | None = None,
        images: ImageRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits of rows, and the final hidden states of hidden_rows (None without)."""
        model = self.model
        # An eager step's rope positions (M-RoPE's are [3, num_tokens]); a graph's, its positions
        positions = view.fields.get("rope_positions", view.positions)
        h, cos, signed_sin = model.embed(view.token_ids, positions, view.rope_lengths)
        if images is not None:
            images.place(h)
        h, residual = model.run_layers(h, cos, signed_sin, view)
        logits = model.logits(h, residual, rows)
        if hidden_rows is None:
            return logits, None
        return logits, model.final_hidden(h, residual, hidden_rows.to(h.device))

    def _capture(self, bucket: int) -> CapturedDecode | None:
        """Record the decode step of bucket rows (all padding while it records: nothing is
        stored), after one eager run that compiles the kernels; None if it cannot be
        (a model whose forward reads values back to the host, as MoE routing does)."""
        device = self.kv.k_cache.device
        padding = ragged_layout(StepBatch.empty(self.kv.page_size), 1, bucket, self.table_width)
        total = sum(array.size for array in padding.values())
        inputs = torch.zeros(total, dtype=torch.int64, device=device)
        view = DeviceCacheView(self.kv, self.upload(padding, out=inputs), block_q=1)
        try:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                self._run(view, None)  # compiles the kernels, which capturing cannot
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self.pool):
                logits, _ = self._run(view, None)
        except RuntimeError as error:
            log.warning("decode steps run eagerly: capturing them failed (%s)", error)
            torch.cuda.synchronize(device)
            self.graphs.clear()  # what failed at one size fails at every size
            return None
        return CapturedDecode(inputs, graph, logits)


def _in_inference_mode(method: Callable) -> Callable:
    """method under torch.inference_mode, entered only where its caller is not in it already
    (execute's forward): entering, run cold after the weights went through the cache, costs
    several times the check (benchmarks/README.md)."""

    @wraps(method)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return method(*args, **kwargs)
        with torch.inference_mode():
            return method(*args, **kwargs)

    return run


class ModelExecutor:
    """Owns the model's forward pass; knows tensors, not scheduling policy."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVStore,
        pages: Callable[[int], list[int]] | None = None,
        pipeline: SamplingPipeline | None = None,
        max_batch_size: int = 256,
        cuda_graphs: bool = False,
        max_seq_len: int | None = None,
        batch_invariant: bool = True,
        activation_precision: str = DEFAULT_ACTIVATION_PRECISION,
        adapters: AdapterTable | None = None,
    ) -> None:
        """kv holds the K/V tensors; pages gives a task's page table (the engine's PagedCache's),
        with which execute lays out its steps (a tensor-parallel worker, sent its steps laid
        out, has none). On CUDA, cuda_graphs replays decode steps from CUDA graphs
        (CudaSteps), whose page tables have room for max_seq_len tokens (default: the model's
        context); with LoRA adapters steps run eagerly. On the CPU, the linears' paths are timed
        into this executor's KernelPlan, which its steps run on: batch_invariant keeps
        quantized linears on their kernel at every batch size, and the kernel quantizes their x
        at activation_precision. Each step tells adapters which rows use which adapter."""
        self.model = model
        self.adapters = adapters
        self.kv = kv
        self.pages = pages
        self.pipeline = pipeline or SamplingPipeline()
        self.max_batch_size = max_batch_size  # the most rows a step samples
        self.masker: BatchMasker | None = None  # made with the first constrained row
        self.device = next(model.parameters()).device
        self.recorded: RecordedLayers | None = None
        self.cuda_steps: CudaSteps | None = None
        if self.device.type == "cuda":
            max_seq_len = max_seq_len or model.config.max_len
            graphs = cuda_graphs and adapters is None
            self.cuda_steps = CudaSteps(model, kv, max_batch_size, max_seq_len, graphs)
        self.kernel_plan = KernelPlan(batch_invariant, activation_precision)
        if self.device.type == "cpu":
            self.kernel_plan = tune_kernels(model, batch_invariant, activation_precision)
            self.recorded = RecordedLayers(model)
            release_openmp_workers()  # after the timing, which ran on this thread's pool
        self.layout: DecodeLayout | None = None  # the last step's, if it was decodes alone

    @_in_inference_mode
    def forward(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float32 logits [len(logit_rows), vocab] of the batch's logit rows, and the final
        hidden states [len(hidden_rows), dim] of its hidden rows (None without them)."""
        if self.cuda_steps is not None:
            return self.cuda_steps.forward(batch)
        with self.kernel_plan.active():
            return self._forward_on_cpu(batch)

    def _forward_on_cpu(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        layout = self.layout if self.layout is not None and self.layout.batch is batch else None
        continued = layout is not None and layout.view is not None  # it ran a step before
        view = layout.view if continued else CacheView(self.kv, batch)
        if layout is not None:
            layout.view = view
        model = self.model
        lengths = None
        if model.rope.length_dependent:
            lengths = torch.from_numpy(batch.rope_lengths).to(self.device)
        token_ids = torch.from_numpy(batch.token_ids).to(self.device)
        positions = view.positions
        every_row = batch.logits_of_every_row
        if self.recorded is not None and every_row and batch.decodes_only and lengths is None:
            top = int(batch.positions.max()) if batch.n_seqs else 0
            logits = self.recorded.run_ids(token_ids, positions, top, view, continued)
            return model.scaled_logits(logits), None
        if batch.mrope_positions is not None:
            positions = torch.from_numpy(batch.mrope_positions).to(self.device)
        h, cos, signed_sin = model.embed(token_ids, positions, lengths)
        if batch.images is not None:
            batch.images.place(h)
        if self.recorded is not None and every_row and batch.hidden_rows is None:
            return model.scaled_logits(self.recorded.run(h, cos, signed_sin, view, head=True)), None
        if self.recorded is not None:
            h, residual = self.recorded.run(h, cos, signed_sin, view)
        else:
            h, residual = model.run_layers(h, cos, signed_sin, view)
        rows = None
        if not every_row:
            rows = torch.from_numpy(batch.logit_rows).to(self.device)
        logits = model.logits(h, residual, rows)
        if batch.hidden_rows is None:
            return logits, None
        indices = torch.from_numpy(batch.hidden_rows).to(self.device)
        return logits, model.final_hidden(h, residual, indices)

    @_in_inference_mode
    def execute(self, chunks: Sequence[ScheduledChunk]) -> list[SampledToken]:
        """Run the chunks as one forward pass and sample each sampling chunk's next token; a
        speculative chunk yields its kept draft tokens and then the target's own, in order.

        Prompt chunks that owe prompt logprobs or pool an embedding get them set on the chunk
        (ScheduledChunk.prompt_logprobs, .pooled) from the same pass."""
        batch = None if self.layout is None else self.layout.advance(chunks, self.pages)
        if batch is not None:  # the next decodes of the last step's tasks
            self._begin_adapters(chunks)
            logits, _ = self.forward(batch)
            return self._sample(chunks, logits)
        # Python lists, not NumPy, for the few values of a step: each NumPy call costs more
        # than the arithmetic, all the more just after the weights went through the cache.
        token_ids: list[int] = []
        starts: list[int] = []  # each chunk's first row
        for chunk in chunks:
            starts.append(len(token_ids))
            token_ids.extend(chunk.token_ids())
        sampling = [chunk for chunk in chunks if chunk.samples]
        # A row of logits for a chunk's last token, and for each token before its draft ones;
        # after them, the rows that score prompt tokens.
        scored = [(c, start) for c, start in zip(chunks, starts, strict=True) if c.scored_rows]
        rows = [
            row
            for chunk, start in zip(chunks, starts, strict=True)
            if chunk.samples
            for row in range(start + chunk.length - 1 - len(chunk.draft), start + chunk.length)
        ]
        n_sampled = len(rows)
        rows += [row for chunk, start in scored for row in range(start, start + chunk.scored_rows)]
        pooling = [(c, start) for c, start in zip(chunks, starts, strict=True) if c.task.pooling]
        hidden_rows = None
        if pooling:
            hidden_rows = _concatenated(
                [start + np.array(chunk.pooled_rows()) for chunk, start in pooling]
            )

        # A speculative chunk runs as one decode row per token, so each row attends exactly
        # as plain decoding would at its position (the same kernel, the same sums).
        seqs = [
            seq
            for c in chunks
            for seq in (
                [(c.task.id, c.start + i, 1) for i in range(c.length)]
                if c.draft
                else [(c.task.id, c.start, c.length)]
            )
        ]
        spans = [len(c.task.prompt_ids) for c in chunks for _ in range(c.length if c.draft else 1)]
        self._begin_adapters(chunks)
        images = self._image_rows(chunks)
        mrope_positions = None
        if any(c.task.mrope is not None for c in chunks):
            mrope_positions = np.concatenate(
                [
                    plain_positions(c.start, c.length)
                    if c.task.mrope is None
                    else c.task.mrope.rows(c.start, c.length)
                    for c in chunks
                ],
                axis=1,
            )
        batch = StepBatch.build(
            seqs, token_ids, self.pages, self.kv.page_size, spans, rows, hidden_rows, images,
            mrope_positions, _key_ends(chunks, starts),
        )  # fmt: skip
        self.layout = None if self.recorded is None else DecodeLayout.of(chunks, batch, self.kv)
        logits, hidden = self.forward(batch)
        if images is not None:
            self._release_images(chunks)
        if pooling:
            self._pool(hidden, [chunk for chunk, _ in pooling])
        if scored:
            self._score_prompts(logits[n_sampled:], [chunk for chunk, _ in scored])
            logits = logits[:n_sampled]
        if not sampling:
            return []
        return self._sample(sampling, logits)

    def _begin_adapters(self, chunks: Sequence[ScheduledChunk]) -> None:
        if self.adapters is not None:
            self.adapters.begin_step(
                *row_adapters([c.task.adapter for c in chunks], [c.length for c in chunks])
            )

    def _sample(
        self, sampling: Sequence[ScheduledChunk], logits: torch.Tensor
    ) -> list[SampledToken]:
        """The sampling chunks' tokens from their rows of logits, in order."""
        # Row i of a speculative chunk samples as plain decoding would after its first i
        # draft tokens: its own output so far, grammar state and seeded draw.
        row_tasks = [c.task for c in sampling for _ in range(len(c.draft) + 1)]
        outputs = [
            c.task.output_ids + c.draft[:i] if i else c.task.output_ids
            for c in sampling
            for i in range(len(c.draft) + 1)
        ]
        batch = SamplingBatch.build(
            [t.params for t in row_tasks],
            [t.prompt_ids for t in row_tasks],
            outputs,
            self.device,
            stop_token_ids=[t.stop_token_ids for t in row_tasks],
            mask=self._constraint_mask(
                [
                    state
                    for c in sampling
                    for state in (c.task.constraint, *(c.draft_states or [None] * len(c.draft)))
                ]
            ),
        )
        out = sample(logits, batch, self.pipeline)
        results = []
        row = 0
        for chunk in sampling:
            task = chunk.task
            for i in range(len(chunk.draft) + 1):
                logprob = None
                if task.params.logprobs is not None and out.logprobs is not None:
                    top = out.top_logprobs[row + i] if out.top_logprobs is not None else []
                    logprob = TokenLogprob(out.token_ids[row + i], out.logprobs[row + i], top)
                token = out.token_ids[row + i]
                results.append(SampledToken(task, token, logprob))
                if i == len(chunk.draft) or token != chunk.draft[i]:
                    chunk.accepted = i
                    break
            row += len(chunk.draft) + 1
        return results

    @staticmethod
    def _pool(hidden: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> None:
        """Set each pooling chunk's pooled hidden states: the sum of its rows (the task adds
        the chunks' sums up and divides) or its one row, float32 [dim]."""
        offset = 0
        for chunk in chunks:
            n = len(chunk.pooled_rows())
            if n:
                chunk.pooled = hidden[offset : offset + n].float().sum(0).cpu()
            offset += n

    @staticmethod
    def _score_prompts(logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> None:
        """Set each chunk's prompt logprobs from its scored rows' logits [rows, vocab]: the
        next prompt token's logprob and rank, and the task's top-k alternatives."""
        targets = [
            token
            for chunk in chunks
            for token in chunk.task.prompt_ids[chunk.start + 1 :][: chunk.scored_rows]
        ]
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.gather(1, torch.tensor(targets, device=logits.device)[:, None])
        ranks = (logprobs > chosen).sum(-1).add_(1).tolist()
        chosen = chosen[:, 0].tolist()
        k = max(chunk.task.params.prompt_logprobs for chunk in chunks)
        top_logprobs, top_ids = (t.tolist() for t in logprobs.topk(k, dim=-1)) if k else ([], [])
        row = 0
        for chunk in chunks:
            k = chunk.task.params.prompt_logprobs
            entries = []
            for i in range(row, row + chunk.scored_rows):
                top = list(zip(top_ids[i][:k], top_logprobs[i][:k], strict=True)) if k else []
                entries.append(TokenLogprob(targets[i], chosen[i], top, ranks[i]))
            chunk.prompt_logprobs = entries
            row += chunk.scored_rows

    def _image_rows(self, chunks: Sequence[ScheduledChunk]) -> ImageRows | None:
        """The step's image placeholder rows and their embeddings, None if it has none.

        An image is encoded (all the step's new ones in one batch) when a chunk first feeds one
        of its placeholders; a chunk that feeds part of them (chunked prefill) takes the
        embeddings of those positions, so a prompt may be split anywhere.
        """
        wanted: list[tuple[PromptImage, int, int, int]] = []  # image, from, to, first row
        first_row = 0
        for chunk in chunks:
            end = chunk.start + chunk.length
            for image in chunk.task.images:
                lo, hi = max(image.start, chunk.start), min(image.end, end)
                if lo < hi:
                    wanted.append(
                        (image, lo - image.start, hi - image.start, first_row + lo - chunk.start)
                    )
            first_row += chunk.length
        if not wanted:
            return None
        new = list({id(image): image for image, *_ in wanted if image.embeddings is None}.values())
        if new:
            pixels = [image.pixel_values.to(self.device) for image in new]
            with self.kernel_plan.active():  # the encoder's linears are the model's too
                encoded = self.model.vision.encode_images(pixels)
            for image, embeddings in zip(new, encoded, strict=True):
                rows = image.feature_rows
                # [image.length, dim]
                image.embeddings = embeddings if rows is None else embeddings[rows.to(self.device)]
        rows = torch.cat([torch.arange(row, row + hi - lo) for _, lo, hi, row in wanted])
        embeddings = torch.cat([image.embeddings[lo:hi] for image, lo, hi, _ in wanted])
        return ImageRows(rows.to(self.device), embeddings)

    @staticmethod
    def _release_images(chunks: Sequence[ScheduledChunk]) -> None:
        """Drop the embeddings of images whose placeholders are all computed now."""
        for chunk in chunks:
            for image in chunk.task.images:
                if image.end <= chunk.start + chunk.length:
                    image.embeddings = None

    def _constraint_mask(self, states: Sequence[ConstraintState | None]) -> TokenMask | None:
        """The grammar masks of the sampling rows whose tasks are constrained, or None."""
        if all(state is None for state in states):
            return None
        if self.masker is None:
            self.masker = BatchMasker(self.max_batch_size, self.model.config.vocab_size)
        return self.masker.fill(states)


def _key_ends(chunks: Sequence[ScheduledChunk], first_rows: Sequence[int]) -> np.ndarray | None:
    """StepBatch.key_ends of the chunks, whose rows start at first_rows: the end of each image
    whose tokens see each other for the rows of its tokens, position + 1 for the others; None
    when no chunk computes such a token. schedule() keeps each such image whole in one chunk
    (or the rest of it after a prefix-cache hit), so every key a row sees is in the cache."""
    ends = None
    for chunk, first_row in zip(chunks, first_rows, strict=True):
        chunk_end = chunk.start + chunk.length
        for image in chunk.task.images:
            lo, hi = max(image.start, chunk.start), min(image.end, chunk_end)
            if not image.bidirectional or lo >= hi:
                continue
            assert image.end <= chunk_end, "a chunk computes an image that sees itself to its end"
            if ends is None:
                ends = np.concatenate([c.start + 1 + np.arange(c.length) for c in chunks])
            ends[first_row + lo - chunk.start : first_row + hi - chunk.start] = image.end
    return ends


def _concatenated(arrays: list[np.ndarray]) -> np.ndarray:
    """The arrays back to back as int64; an empty one for none."""
    return np.concatenate(arrays).astype(np.int64) if arrays else np.zeros(0, dtype=np.int64)
