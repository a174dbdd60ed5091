"""LoRA adapters: read from PEFT directories and llama.cpp GGUF files, applied per row of a step.

An adapter adds scaling * (x A^T) B^T to some of the model's linears (A [rank, in], B [out,
rank]). astrai fuses q/k/v into one linear and gate/up into another, so the adapter of a
fused linear is its parts' products side by side: each part's A is a block of columns of the
low-rank product, and its B writes that part's rows of the output.

Every loaded adapter holds a slot in each adapted linear's stacks, A [slots * width, in] and
B^T [slots * width, out] (width: the linear's parts times the largest rank). Which slot each
row of a step takes is the step's input, as its page tables are. On the CPU one kernel call
per adapted linear adds every row's own adapter's products (astrai.kernels.lora_ops), and the
recorded steps replay it with each step's rows. Elsewhere (CUDA, fp16) the step groups its rows
by adapter and, for each adapter it holds, multiplies those rows by that slot's A and B^T in
PyTorch: two products and a gather and scatter an adapter a linear.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as decode_blocks
from safetensors import safe_open
from torch import Tensor

from astrai.config import ConfigError
from astrai.kernels import Linear, launch_opaque, lora_ops
from astrai.model.families import FAMILIES, Family, gguf_family
from astrai.model.families.gguf_metadata import metadata_value
from astrai.model.transformer import Transformer
from astrai.model.weights.gguf import unpermute_rotary_rows
from astrai.model.weights.gguf_layout import check_gguf_layout

# The linears an adapter may change, by their names below layers.N.
ADAPTED_LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
# adapter_config.json settings astrai does not apply, with the value that means "unused".
UNAPPLIED_PEFT_SETTINGS = {
    "modules_to_save": None,
    "use_dora": False,
    "fan_in_fan_out": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layers_to_transform": None,
    "bias": "none",
}
_PEFT_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")
_GGUF_KEY = re.compile(r"^blk\.(\d+)\.(.+)\.lora_([ab])$")


class LoraError(ConfigError):
    """An adapter that cannot be loaded or served; the message says which and why."""


class UnknownAdapterError(LoraError):
    """A request names an adapter that is not loaded."""


@dataclass(frozen=True)
class Target:
    """Where a Hugging Face linear (self_attn.q_proj) lies in astrai's model: part `part` of
    `parts` of the native linear, as `family` lays the linear's rows out."""

    family: Family
    linear: str
    part: int
    parts: int


def _targets() -> dict[str, Target]:
    """Every family's Hugging Face names of the adapted linears' parts."""
    targets: dict[str, Target] = {}
    for family in FAMILIES:
        for linear in ADAPTED_LINEARS:
            sources = family.hf_layer_names.get(linear + ".weight", ())
            for part, source in enumerate(sources):
                target = Target(family, linear, part, len(sources))
                targets.setdefault(source.removesuffix(".weight"), target)
    return targets


TARGETS = _targets()
# The most parts of one native linear: its stacks hold this many blocks of columns per slot.
MAX_PARTS = {
    linear: max(t.parts for t in TARGETS.values() if t.linear == linear)
    for linear in ADAPTED_LINEARS
}


@dataclass(eq=False)
class LoraAdapter:
    """One adapter's products for the model it was read for: (layer, native linear) ->
    [(part, the rows of the linear's output it writes, A [rank, in], B [rows, rank])], and
    its scaling."""

    name: str
    source: str
    rank: int
    scaling: float
    products: dict[tuple[int, str], list[tuple[int, slice, Tensor, Tensor]]]
    # What KV computed under this adapter is cached under: a new load is a new adapter.
    prefix_key: bytes = field(default_factory=lambda: os.urandom(16))
    slot: int = -1
    # The tasks submitted with it: its slot is reused only once they have all ended.
    tasks: weakref.WeakSet = field(default_factory=weakref.WeakSet)

    def in_use(self) -> bool:
        return any(not task.is_finished for task in list(self.tasks))


def read_adapter(name: str, path: str | Path, model: Transformer) -> LoraAdapter:
    """The adapter at path (a PEFT directory or a GGUF LoRA file), checked against model."""
    path = Path(path)
    if not path.exists():
        raise LoraError(f"adapter {name!r}: {path} does not exist")
    if path.is_dir():
        rank, scaling, pairs = _read_peft(path)
    elif path.suffix == ".gguf" and path.is_file():
        rank, scaling, pairs = _read_gguf(path, model)
    else:
        raise LoraError(
            f"adapter {name!r}: {path} is neither a PEFT adapter directory "
            f"({PEFT_CONFIG} + {PEFT_WEIGHTS}) nor a .gguf LoRA file"
        )
    dtype = model.dtype
    products: dict[tuple[int, str], list[tuple[int, slice, Tensor, Tensor]]] = {}
    for (layer, hf_name), (a, b) in sorted(pairs.items()):
        target = _target(name, layer, hf_name, model)
        rows = _part_rows(target, layer, model)
        where = f"adapter {name!r}: layers.{layer}.{hf_name}"
        in_features = _module(model, layer, target.linear).in_features
        if a.shape != (rank, in_features):
            raise LoraError(
                f"{where}: lora_A has shape {list(a.shape)}, expected [{rank}, {in_features}] "
                "(rank, the base linear's input): the adapter was made for another base model"
            )
        if b.shape != (rows.stop - rows.start, rank):
            raise LoraError(
                f"{where}: lora_B has shape {list(b.shape)}, expected "
                f"[{rows.stop - rows.start}, {rank}] (the base linear's output, rank): the "
                "adapter was made for another base model"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoraError(f"{where}: the adapter holds NaN or infinite numbers")
        products.setdefault((layer, target.linear), []).append(
            (target.part, rows, a.to(dtype), b.to(dtype))
        )
    if not products:
        raise LoraError(f"adapter {name!r} at {path} holds no LoRA weights")
    return LoraAdapter(name, str(path), rank, scaling, products)


def _read_peft(directory: Path) -> tuple[int, float, dict[tuple[int, str], tuple[Tensor, Tensor]]]:
    """(rank, scaling, (layer, HF linear name) -> (A, B)) of a PEFT LoRA directory."""
    config_path, weights_path = directory / PEFT_CONFIG, directory / PEFT_WEIGHTS
    if not config_path.is_file() or not weights_path.is_file():
        raise LoraError(
            f"{directory} is not a PEFT LoRA adapter: it needs {PEFT_CONFIG} and {PEFT_WEIGHTS} "
            "(save it with PeftModel.save_pretrained; pickled adapter_model.bin is not read)"
        )
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise LoraError(f"cannot read {config_path}: {exc}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(
            f"{config_path}: peft_type is {config.get('peft_type')!r}; astrai reads LORA"
        )
    for key, unused in UNAPPLIED_PEFT_SETTINGS.items():
        if config.get(key, unused) not in (unused, None, [], {}):
            raise LoraError(
                f"{config_path}: {key} is {config[key]!r}; astrai applies plain LoRA to "
                f"q/k/v/o and gate/up/down only, without {key}"
            )
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank <= 0 or not isinstance(alpha, int | float):
        raise LoraError(f"{config_path}: r must be a positive integer and lora_alpha a number")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[tuple[int, str], dict[str, Tensor]] = {}
    with safe_open(weights_path, framework="pt") as weights:
        for key in weights.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
            match = _PEFT_KEY.search(key)
            if match is None:
                raise LoraError(
                    f"{weights_path}: {key} is not a LoRA weight of a decoder layer's linear; "
                    "astrai adapts q/k/v/o and gate/up/down projections only"
                )
            layer, hf_name, which = int(match[1]), match[2], match[3]
            pairs.setdefault((layer, hf_name), {})[which] = weights.get_tensor(key)
    return rank, scaling, _paired(pairs, weights_path, "A", "B")


def _read_gguf(
    path: Path, model: Transformer
) -> tuple[int, float, dict[tuple[int, str], tuple[Tensor, Tensor]]]:
    """(rank, scaling, (layer, HF linear name) -> (A, B)) of llama.cpp's GGUF LoRA file."""
    try:
        check_gguf_layout(str(path))
        reader = GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise LoraError(f"cannot read {path} as GGUF: {exc}") from None
    kinds = (
        metadata_value(reader, "general.type", None),
        metadata_value(reader, "adapter.type", None),
    )
    if kinds != ("adapter", "lora"):
        raise LoraError(
            f"{path} is not a LoRA adapter: general.type and adapter.type are {kinds}, "
            "expected ('adapter', 'lora')"
        )
    architecture = metadata_value(reader, "general.architecture", None)
    try:
        family = gguf_family(architecture)
    except ValueError as exc:
        raise LoraError(f"{path}: {exc}") from None
    hf_names = {gguf: hf.removesuffix(".weight") for hf, gguf in family.gguf_layer_names.items()}
    pairs: dict[tuple[int, str], dict[str, Tensor]] = {}
    for tensor in reader.tensors:
        match = _GGUF_KEY.match(tensor.name)
        hf_name = None if match is None else hf_names.get(match[2])
        if hf_name is None:
            raise LoraError(
                f"{path}: {tensor.name} is not a LoRA weight of a decoder layer's linear; "
                "astrai adapts q/k/v/o and gate/up/down projections only"
            )
        shape = [int(n) for n in reversed(tensor.shape)]
        if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            values = np.asarray(tensor.data, dtype=np.float32)
        else:
            values = decode_blocks(tensor.data, tensor.tensor_type)
        values = values.reshape(shape)
        if (
            match[3] == "b"
            and family.permuted_rotary_rows
            and match[2] in ("attn_q.weight", "attn_k.weight")
        ):  # B's rows are q's or k's, permuted as the base's weights are
            values = unpermute_rotary_rows(values, len(values) // model.config.head_dim)
        values = torch.from_numpy(np.array(values, dtype=np.float32))
        pairs.setdefault((int(match[1]), hf_name), {})[match[3].upper()] = values
    paired = _paired(pairs, path, "a", "b")
    ranks = {a.shape[0] for a, _ in paired.values()}
    if len(ranks) != 1:
        raise LoraError(f"{path}: its tensors have ranks {sorted(ranks)}; expected one rank")
    (rank,) = ranks
    # Without alpha llama.cpp scales the products by 1.
    alpha = metadata_value(reader, "adapter.lora.alpha", None)
    return rank, 1.0 if not alpha else float(alpha) / rank, paired


def _paired(
    pairs: dict[tuple[int, str], dict[str, Tensor]], source: Path, a: str, b: str
) -> dict[tuple[int, str], tuple[Tensor, Tensor]]:
    lonely = [f"layers.{layer}.{name}" for (layer, name), ab in pairs.items() if len(ab) != 2]
    if lonely:
        raise LoraError(f"{source}: {lonely[:3]} have lora_{a} or lora_{b} without the other")
    return {key: (ab[a.upper()], ab[b.upper()]) for key, ab in pairs.items()}


def _target(name: str, layer: int, hf_name: str, model: Transformer) -> Target:
    target = TARGETS.get(hf_name)
    if target is None:
        raise LoraError(
            f"adapter {name!r}: layers.{layer}.{hf_name} is not a linear astrai adapts; "
            f"it adapts {sorted(TARGETS)}"
        )
    if not 0 <= layer < len(model.layers):
        raise LoraError(
            f"adapter {name!r}: layers.{layer}.{hf_name} lies past the model's "
            f"{len(model.layers)} layers: the adapter was made for another base model"
        )
    module = _module(model, layer, target.linear)
    if module is None:
        raise LoraError(
            f"adapter {name!r}: layers.{layer}.{hf_name} adapts a mixture-of-experts layer's "
            "feed-forward, which astrai does not adapt"
        )
    return target


def _part_rows(target: Target, layer: int, model: Transformer) -> slice:
    """The rows of its native linear's output that a Hugging Face linear's part writes."""
    module = _module(model, layer, target.linear)
    shape = (module.out_features, module.in_features)
    name = f"layers.{layer}.{target.linear}.weight"
    parts = target.family.hf_tensors(model.config, name, shape)
    start = sum(part_shape[0] for _, part_shape in parts[: target.part])
    return slice(start, start + parts[target.part][1][0])


def _module(model: Transformer, layer: int, linear: str) -> Linear | None:
    try:
        return model.layers[layer].get_submodule(linear)
    except AttributeError:
        return None


@dataclass
class Stack:
    """One adapted linear's slots: A [slots * width, in] and B^T [slots * width, out]."""

    a: Tensor
    bt: Tensor
    width: int


class AdapterTable:
    """The adapters an engine serves, each in a slot of every adapted linear's stacks, and the
    hooks that add their products to those linears' outputs, row by row as the step says.

    Load and unload run on any thread while steps run: a slot is written only while no row
    uses it (no step reads it then), and the table's lock guards the names.
    """

    def __init__(self, model: Transformer, max_loras: int, max_rank: int):
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.by_name: dict[str, LoraAdapter] = {}
        self.slots: list[LoraAdapter | None] = [None] * max_loras
        self.lock = threading.Lock()
        self.dtype, self.device = model.dtype, model.norm.weight.device
        self.stacks: dict[tuple[int, str], Stack] = {}
        self.hooks = []
        for layer in range(len(model.layers)):
            for linear in ADAPTED_LINEARS:
                module = _module(model, layer, linear)
                if module is None:
                    continue
                out, in_features = module.out_features, module.in_features
                width = MAX_PARTS[linear] * max_rank
                stack = Stack(
                    torch.zeros(
                        max_loras * width, in_features, dtype=self.dtype, device=self.device
                    ),
                    torch.zeros(max_loras * width, out, dtype=self.dtype, device=self.device),
                    width,
                )
                self.stacks[layer, linear] = stack
                self.hooks.append(module.register_forward_hook(self._hook(stack)))
        # each slot's adapter's rank: the columns of its blocks that are not zeros
        self.slot_ranks = torch.zeros(max_loras, dtype=torch.int64, device=self.device)
        self.rows = lora_ops.StepRows()
        # the kernel's CPU path, timed on the widest stack (gate and up's)
        self.path = None
        widest = max(self.stacks.values(), key=lambda stack: stack.a.numel(), default=None)
        if widest is not None and lora_ops.kernel_takes(
            widest.a[:1], widest.bt[:1], widest.a, widest.bt
        ):
            self.path = lora_ops.fastest_path(widest.a, widest.bt, max_loras, max_rank)
        # this step's (slot, its rows or None for every row, its scaling) per adapter it holds,
        # for the PyTorch products; made by the first of them in a step
        self.groups: list[tuple[int, Tensor | None, float]] | None = None

    def close(self) -> None:
        """Take the hooks off the model: it runs as the base model again."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []

    def names(self) -> list[str]:
        with self.lock:
            return list(self.by_name)

    def add(self, adapter: LoraAdapter) -> None:
        """Serve adapter under its name, in a free slot."""
        if adapter.rank > self.max_rank:
            raise LoraError(
                f"adapter {adapter.name!r} has rank {adapter.rank}, above the largest this "
                f"server holds, {self.max_rank}; start it with --max-lora-rank {adapter.rank}"
            )
        with self.lock:
            if adapter.name in self.by_name:
                raise LoraError(f"an adapter named {adapter.name!r} is loaded already")
            slot = self._free_slot()
            if slot is None:
                raise LoraError(
                    f"all {self.max_loras} adapter slots are taken ({sorted(self.by_name)}); "
                    "unload one, or start the server with a larger --max-loras"
                )
            adapter.slot = slot
            self._write(adapter)
            self.slot_ranks[slot] = adapter.rank
            self.slots[adapter.slot] = adapter
            self.by_name[adapter.name] = adapter

    def _free_slot(self) -> int | None:
        """A slot no served adapter holds and no running request uses."""
        for slot, held in enumerate(self.slots):
            if held is None or (self.by_name.get(held.name) is not held and not held.in_use()):
                return slot
        return None

    def remove(self, name: str) -> LoraAdapter:
        """Stop serving the adapter called name; its running requests finish under it."""
        with self.lock:
            adapter = self.by_name.pop(name, None)
        if adapter is None:
            raise UnknownAdapterError(self._unknown(name))
        return adapter

    def acquire(self, name: str, tasks: Iterable[object]) -> LoraAdapter:
        """The adapter called name, holding its slot for tasks until they end."""
        with self.lock:
            adapter = self.by_name.get(name)
            if adapter is None:
                raise UnknownAdapterError(self._unknown(name))
            adapter.tasks.update(tasks)
        return adapter

    def _unknown(self, name: str) -> str:
        served = sorted(self.by_name)
        return f"no adapter named {name!r} is loaded; loaded: {served or 'none'}"

    def _write(self, adapter: LoraAdapter) -> None:
        """Put adapter's A and B blocks into its slot of every stack (zeros where it adapts
        nothing)."""
        for (layer, linear), stack in self.stacks.items():
            columns = slice(adapter.slot * stack.width, (adapter.slot + 1) * stack.width)
            stack.a[columns] = 0
            stack.bt[columns] = 0
            for part, rows, a, b in adapter.products.get((layer, linear), ()):
                start = columns.start + part * self.max_rank
                stack.a[start : start + adapter.rank] = a
                stack.bt[start : start + adapter.rank, rows] = b.T

    def begin_step(self, row_slots: np.ndarray, row_scaling: np.ndarray) -> None:
        """Set the step's rows' adapters: row_slots [rows] (-1: the base model) and their
        scalings."""
        self.rows.set(row_slots, row_scaling)
        self.groups = None

    def _step_groups(self) -> list[tuple[int, Tensor | None, float]]:
        if self.groups is None:
            row_slots, groups = self.rows.slots, []
            for slot in np.unique(row_slots[row_slots >= 0]).tolist():
                rows = np.flatnonzero(row_slots == slot)
                every = len(rows) == len(row_slots)
                index = None if every else torch.from_numpy(rows).to(self.device)
                groups.append((slot, index, float(self.rows.scaling[rows[0]])))
            self.groups = groups
        return self.groups

    def _hook(self, stack: Stack):
        def add_products(module, args, out: Tensor) -> None:
            x = args[0]
            if lora_ops.kernel_takes(x, out, stack.a, stack.bt):
                lora_ops.add_lora(
                    out, x, stack.a, stack.bt, self.rows, self.slot_ranks, self.max_rank, self.path
                )
            else:
                launch_opaque(self._add_products, stack, x, out)

        return add_products

    def _add_products(self, stack: Stack, x: Tensor, out: Tensor) -> None:
        """The PyTorch products, grouped by adapter: where the kernel does not run."""
        for slot, index, scaling in self._step_groups():
            columns = slice(slot * stack.width, (slot + 1) * stack.width)
            a, bt = stack.a[columns], stack.bt[columns]
            if index is None:  # every row of the step
                out.addmm_(x @ a.T, bt, alpha=scaling)
            else:
                low = x.index_select(0, index) @ a.T  # [its rows, width]
                out.index_add_(0, index, low @ bt, alpha=scaling)


def row_adapters(
    adapters: Sequence[LoraAdapter | None], lengths: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """(slot, scaling) of each row of a step whose chunks have these adapters and lengths."""
    slots = np.array([-1 if a is None else a.slot for a in adapters], dtype=np.int64)
    scalings = np.array([0.0 if a is None else a.scaling for a in adapters], dtype=np.float32)
    return np.repeat(slots, lengths), np.repeat(scalings, lengths)
