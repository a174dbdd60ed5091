"""Where a step's time goes on the offline workload: the model's forward pass against the rest.

The rest is the host side of a step -- admission, planning, page tables and the cache view,
sampling, appending tokens, stop checks and callbacks -- and should stay small against the
model. Steps are bucketed by how many decodes they ran; steps that also ran prompt chunks are
reported apart.

With --decode MODEL, one request's batch-1 decode instead (a 128-token prompt, 256 new tokens,
as vs_llamacpp.py times it), each decode step split into the products by weight type, the
attention, the small ops (norms, rope, activations), the embedding lookup, the LM head and
the host side; every call of the recorded layers is timed on its own. With --whole-replays
the recorded calls are timed as one part instead, so no per-call timing adds to the host
side's figure (some 270 wrapped calls a SmolLM2 step).

    python benchmarks/step_profile.py                      # 64 requests, fp32
    python benchmarks/step_profile.py --num-requests 16
    python benchmarks/step_profile.py --decode path/to/model.gguf
    python benchmarks/step_profile.py --decode path/to/model.gguf --whole-replays
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from contextlib import ExitStack
from unittest.mock import patch

import torch
from decode_roofline import astrai_decode_rate
from gguf import GGMLQuantizationType
from offline_throughput import run_astrai
from workload import offline_workload, write_random_model

from astrai.inference import executor as executor_module
from astrai.inference import scheduler as scheduler_module
from astrai.inference.attention import CacheView
from astrai.inference.executor import DecodeLayout, ModelExecutor, RecordedLayers
from astrai.inference.sample import SamplingBatch, sample
from astrai.inference.scheduler import InferenceScheduler, schedule
from astrai.inference.step_batch import StepBatch
from astrai.kernels import graph as graph_module
from astrai.kernels import linear_ops, native, quant_ops
from astrai.kernels.graph import StepGraph
from astrai.model import AutoModel
from astrai.model.lora import AdapterTable
from astrai.model.transformer import Transformer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode", metavar="MODEL", help="a batch-1 decode of this model")
    parser.add_argument(
        "--whole-replays", action="store_true", help="with --decode: time each replay as one"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.decode:
        profile_decode(args.decode, getattr(torch, args.dtype), args.whole_replays)
        return

    model = AutoModel.from_pretrained(write_random_model(), dtype=getattr(torch, args.dtype))
    # One entry per step that ran the model: [decodes, prompt tokens, forward s, step s]
    steps: list[list] = []
    execute, step, forward = ModelExecutor.execute, InferenceScheduler.step, ModelExecutor.forward

    def timed_execute(executor: ModelExecutor, chunks):
        decodes = sum(chunk.length == 1 for chunk in chunks)
        steps.append([decodes, sum(c.length for c in chunks) - decodes, 0.0, 0.0])
        return execute(executor, chunks)

    def timed_forward(executor: ModelExecutor, batch):
        start = time.perf_counter()
        outputs = forward(executor, batch)
        steps[-1][2] = time.perf_counter() - start
        return outputs

    def timed_step(scheduler: InferenceScheduler) -> bool:
        before = len(steps)
        start = time.perf_counter()
        ran = step(scheduler)
        if len(steps) > before:
            steps[-1][3] = time.perf_counter() - start
        return ran

    ModelExecutor.execute, InferenceScheduler.step = timed_execute, timed_step
    ModelExecutor.forward = timed_forward
    try:
        tokens, seconds = run_astrai(model, offline_workload(args.num_requests), 64)
    finally:
        ModelExecutor.execute, InferenceScheduler.step = execute, step
        ModelExecutor.forward = forward

    print(f"{tokens} output tokens in {seconds:.1f} s ({tokens / seconds:.1f} tok/s)")
    buckets: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for decodes, prompt_tokens, forward, total in steps:
        low = decodes // 8 * 8
        key = "with prompt chunks" if prompt_tokens else f"{low:>2}-{low + 7} decodes"
        buckets[key].append((total, forward))
    print(f"{'steps':<20}{'count':>6}{'ms/step':>9}{'forward':>9}{'host':>8}{'host %':>8}")
    for key in sorted(buckets):
        rows = buckets[key]
        step_ms = 1e3 * sum(s for s, _ in rows) / len(rows)
        forward_ms = 1e3 * sum(f for _, f in rows) / len(rows)
        host_ms = step_ms - forward_ms
        print(
            f"{key:<20}{len(rows):>6}{step_ms:>9.1f}{forward_ms:>9.1f}{host_ms:>8.2f}"
            f"{host_ms / step_ms:>8.1%}"
        )


def call_kind(call) -> str:
    """What a recorded call computes: products by weight type (a decode's few rows take the
    kernels; the GEMM paths are named too), LoRA's products, attention, the embedding's and
    rope's row lookups (recorded in a decode step), or small ops."""
    func = call.func
    if func is native.quant_linear.linear:
        return f"products, {GGMLQuantizationType(call.args[8]).name}"
    if func is quant_ops._dense_linear:
        return f"products, {GGMLQuantizationType(call.args[3]).name} (GEMM)"
    if func in (torch.mm, torch.addmm, linear_ops._upcast_linear) or (
        native.skinny_linear is not None and func is native.skinny_linear.linear
    ):
        return "products, dense"
    if native.paged_attention is not None and func is native.paged_attention.decode:
        return "attention"
    if func in (native.fused_ops.gather_rows, native.quant_linear.gather_rows):
        return "embedding, rope angles"
    if (native.lora is not None and func is native.lora.add_products) or getattr(
        func, "__func__", None
    ) is AdapterTable._add_products:
        return "LoRA products"
    return "small ops"


def profile_decode(path: str, dtype: torch.dtype, whole_replays: bool = False) -> None:
    """One request's decode steps split by kind, ms a step (the mean over the decode steps);
    whole_replays times the recorded calls of a step as one part."""
    model = AutoModel.from_pretrained(path, dtype=dtype)
    # per decode step: kind -> seconds
    steps: list[defaultdict[str, float]] = []

    def timed(kind: str, method):
        def run(*args, **kwargs):
            start = time.perf_counter()
            result = method(*args, **kwargs)
            if steps:
                steps[-1][kind] += time.perf_counter() - start
            return result

        return run

    def timed_call(call, kind: str | None = None):
        kind = kind or call_kind(call)

        def run() -> None:
            start = time.perf_counter()
            call()
            steps[-1][kind] += time.perf_counter() - start

        return run

    replay, step, head = StepGraph.replay, InferenceScheduler.step, RecordedLayers._head

    def marked_head(recorded: RecordedLayers, *outputs):
        # A decode step's graph records the final norm and the head after the layers: note
        # where their calls start.
        graph = getattr(graph_module._recording, "graph", None)
        if graph is not None:
            graph.head_start = len(graph.calls)
        return head(recorded, *outputs)

    def timed_replay(graph: StepGraph, backend) -> None:
        if whole_replays:
            start = time.perf_counter()
            replay(graph, backend)
            steps[-1]["recorded calls, whole"] += time.perf_counter() - start
            return
        # Once a replay has bound the attention calls (its first), each call is timed; the
        # wrappers' own cost (well under a microsecond a call) falls to "host: the rest".
        if graph.attention_calls and not getattr(graph, "timed", False):
            head_start = getattr(graph, "head_start", len(graph.calls))
            graph.calls = [
                call and timed_call(call, "LM head" if i >= head_start else None)
                for i, call in enumerate(graph.calls)
            ]
            graph.attention_calls = [timed_call(call) for call in graph.attention_calls]
            graph.timed = True
        replay(graph, backend)

    def timed_step(scheduler: InferenceScheduler) -> bool:
        steps.append(defaultdict(float))
        start = time.perf_counter()
        ran = step(scheduler)
        steps[-1]["step"] = time.perf_counter() - start
        return ran

    layout = "host: the step's layout"
    patches = [
        patch.object(StepGraph, "replay", timed_replay),
        patch.object(RecordedLayers, "_head", marked_head),
        patch.object(DecodeLayout, "advance", timed(layout, DecodeLayout.advance)),
        patch.object(InferenceScheduler, "step", timed_step),
        patch.object(Transformer, "embed", timed("embedding, rope angles", Transformer.embed)),
        patch.object(Transformer, "logits", timed("LM head", Transformer.logits)),
        patch.object(scheduler_module, "schedule", timed("host: planning", schedule)),
        patch.object(
            InferenceScheduler,
            "_post_process",
            timed("host: tokens, stops, callbacks", InferenceScheduler._post_process),
        ),
        patch.object(StepBatch, "build", classmethod(timed(layout, StepBatch.build.__func__))),
        patch.object(CacheView, "__init__", timed(layout, CacheView.__init__)),
        patch.object(executor_module, "sample", timed("host: sampling", sample)),
        patch.object(
            SamplingBatch,
            "build",
            classmethod(timed("host: sampling", SamplingBatch.build.__func__)),
        ),
    ]
    with ExitStack() as stack:
        for patched in patches:
            stack.enter_context(patched)
        rate = astrai_decode_rate(model, list(range(1000, 1128)), 256)
    # decode steps only: those that replayed the recorded layers, past the first two
    replayed = "recorded calls, whole" if whole_replays else "attention"
    decode_steps = [s for s in steps if replayed in s][2:]
    totals: defaultdict[str, float] = defaultdict(float)
    for timings in decode_steps:
        for kind, seconds in timings.items():
            totals[kind] += seconds / len(decode_steps)
    total = totals.pop("step")
    totals["host: the rest"] = total - sum(totals.values())
    print(f"{path}: {rate:.1f} tok/s as timed by vs_llamacpp.py; {len(decode_steps)} steps")
    print(f"{'part':<34}{'ms/step':>9}{'share':>8}")
    for kind, seconds in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"{kind:<34}{1e3 * seconds:>9.3f}{seconds / total:>8.1%}")
    label = "step" if whole_replays else "step (each replayed call timed)"
    print(f"{label:<34}{1e3 * total:>9.3f}")


if __name__ == "__main__":
    main()
