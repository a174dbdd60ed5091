"""Recorded layers: replayed steps against the model's own forward, bit for bit."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_config

from astrai.inference.attention import CacheView
from astrai.inference.executor import ModelExecutor, RecordedLayers
from astrai.inference.kv_cache import PagedCache
from astrai.inference.step_batch import StepBatch
from astrai.kernels import SKINNY_MAX_ROWS, LinearPath, StepGraph, linear_ops, native
from astrai.kernels.kernel_plan import ROW_BUCKETS, active_plan
from astrai.model import Transformer

needs_kernels = pytest.mark.skipif(
    native.fused_ops is None or native.skinny_linear is None or native.paged_attention is None,
    reason="the C kernels were not built",
)

CONFIGS = {
    "llama": {},
    "qwen2-bias-tied": {"attention_bias": True, "tie_weight": True},
    "mistral-one-kv-head": {"n_kv_heads": 1},
    # Gemma 2's pieces: GeGLU, post-norms, soft-caps, a query scale and a window of 3 tokens
    "gemma2": {
        "hidden_act": "gelu_tanh",
        "post_norms": True,
        "scale_embeddings": True,
        "attention_scale": 0.3,
        "attn_logit_softcap": 2.0,
        "final_logit_softcap": 5.0,
        "sliding_window": 3,
        "layer_types": ("sliding_attention", "full_attention"),
    },
}


def random_model(seed: int, dtype: torch.dtype = torch.float32, **overrides) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**overrides)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.5)
    return model.to(dtype)


class Steps:
    """A KV cache and a run of steps over it: each step's seqs are (task, start, new tokens)."""

    def __init__(
        self,
        model: Transformer,
        prompts: list[int],
        recorded: RecordedLayers | None,
        mode: str = "layers",
    ):
        """mode: what the recorded steps take in besides the layers: "head" the final norm and
        the LM head, "ids" the embedding and rope's lookups too (a decode step's)."""
        config = model.config
        dtype = model.tok_embeddings.weight.dtype
        self.model, self.recorded, self.mode = model, recorded, mode
        n_pages = max(64, sum(-(-(length + 8) // 4) for length in prompts))
        self.cache = PagedCache(
            config.n_layers, config.n_kv_heads, config.head_dim, n_pages, page_size=4, dtype=dtype
        )
        for task_id, length in enumerate(prompts):
            assert self.cache.allocate(task_id, length + 8)

    @torch.inference_mode()
    def logits(self, seqs: list[tuple[int, int, int]]) -> torch.Tensor:
        batch = StepBatch.build(seqs, [], self.cache.tasks.pages, self.cache.page_size)
        view = CacheView(self.cache.kv, batch)
        ids = (view.positions * 5 + 3) % self.model.config.vocab_size
        h, cos, signed_sin = self.model.embed(ids, view.positions)
        if self.recorded is None:
            h, residual = self.model.run_layers(h, cos, signed_sin, view)
        elif self.mode == "ids":
            top = int(view.positions.max())
            return self.model.scaled_logits(self.recorded.run_ids(ids, view.positions, top, view))
        elif self.mode == "head":
            return self.model.scaled_logits(self.recorded.run(h, cos, signed_sin, view, head=True))
        else:
            h, residual = self.recorded.run(h, cos, signed_sin, view)
        return self.model.logits(h, residual, None)


def prompt_then_decodes(prompts: list[int], n_decodes: int) -> list[list[tuple[int, int, int]]]:
    steps = [[(task, 0, n) for task, n in enumerate(prompts)]]
    steps += [[(task, n + i, 1) for task, n in enumerate(prompts)] for i in range(n_decodes)]
    return steps


def assert_replay_matches(model, prompts, steps, recorded=None, mode="layers"):
    recorded = recorded or RecordedLayers(model)
    replayed, eager = Steps(model, prompts, recorded, mode), Steps(model, prompts, None)
    for seqs in steps:
        assert torch.equal(replayed.logits(seqs), eager.logits(seqs)), seqs
    return recorded


@pytest.fixture
def replays(monkeypatch) -> list[int]:
    """The rows of every StepGraph replay."""
    rows: list[int] = []
    replay = StepGraph.replay

    def counted(graph, backend):
        rows.append(len(backend.positions))
        return replay(graph, backend)

    monkeypatch.setattr(StepGraph, "replay", counted)
    return rows


@needs_kernels
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "mode", ["layers", "head", "ids"], ids=["layers", "with the head", "from token ids"]
)
def test_replayed_steps_give_the_modules_logits_bit_for_bit(config, dtype, mode, replays):
    model = random_model(0, dtype, **CONFIGS[config])
    steps = prompt_then_decodes([3, 5, 1], 4)
    recorded = assert_replay_matches(model, [3, 5, 1], steps, mode=mode)
    if mode == "ids" and config == "gemma2":
        # the embedding's scale is no kernel call: from the second decode the layers and the
        # head are recorded without the embedding
        valid = {key: step is not None for key, step in recorded.steps.items()}
        assert valid == {(9, "ids"): False, (3, "ids"): False, (3, True): True}
        assert replays == [3, 3]
        return
    # the prompt step (9 rows) and the first decode step (3) recorded, later decodes replayed
    key = {"layers": False, "head": True, "ids": "ids"}[mode]
    assert sorted(recorded.steps) == [(3, key), (9, key)]
    assert all(step is not None for step in recorded.steps.values())
    assert replays == [3, 3, 3]


@needs_kernels
def test_every_step_attends_by_kernel_calls(monkeypatch):
    """Every step on the CPU, the prompt step with its chunks too, calls the paged attention
    kernel directly, never the view's gather-and-SDPA path (whose rounding would make a
    token's result depend on the chunk it is prefilled in)."""
    attended = []
    attend = CacheView._attend

    def counted(view, layer, *args):
        attended.append(layer.index)
        return attend(view, layer, *args)

    monkeypatch.setattr(CacheView, "_attend", counted)
    model = random_model(1)
    assert_replay_matches(model, [4, 2], prompt_then_decodes([4, 2], 3))
    assert attended == []


@needs_kernels
def test_replays_of_decodes_alone_bind_their_attention_calls_once(monkeypatch):
    """The first replay binds each layer's kernel call to the graph's copy of the step's
    decodes; later replays only refill that copy and bind nothing."""
    binds = []
    bind = CacheView.bind

    def counted(view, *args, **kwargs):
        binds.append(len(view.positions))
        return bind(view, *args, **kwargs)

    monkeypatch.setattr(CacheView, "bind", counted)
    model = random_model(1)
    steps = Steps(model, [4, 2], RecordedLayers(model))
    per_step = []
    for seqs in prompt_then_decodes([4, 2], 4):
        binds.clear()
        steps.logits(seqs)
        per_step.append(len(binds))
    n = model.config.n_layers
    # the prompt step and the first decode step bind as they are recorded, the first replay
    # binds its calls once, and the replays after it bind nothing
    assert per_step == [n, n, n, 0, 0]


def decodes(prompts: list[int], live_per_step: list[list[int]]) -> list[list[tuple]]:
    """Decode steps of the live tasks, each at the position after its own last token."""
    next_pos = dict(enumerate(prompts))
    steps = []
    for live in live_per_step:
        steps.append([(task, next_pos[task], 1) for task in live])
        for task in live:
            next_pos[task] += 1
    return steps


@needs_kernels
def test_batch_sizes_come_and_go(replays):
    model = random_model(2)
    prompts = [2, 3, 4, 5, 6, 7, 8]
    steps = prompt_then_decodes(prompts, 0)
    steps += decodes(prompts, [[0], [0, 1], [0], list(range(7)), [0, 1]])
    assert_replay_matches(model, prompts, steps)
    assert replays == [1, 2]  # the second 1-row and 2-row steps


@needs_kernels
@pytest.mark.parametrize("change", ["load_state_dict", "assign", "to", "data"])
def test_weights_that_change_are_read_again(change, replays):
    model, other = random_model(3), random_model(4)
    steps = prompt_then_decodes([2], 3)
    recorded = assert_replay_matches(model, [2], steps)
    with torch.no_grad():
        if change == "to":
            model.to(torch.float64).to(torch.float32)  # new storage, same values
        elif change == "data":
            model.layers[1].feed_forward.w13.weight.data = torch.randn(128, 32)
        else:
            model.load_state_dict(other.state_dict(), assign=change == "assign")
    assert_replay_matches(model, [2], steps, recorded)
    # a copy into the same storage keeps the graphs; new storage records them again
    assert len(replays) == (6 if change == "load_state_dict" else 4)


@pytest.mark.parametrize("case", ["fp16", "q/k norm", "no kernels", "too many rows"])
def test_steps_that_cannot_be_recorded_run_the_modules(monkeypatch, case, replays):
    model = random_model(5, use_qk_norm=case == "q/k norm")
    if case == "fp16":
        model = model.half()
    if case == "no kernels":
        monkeypatch.setattr(native, "fused_ops", None)
    prompts = [SKINNY_MAX_ROWS + 1] if case == "too many rows" else [3]
    recorded = assert_replay_matches(model, prompts, [[(0, 0, prompts[0])], [(0, prompts[0], 1)]])
    if case == "too many rows":
        assert (SKINNY_MAX_ROWS + 1, False) not in recorded.steps
    else:
        assert recorded.steps == {(3, False): None, (1, False): None}
    assert replays == []


@needs_kernels
def test_a_head_that_cannot_be_recorded_runs_after_the_recorded_layers(monkeypatch, replays):
    """A head outside the kernels (here plain F.linear) voids only the recording that takes it
    in: the layers are recorded and replayed without it, and the head runs after them."""
    model = random_model(7)
    weight = model.output.weight
    monkeypatch.setattr(model.output, "forward", lambda x: torch.nn.functional.linear(x, weight))
    prompts = [3, 2]
    recorded = assert_replay_matches(model, prompts, prompt_then_decodes(prompts, 4), mode="head")
    # the first two decode steps record, each its own way; the last two replay the layers
    assert {key: step is not None for key, step in recorded.steps.items()} == {
        (5, True): False,
        (2, True): False,
        (2, False): True,
    }
    assert replays == [2, 2]


@needs_kernels
def test_steps_from_token_ids_follow_the_rope_tables_they_read(replays):
    """A graph from token ids reads rope's tables where they lay when it was recorded: when
    they move (rebuilt, as .to() leaves them, or grown for a decode past their 1024
    positions), the graphs are recorded again, never replayed over the old tables (filled
    with NaN here) or past their end."""
    model = random_model(8)
    prompts = [1019, 2]
    recorded = RecordedLayers(model)
    replayed, eager = Steps(model, prompts, recorded, "ids"), Steps(model, prompts, None)
    steps = [[(0, 0, 1019)], [(1, 0, 2)]] + decodes(prompts, [[0, 1]] * 8)
    for i, seqs in enumerate(steps):
        old = model.rope.tables
        if i == 4:
            model.rope.tables = None
        assert torch.equal(replayed.logits(seqs), eager.logits(seqs)), i
        if old is not None and model.rope.tables is not old:
            with torch.inference_mode():
                for table in old:
                    table.fill_(float("nan"))
    # the second prompt's 2 rows record; rebuilt before the third decode, grown at the sixth
    # (position 1024): those record again, the other six decodes replay
    assert replays == [2] * 6


@needs_kernels
def test_the_executor_times_the_linear_paths_of_its_model(monkeypatch):
    """Building the executor (as an engine does) times the paths on the model's weights and
    keeps the fastest in its own KernelPlan: here the GEMM for one row, the kernel up to 64.
    Outside its steps, nothing changed: the untuned plan's kernel at one row."""
    gemm_wins_one_row = {(LinearPath.GEMM, 1): 0.5}
    monkeypatch.setattr(
        linear_ops,
        "_time_path",
        lambda path, weights, rows, limit, **setting: gemm_wins_one_row.get((path, rows), 1.0),
    )
    model = random_model(6)
    config = model.config
    cache = PagedCache(config.n_layers, config.n_kv_heads, config.head_dim, 8, page_size=4)
    executor = ModelExecutor(model, cache.kv)
    paths = executor.kernel_plan.dense[torch.float32].paths
    assert paths[0] is LinearPath.GEMM
    assert set(paths[1 : ROW_BUCKETS.index(SKINNY_MAX_ROWS) + 1]) == {LinearPath.KERNEL}
    assert active_plan().dense_choice(torch.float32).path(1) is LinearPath.KERNEL
