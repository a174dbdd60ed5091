"""Tensor parallelism end to end: 2 ranks give the greedy tokens of 1, through the engine and
through `astrai serve`, and a rank that dies fails the requests and stops the engine cleanly."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
import weakref

import httpx
import psutil
import pytest
import torch
from gguf import GGMLQuantizationType
from serve_process import REPO_ROOT, astrai_serve
from tiny_models import real_gguf, write_gguf, write_hf_model

from astrai.config import ACTIVATION_PRECISIONS, ConfigError
from astrai.distributed import load_sharded, run_worker
from astrai.distributed.executor import KV_POOL, STOP_MESSAGE, serve_steps
from astrai.distributed.group import free_port
from astrai.inference import InferenceEngine
from astrai.kernels.quant_ops import QuantizedWeight
from astrai.model import AutoModel
from astrai.tokenize import AutoTokenizer

SMALL = dict(kv_cache_memory=8 << 20, max_seq_len=256, max_batch_size=8)
MODEL = "tiny"
PROMPTS = ["The quick brown fox", "Hello world! How are you", "def add(a, b):"]


def greedy(engine: InferenceEngine) -> list[list[int]]:
    """Each prompt's greedy tokens, all in one batch, then again one by one (every prompt's
    pages then come from the prefix cache)."""
    params = dict(max_tokens=16, temperature=0.0, ignore_eos=True)
    batched = engine.generate_results(PROMPTS, **params)
    alone = [engine.generate_results(prompt, **params) for prompt in PROMPTS]
    return [r.token_ids for r in batched + alone]


def prompt_logprobs(engine: InferenceEngine) -> list[float]:
    """The logprob of every prompt token after the first: a partial sum left out by one layer
    moves them all, where a tiny model's greedy tokens may come out the same."""
    results = engine.generate_results(PROMPTS, max_tokens=0, prompt_logprobs=1)
    return [entry.logprob for result in results for entry in result.prompt_logprobs[1:]]


def spawned_workers() -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if "spawn_main" in " ".join(p.cmdline())
    ]


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("llama", {"tie_word_embeddings": True}),  # the head is the embedding's rows
        ("qwen2", {}),  # biased q/k/v
        ("qwen3", {"num_key_value_heads": 1}),  # q/k norms; one KV head, replicated on both
        ("phi3", {"pad_token_id": 0, "partial_rotary_factor": 0.5}),  # fused projections
        ("granite", {}),  # embedding, attention, residual and logit multipliers
        ("mistral", {"sliding_window": 8}),  # a window shorter than the prompts
        # every expert split across the ranks, the router replicated
        ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
        (  # a shared expert and a dense layer
            "qwen2_moe",
            {
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 64,
                "mlp_only_layers": [1],
            },
        ),
        ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
        # scaled embeddings, soft-caps, post-norms, a window every other layer
        ("gemma2", {"head_dim": 16, "sliding_window": 8}),
        ("gemma3_text", {"head_dim": 16, "sliding_window": 8}),  # q/k norms, local rope
        ("olmo2", {}),  # q and k normed across all heads: across the ranks
        ("olmo2", {"num_key_value_heads": 1}),  # ... k's one head replicated on both
    ],
)
def test_two_ranks_give_the_greedy_tokens_of_one(tmp_path, arch, overrides):
    directory = write_hf_model(tmp_path / arch, arch, **overrides)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    with InferenceEngine(AutoModel.from_pretrained(directory), tokenizer, **SMALL) as engine:
        expected, logprobs = greedy(engine), prompt_logprobs(engine)
    sharded = load_sharded(directory, 2)
    assert len(spawned_workers()) == 1
    with InferenceEngine(sharded, tokenizer, tensor_parallel_size=2, **SMALL) as engine:
        assert greedy(engine) == expected
        assert prompt_logprobs(engine) == pytest.approx(logprobs, abs=1e-4)
    assert not spawned_workers()


def prompt_outputs(engine: InferenceEngine) -> tuple[torch.Tensor, list[float]]:
    """The prompts' mean embeddings and the first prompt's prompt logprobs."""
    scored = engine.generate_results(PROMPTS[0], max_tokens=0, prompt_logprobs=2)
    return engine.embed(PROMPTS, pooling="mean"), [e.logprob for e in scored.prompt_logprobs[1:]]


def test_two_ranks_give_the_embeddings_and_prompt_logprobs_of_one(llama_dir):
    """Rank 0's hidden states are the whole model's; the scored rows' logits are gathered."""
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    with InferenceEngine(AutoModel.from_pretrained(llama_dir), tokenizer, **SMALL) as engine:
        vectors, logprobs = prompt_outputs(engine)
    sharded = load_sharded(llama_dir, 2)
    with InferenceEngine(sharded, tokenizer, tensor_parallel_size=2, **SMALL) as engine:
        sharded_vectors, sharded_logprobs = prompt_outputs(engine)
    torch.testing.assert_close(sharded_vectors, vectors, atol=1e-5, rtol=1e-5)
    assert sharded_logprobs == pytest.approx(logprobs, abs=1e-4)


def test_an_engine_refuses_a_model_loaded_for_other_ranks(llama_dir):
    model = AutoModel.from_pretrained(llama_dir)
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    with pytest.raises(ConfigError, match="load_sharded"):
        InferenceEngine(model, tokenizer, tensor_parallel_size=2, **SMALL)


def test_torchrun_ranks_generate_the_greedy_text_of_one(llama_dir):
    """Under torchrun every rank runs the command; rank 1 serves steps and exits with rank 0."""
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    with InferenceEngine(AutoModel.from_pretrained(llama_dir), tokenizer, **SMALL) as engine:
        expected = engine.generate(PROMPTS[0], max_tokens=8, temperature=0.0)
    command = ["generate", "--model", str(llama_dir), "--max-tokens", "8", "--temperature", "0"]
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        + ["--master-port", str(free_port()), "-m", "astrai", *command]
        + ["--tensor-parallel-size", "2", PROMPTS[0]],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert expected.strip() and run.stdout.strip() == expected.strip()


WORKER_SCRIPT = """
import sys

from astrai.distributed import is_torchrun_worker, load_sharded, run_worker
from astrai.inference import InferenceEngine
from astrai.tokenize import AutoTokenizer

path = sys.argv[1]
if is_torchrun_worker():
    run_worker(path, 2)
    print("run_worker returned", flush=True)
else:
    tokenizer = AutoTokenizer.from_pretrained(path)
    settings = dict(kv_cache_memory=8 << 20, max_seq_len=256)
    with InferenceEngine(load_sharded(path, 2), tokenizer, tensor_parallel_size=2, **settings) as e:
        print("rank 0:", e.generate("Hello", max_tokens=4, temperature=0.0), flush=True)
"""


def test_a_torchrun_worker_returns_from_run_worker(tmp_path, llama_dir):
    """A script under torchrun: rank 1's run_worker serves rank 0's steps and returns once rank
    0's engine has closed, so the script goes on (no exit from inside the library)."""
    script = tmp_path / "ranks.py"
    script.write_text(WORKER_SCRIPT)
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        + ["--master-port", str(free_port()), str(script), str(llama_dir)],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "rank 0: " in run.stdout
    assert "run_worker returned" in run.stdout


def test_each_entry_point_refuses_the_other_ranks(llama_dir, monkeypatch):
    """load_sharded is rank 0's, run_worker a torchrun worker's: each called on the wrong rank
    says which to call, before joining any group."""
    with pytest.raises(ConfigError, match="torchrun worker rank"):
        run_worker(llama_dir, 2)  # no torchrun here: load_sharded spawns the workers
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="call astrai.distributed.run_worker"):
        load_sharded(llama_dir, 2)
    assert not spawned_workers()


def test_a_rank_that_dies_while_idle_stops_the_engine(llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    engine = InferenceEngine(load_sharded(llama_dir, 2), tokenizer, tensor_parallel_size=2)
    assert engine.generate("Hello", max_tokens=4, temperature=0.0)
    [worker] = spawned_workers()
    worker.kill()
    deadline = time.monotonic() + 10
    while engine.is_running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.is_running
    with pytest.raises(RuntimeError, match="worker astrai-tp-rank1 exited with code -9"):
        engine.generate("Hello", max_tokens=4, temperature=0.0)
    engine.close()
    assert not spawned_workers()


def test_a_worker_that_dies_starting_fails_the_load_at_once(tmp_path, llama_dir):
    """A script that starts tensor parallelism without a `__main__` guard: each spawned worker
    imports it again and dies starting. Rank 0 says so at once, where it used to wait out the
    rendezvous timeout (120 s)."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        f"from astrai.distributed import load_sharded\nload_sharded({str(llama_dir)!r}, 2)\n"
    )
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert run.returncode != 0
    assert "astrai-tp-rank1 exited with code 1 while starting" in run.stderr
    assert '`if __name__ == "__main__":`' in run.stderr
    assert time.monotonic() - start < 60


def test_closing_lets_go_of_the_step_channel_at_once(llama_dir):
    """A closed group frees its gloo process group then, not at the interpreter's exit: left
    there (a finished stream keeps the engine alive), gloo's threads were torn down unjoined
    and `astrai generate --tensor-parallel-size 2` aborted after printing its answer ("terminate
    called without an active exception") about one exit in three."""
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    sharded = load_sharded(llama_dir, 2)
    engine = InferenceEngine(sharded, tokenizer, tensor_parallel_size=2)
    assert list(engine.generate("Hello", max_tokens=4, temperature=0.0, stream=True))
    plans = weakref.ref(sharded.group.plans)
    engine.close()
    gc.collect()
    assert plans() is None
    assert not spawned_workers()


@pytest.mark.slow  # the real SmolLM2 in three ranks: about 2 minutes on 2 cores
def test_three_ranks_give_the_real_ggufs_greedy_tokens(monkeypatch):
    """SmolLM2-135M-Instruct's GGUF (Q4_1 linears, Q8_0 embedding; 9 heads over 3 KV heads)
    over 3 ranks, each holding a third of every layer's blocks. The products take the GEMM
    path: the int8 kernel rounds each activation to 8 bits, which turns the all-reduce's other
    order of additions into other tokens now and then (3 of 6 here within 32 tokens), while
    the GEMM's arithmetic gives the single process's tokens."""
    path = real_gguf()
    monkeypatch.setenv("ASTRAI_LINEAR_PATH", "gemm")
    tokenizer = AutoTokenizer.from_pretrained(path)
    with InferenceEngine(AutoModel.from_pretrained(path), tokenizer, **SMALL) as engine:
        expected = greedy(engine)
    sharded = load_sharded(path, 3)
    attention = sharded.model.layers[0].attention
    wqkv, wo = attention.wqkv, attention.wo
    # 3 query heads, 1 key and 1 value head
    assert isinstance(wqkv.weight, QuantizedWeight) and wqkv.weight.shape == (320, 576)
    assert isinstance(wo.weight, QuantizedWeight) and wo.weight.shape == (576, 192)
    with InferenceEngine(sharded, tokenizer, tensor_parallel_size=3, **SMALL) as engine:
        assert greedy(engine) == expected
    assert not spawned_workers()


def test_blocks_a_rank_would_cut_are_refused_before_any_worker_starts(tmp_path):
    """Q8_0 blocks hold 32 weights: 4 ranks' shares of the tiny model's 64-wide attention
    output would cut them."""
    hf_dir = write_hf_model(tmp_path / "hf", "llama")
    types = {"attn_output.weight": GGMLQuantizationType.Q8_0}
    path = write_gguf(tmp_path / "model.gguf", hf_dir, "llama", types=types)
    with pytest.raises(ConfigError, match="attn_output.weight in Q8_0 blocks of 32 weights"):
        load_sharded(path, 4)
    assert not spawned_workers()


def test_each_rank_quantizes_its_share_on_load(llama_dir, monkeypatch):
    """quantization="q8_0": each rank's linears are its share in Q8_0 blocks, and (on the GEMM
    path, as above) they give the single process's tokens."""
    monkeypatch.setenv("ASTRAI_LINEAR_PATH", "gemm")
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    whole = AutoModel.from_pretrained(llama_dir, quantization="q8_0")
    with InferenceEngine(whole, tokenizer, **SMALL) as engine:
        expected = greedy(engine)
    sharded = load_sharded(llama_dir, 2, quantization="q8_0")
    w2 = sharded.model.layers[0].feed_forward.w2
    assert isinstance(w2.weight, QuantizedWeight) and w2.weight.shape == (64, 64)
    with InferenceEngine(sharded, tokenizer, tensor_parallel_size=2, **SMALL) as engine:
        assert greedy(engine) == expected


class RecordedMessages:
    """A worker's end of the step channel, replaying rank 0's messages."""

    failure = None

    def __init__(self, messages: list[tuple[list[int], torch.Tensor | None]]):
        self.messages = messages

    def receive_header(self) -> list[int]:
        header, self.body = self.messages.pop(0)
        return header

    def receive_body(self, size: int) -> torch.Tensor:
        assert self.body is not None and self.body.numel() == size
        return self.body


def test_workers_take_rank_zeros_activation_precision(llama_dir):
    """The KV_POOL message carries the engine's activation precision in its body: a worker's
    quantized linears round x as rank 0's do (int8 here, against the int8x2 default)."""
    model = AutoModel.from_pretrained(llama_dir, quantization="q8_0")
    precision = torch.tensor([ACTIVATION_PRECISIONS.index("int8")])
    channel = RecordedMessages(
        [([KV_POOL, 8, 16, 0, 1], precision), ([STOP_MESSAGE, 0, 0, 0, 0], None)]
    )
    executor = serve_steps(channel, model)
    assert any(isinstance(getattr(m, "weight", None), QuantizedWeight) for m in model.modules())
    assert executor.kernel_plan.activation_precision == "int8"


def test_generate_with_quantized_ranks(llama_dir):
    """The same through the command line: `--quantization q8_0 --tensor-parallel-size 2`."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "ASTRAI_LINEAR_PATH": "gemm"}
    command = [sys.executable, "-m", "astrai", "generate", "--model", str(llama_dir)]
    command += ["--quantization", "q8_0", "--max-tokens", "8", "--temperature", "0"]
    texts = []
    for size in ("1", "2"):
        run = subprocess.run(
            [*command, "--tensor-parallel-size", size, PROMPTS[0]],
            env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        assert "linears to Q8_0 at load" in run.stderr  # rank 0's share was quantized
        texts.append(run.stdout)
    assert texts[0].strip() and texts[0] == texts[1]


def completion(base: str, prompt: str, **fields) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0.0, **fields}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=60)


def test_serve_with_two_ranks_then_a_rank_killed_mid_generation(llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    with InferenceEngine(AutoModel.from_pretrained(llama_dir), tokenizer, **SMALL) as engine:
        expected = [engine.generate(p, max_tokens=16, temperature=0.0) for p in PROMPTS]
    flags = [
        "--model-name",
        MODEL,
        "--max-seq-len",
        "1024",
        "--kv-cache-memory",
        "8000000",
        "--max-batch-size",
        "8",
    ]
    with astrai_serve(llama_dir, "--tensor-parallel-size", "2", *flags) as (process, base):
        served = [completion(base, p).json()["choices"][0]["text"] for p in PROMPTS]
        assert served == expected

        [worker] = [
            p
            for p in psutil.Process(process.pid).children()
            if "spawn_main" in " ".join(p.cmdline())
        ]
        streamed = threading.Event()
        events: list[str] = []

        def stream() -> None:
            body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True}
            with httpx.stream(
                "POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=60
            ) as response:
                for line in response.iter_lines():
                    events.append(line)
                    streamed.set()

        client = threading.Thread(target=stream)
        client.start()
        assert streamed.wait(30)
        worker.kill()
        client.join(timeout=60)
        assert not client.is_alive()
        assert any('"error"' in event for event in events), events[-3:]
        health = httpx.get(f"{base}/health", timeout=10)
        assert health.status_code == 503
        assert completion(base, "Hello").status_code >= 500
        process.terminate()
        process.communicate(timeout=60)
    assert not worker.is_running()
