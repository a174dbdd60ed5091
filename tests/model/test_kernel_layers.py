"""The fp32 CPU layers as direct kernel calls against the modules' own forward."""

from __future__ import annotations

import threading

import pytest
import torch
from test_transformer import RaggedAttention, tiny_config

from astrai.inference import attention as cache_module
from astrai.inference.attention import CacheView
from astrai.inference.kv_cache import PagedCache
from astrai.model import Transformer, fused_ops, kernel_layers, linear
from astrai.model import transformer as transformer_module

needs_kernels = pytest.mark.skipif(
    fused_ops._fused_ops is None or linear._skinny_linear is None,
    reason="the C kernels were not built",
)

CONFIGS = {
    "llama": {},
    "qwen2-bias-tied": {"attention_bias": True, "tie_weight": True},
    "mistral-one-kv-head": {"n_kv_heads": 1},
}


def random_model(seed: int, dtype: torch.dtype = torch.float32, **overrides) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**overrides)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.5)
    return model.to(dtype)


def forward(model, lengths, logits_indices=None):
    ids = torch.arange(sum(lengths)) * 7 % model.config.vocab_size
    positions = torch.cat([torch.arange(n) for n in lengths])
    return model.forward(ids, positions, RaggedAttention(lengths), logits_indices)


def module_forward(monkeypatch, model, lengths, logits_indices=None):
    with monkeypatch.context() as patch:
        patch.setattr(transformer_module, "kernel_layers", lambda model, h: None)
        return forward(model, lengths, logits_indices)


@needs_kernels
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("lengths", [[1], [3, 1, 4], [64]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_layers_give_the_modules_logits_bit_for_bit(monkeypatch, config, lengths, dtype):
    if dtype not in linear.KERNEL_DTYPES:
        pytest.skip("PyTorch has fast bf16 GEMMs here: bf16 linears stay on PyTorch")
    model = random_model(0, dtype, **CONFIGS[config])
    with torch.inference_mode():
        h = torch.empty(sum(lengths), 32, dtype=dtype)
        assert kernel_layers.kernel_layers(model, h) is not None
        logits = forward(model, lengths)
        last = torch.tensor(lengths).cumsum(0) - 1
        last_logits = forward(model, lengths, last)
        expected = module_forward(monkeypatch, model, lengths)
    assert torch.equal(logits, expected)
    assert torch.equal(last_logits, expected[last])


def paged_steps(model, dtype) -> list[torch.Tensor]:
    """Each step's logits: two prompts in one step, then three steps of their two decodes."""
    config = model.config
    cache = PagedCache(
        config.n_layers, config.n_kv_heads, config.head_dim, n_pages=16, page_size=4, dtype=dtype
    )
    prompts = {0: 5, 1: 9}
    for task_id, length in prompts.items():
        assert cache.allocate(task_id, length + 3)
    steps = [[(t, 0, n) for t, n in prompts.items()]]
    steps += [[(t, n + step, 1) for t, n in prompts.items()] for step in range(3)]
    logits = []
    for seqs in steps:
        view = CacheView(cache, seqs)
        ids = view.positions * 5 % config.vocab_size
        logits.append(model.forward(ids, view.positions, view))
    return logits


@needs_kernels
@pytest.mark.skipif(cache_module._paged_attention is None, reason="no paged attention kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_decodes_attend_by_calls_resolved_once_a_step(monkeypatch, dtype):
    """A step of decodes alone calls the attention kernel directly, not the view per layer,
    and gives the modules' logits (which go through the view) bit for bit."""
    if dtype not in linear.KERNEL_DTYPES:
        pytest.skip("PyTorch has fast bf16 GEMMs here: bf16 linears stay on PyTorch")
    model = random_model(0, dtype)
    view_calls = []
    view_call = CacheView.__call__

    def counted_view_call(view, *args):
        view_calls.append(args[0])
        return view_call(view, *args)

    with torch.inference_mode():
        with monkeypatch.context() as patch:
            patch.setattr(CacheView, "__call__", counted_view_call)
            logits = paged_steps(model, dtype)
        with monkeypatch.context() as patch:
            patch.setattr(transformer_module, "kernel_layers", lambda model, h: None)
            expected = paged_steps(model, dtype)
    assert view_calls == [0, 1], "only the prompt step calls the view, layer by layer"
    for step_logits, step_expected in zip(logits, expected, strict=True):
        assert torch.equal(step_logits, step_expected)


@needs_kernels
def test_buffers_serve_batch_sizes_in_turn_and_steps_outside_inference_mode(monkeypatch):
    """Batch sizes come and go (the buffers grow for 3 rows, then 7) and steps run both in
    inference mode and out of it."""
    model = random_model(1)
    for lengths in ([1], [2, 1], [1], [4, 3], [2, 1]):
        with torch.inference_mode():
            logits = forward(model, lengths)
        with torch.no_grad():
            assert torch.equal(forward(model, lengths), logits)
            assert torch.equal(logits, module_forward(monkeypatch, model, lengths))


@needs_kernels
@pytest.mark.parametrize("change", ["load_state_dict", "assign", "to", "data"])
def test_weights_are_reread_after_they_change(monkeypatch, change):
    model, other = random_model(2), random_model(3)
    with torch.no_grad():
        forward(model, [2])  # the kernel layers now point at model's first weights
        if change == "to":
            model.to(torch.float64).to(torch.float32)  # new storage, same values
            other = model
        elif change == "data":
            model.layers[1].feed_forward.w13.weight.data = torch.randn(128, 32)
            other = model
        else:
            model.load_state_dict(other.state_dict(), assign=change == "assign")
        assert torch.equal(forward(model, [2]), module_forward(monkeypatch, other, [2]))


@needs_kernels
def test_each_thread_has_its_own_buffers():
    model = random_model(4)
    h = torch.empty(2, 32)
    theirs = []

    @torch.no_grad()  # grad mode is per thread
    def plan_in_another_thread():
        theirs.append(kernel_layers.kernel_layers(model, h))

    with torch.no_grad():
        mine = kernel_layers.kernel_layers(model, h)
        thread = threading.Thread(target=plan_in_another_thread)
        thread.start()
        thread.join()
        assert mine is not None and theirs[0] is not None and theirs[0] is not mine
        assert kernel_layers.kernel_layers(model, h) is mine


@pytest.mark.parametrize(
    "case", ["fp16", "gradients", "too many rows", "q/k norm", "no kernels", "fp64 weights"]
)
def test_the_modules_run_where_the_kernels_cannot(monkeypatch, case):
    model = random_model(5, use_qk_norm=case == "q/k norm")
    h = torch.empty(linear.SKINNY_MAX_ROWS + 1 if case == "too many rows" else 2, 32)
    if case == "fp16":
        model, h = model.half(), h.half()
    if case == "no kernels":
        monkeypatch.setattr(fused_ops, "_fused_ops", None)
    if case == "fp64 weights":
        model.layers[1].feed_forward.w2.double()
    with torch.set_grad_enabled(case == "gradients"):
        assert kernel_layers.kernel_layers(model, h) is None
