"""A step of kernel calls recorded once and replayed: the CPU counterpart of a CUDA graph.

A few-row step (a decode) spends much of its time in Python around the kernels: module calls,
eligibility checks, a fresh tensor for every output. Recording runs the model's own forward
once with every kernel call appended to a list (its arguments resolved to plain pointers) and
every output taken from an arena; replaying calls the list. The model's code is written once;
the graph is a property of how the executor runs it.

A recording holds only if every op that computes in it is a kernel call: a dispatch mode
watches the forward, and any other op (a PyTorch fallback, a torch.cat) voids it. Attention
is the one part that changes from step to step (other pages, other lengths): it is a slot the
replay binds to that step's backend.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

_recording = threading.local()  # .graph: the StepGraph recording on this thread, if any


def launch(fn: Callable[..., object], *args, **kwargs) -> None:
    """fn(*args, **kwargs) now, and again at every replay of the graph recording this thread.

    The caller passes tensors that outlive the graph (arena buffers, weights, the graph's
    inputs) or plain pointers to them.
    """
    fn(*args, **kwargs)
    graph = getattr(_recording, "graph", None)
    if graph is not None:
        graph.calls.append(partial(fn, *args, **kwargs))


def launch_opaque(fn: Callable[..., object], *args) -> None:
    """launch for a call of plain torch ops that is part of the step by design, which the
    recording's check must not count as ops outside the kernels (LoRA's low-rank products:
    fn reads which rows use which adapter when it is called, so a replay follows the step)."""
    with _disable_current_modes():
        fn(*args)
    graph = getattr(_recording, "graph", None)
    if graph is not None:
        graph.calls.append(partial(fn, *args))


def data_addresses(tensors: Sequence[Tensor]) -> list[int]:
    """Where each tensor's data lies: recorded calls hold these addresses, so a tensor that
    moved (.to(), .data = ..., new parameters) voids them."""
    return [t.data_ptr() for t in tensors]


def new_output(shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """An uninitialised kernel output: from the recording graph's arena, or a new tensor."""
    graph = getattr(_recording, "graph", None)
    if graph is None:
        return torch.empty(shape, dtype=dtype)
    return graph.arena.take(shape, dtype)


class Arena:
    """Kernel outputs of recorded steps, shared by every batch size up to max_rows.

    Layer i takes its buffers from set i % 2 and reads only its own and layer i - 1's, so two
    sets serve any depth: the same memory, warm in the cache, for every layer. What a step
    computes before its first layer (the embedding, rope's angles, which every layer reads)
    takes a third set, which no layer writes. Within a set, the n-th buffer a layer asks for
    of a given row shape is always the same one, so a layer that asks for one fewer (the
    first norms without a residual add) does not shift the rest. Buffers are never replaced:
    recorded calls hold their addresses.
    """

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        # per set: (row shape, dtype) -> buffers [max_rows, *row shape]
        self.sets: tuple[dict, dict, dict] = ({}, {}, {})
        self.current = 2  # the set taken from: 2 before the first layer
        self.taken: dict[tuple, int] = {}

    def start_step(self) -> None:
        self.current = 2
        self.taken = {}

    def start_layer(self) -> None:
        self.current = 1 if self.current == 0 else 0
        self.taken = {}

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        rows, *row_shape = shape
        assert rows <= self.max_rows, f"{rows} rows in an arena for {self.max_rows}"
        key = (tuple(row_shape), dtype)
        index = self.taken.get(key, 0)
        self.taken[key] = index + 1
        buffers = self.sets[self.current].setdefault(key, [])
        if index == len(buffers):
            buffers.append(torch.empty(self.max_rows, *row_shape, dtype=dtype))
        return buffers[index][:rows]


class _KernelsOnly(TorchDispatchMode):
    """Notes every op that computes outside a kernel call: views and allocations are free,
    astrai's custom ops are kernel calls (what they do inside is not seen). An op that may
    alias its input (contiguous, reshape) counts as a view only if it did."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Otherwise TorchDispatchMode wraps __torch_dispatch__ to keep torch._dynamo out of it,
        # and the wrapper imports torch._dynamo (about a second) on the first recording; no
        # step is compiled while one is recorded.
        return False

    def __init__(self):
        super().__init__()
        self.stray: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (
            func.namespace != "astrai"
            and func not in _ALLOCATIONS
            and not _aliased(func, args, out)
        ):
            self.stray.append(str(func))
        return out


def _aliased(func, args, out) -> bool:
    """Whether a view op returned views of its first argument's memory."""
    if not func.is_view:
        return False
    base = args[0].untyped_storage().data_ptr()
    outs = out if isinstance(out, tuple | list) else (out,)
    return all(t.untyped_storage().data_ptr() == base for t in outs)


_ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default}


class StepGraph:
    """One recorded step: kernel calls with bound arguments, and attention slots."""

    def __init__(self, arena: Arena):
        self.arena = arena
        self.calls: list[Callable[[], object] | None] = []
        # (layer, q, k, v, out) of each None in calls: bound to each replay's attention backend;
        # layer is what the model hands its backend (astrai.model's LayerAttention)
        self.slots: list[tuple[object, Tensor, Tensor, Tensor, Tensor]] = []
        self.stray: list[str] = []
        # the attention calls bound once, reading a kernel_step copied in at each replay
        self.kernel_step: Tensor | None = None
        self.attention_calls: list[Callable[[], object]] = []

    @property
    def valid(self) -> bool:
        """Whether the recording caught the whole step (no op ran outside a kernel call)."""
        return not self.stray

    @contextmanager
    def record(self, layers: Sequence[nn.Module]) -> Iterator[None]:
        """Record the kernel calls run inside; each of layers starts a new arena set."""

        def start_layer(*_) -> None:
            if getattr(_recording, "graph", None) is self:  # not another thread's forward
                self.arena.start_layer()

        hooks = [layer.register_forward_pre_hook(start_layer) for layer in layers]
        mode = _KernelsOnly()
        self.arena.start_step()
        _recording.graph = self
        try:
            with mode:
                yield
        finally:
            _recording.graph = None
            for hook in hooks:
                hook.remove()
            self.stray = mode.stray

    def attention(self, backend) -> Callable[..., Tensor]:
        """The attention backend to record through: attends with backend now and leaves a slot
        that each replay binds to its own backend, for the same q/k/v/out buffers."""

        def attend(layer, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            out = self.arena.take(q.shape, q.dtype)
            with _disable_current_modes():
                backend.bind(layer, q, k, v, out)()
            self.slots.append((layer, q, k, v, out))
            self.calls.append(None)
            return out

        return attend

    def replay(self, backend) -> None:
        """Run the recorded calls, attention bound to backend (which offers bind()) as each
        slot is reached, so the binding sees this step's q/k/v.

        A backend whose step is one kernel's inputs (a kernel_step tensor: decodes alone)
        has its attention calls bound once, to a copy of those inputs that each replay
        refills, instead of once a layer every step.
        """
        kernel_step = getattr(backend, "kernel_step", None)
        if kernel_step is None:
            slots = iter(self.slots)
            for call in self.calls:
                (call or backend.bind(*next(slots)))()
            return
        if self.kernel_step is None:
            self.kernel_step = torch.empty_like(kernel_step)
            self.attention_calls = [
                backend.bind(*slot, step=self.kernel_step) for slot in self.slots
            ]
        self.kernel_step.copy_(kernel_step)
        attention_calls = iter(self.attention_calls)
        for call in self.calls:
            (call or next(attention_calls))()
