"""What the flags describe, loaded: the model's path and name, the sampling defaults from its
generation_config.json, the model and tokenizer, the engine, and the server app (of one model,
or of several loaded on demand). The commands of astrai.cli and astrai.deploy's replicas start
from here."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

# Only torch-free modules here: the engine, the model and the server are imported where a
# function needs them.
from astrai.config import ConfigError, EngineConfig, LoadConfig
from astrai.flags import GENERATION_CONFIG_SAMPLING, from_flags
from astrai.inference.task import GenerationParams, InvalidParamsError

log = logging.getLogger("astrai")

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "demo"


def model_path(args: argparse.Namespace) -> Path:
    """The local directory or .gguf file that --model (with --revision, --gguf-file) names."""
    from astrai.model.weights.hub import resolve_model

    load = from_flags(LoadConfig, args)
    name = load.model
    if name is None:
        log.info("no --model given; using the demo model at %s", DEMO_MODEL_DIR)
        name = DEMO_MODEL_DIR
    path = resolve_model(name, revision=load.revision, gguf_file=load.gguf_file)
    if path != Path(name):
        log.info("model %s is %s", name, path)
    return path


def model_name(args: argparse.Namespace, model_dir: Path) -> str:
    """The name a model goes by: a hub id as given (its snapshot directory is a commit hash),
    else the directory's or file's name."""
    model = from_flags(LoadConfig, args).model
    local = model is None or Path(model).exists()
    return model_dir.resolve().name if local else model


def generation_config_sampling(model_dir: Path) -> dict:
    """The sampling settings model_dir's generation_config.json gives (do_sample false:
    temperature 0, greedy, as transformers reads it); none without the file."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        generation = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    taken = {
        name: generation[name]
        for name in GENERATION_CONFIG_SAMPLING
        if generation.get(name) is not None
    }
    if generation.get("do_sample") is False:
        taken["temperature"] = 0.0
    return taken


def _sampling_override(args: argparse.Namespace) -> dict:
    """--override-generation-config's settings, checked before any model loads."""
    if args.override_generation_config is None:
        return {}
    try:
        override = json.loads(args.override_generation_config)
    except ValueError as exc:
        raise ConfigError(f"--override-generation-config is not JSON: {exc}") from None
    if not isinstance(override, dict) or not set(override) <= set(GENERATION_CONFIG_SAMPLING):
        raise ConfigError(
            "--override-generation-config takes a JSON object of "
            f"{', '.join(GENERATION_CONFIG_SAMPLING)}; got {args.override_generation_config}"
        )
    try:
        GenerationParams(**override)
    except InvalidParamsError as exc:
        raise ConfigError(f"--override-generation-config: {exc}") from None
    return override


def _server_sampling(model_dir: Path, override: dict) -> dict:
    """The sampling settings a request that leaves them out gets: the model's
    generation_config.json's, under override (--override-generation-config's)."""
    sampling = generation_config_sampling(model_dir) | override
    try:
        GenerationParams(**sampling)
    except InvalidParamsError as exc:
        raise ConfigError(f"request sampling defaults {sampling}: {exc}") from None
    if sampling:
        settings = ", ".join(f"{name}={value}" for name, value in sampling.items())
        log.info("requests without their own sampling settings take %s", settings)
    return sampling


def load_engine(args: argparse.Namespace, config: EngineConfig, model_dir: Path):
    from astrai.inference import InferenceEngine

    return InferenceEngine(*load_model(args, config, model_dir), config)


def load_model(args: argparse.Namespace, config: EngineConfig, model_dir: Path):
    """(model, tokenizer) as the flags ask for them; the model is a ShardedModel (rank 0's, its
    workers started) under --tensor-parallel-size."""
    from astrai.model import AutoModel
    from astrai.tokenize import AutoTokenizer

    load = from_flags(LoadConfig, args)
    if config.tensor_parallel_size > 1 and load.mmproj:
        raise ConfigError(
            "--mmproj with --tensor-parallel-size: images run on one process only; leave one out"
        )
    # A GGUF file's readers are shared while one is held: holding one across both loads parses
    # its metadata (a vocabulary of tens of thousands of tokens, 0.5 s) once, not twice.
    held_reader = _gguf_reader(model_dir)
    if config.tensor_parallel_size > 1:
        from astrai.distributed import load_sharded

        model = load_sharded(**_shard_arguments(load, config, model_dir))
    else:
        model = AutoModel.from_pretrained(
            model_dir,
            dtype=_dtype(load),
            device=_device(load),
            dequantize=load.dequantize,
            quantization=load.quantization,
            mmproj=load.mmproj,
        )
    tokenizer = AutoTokenizer.from_pretrained(model_dir, chat_template=load.chat_template)
    del held_reader
    return model, tokenizer


def _gguf_reader(path: Path):
    """The shared reader of a .gguf file (None for a directory)."""
    if path.suffix != ".gguf" or not path.is_file():
        return None
    from astrai.model.weights.gguf import open_gguf

    return open_gguf(path)


def _device(load: LoadConfig) -> str:
    """The device --device names; auto is CUDA where there is one."""
    import torch

    if load.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return load.device


def _dtype(load: LoadConfig) -> str:
    """The dtype --dtype names; auto is bfloat16 on CUDA, else float32."""
    import torch

    if load.dtype != "auto":
        return load.dtype
    return "bfloat16" if torch.device(_device(load)).type == "cuda" else "float32"


def _shard_arguments(load: LoadConfig, config: EngineConfig, model_dir: Path) -> dict:
    """What every rank of a tensor-parallel model loads (astrai.distributed's load_sharded on
    rank 0, run_worker on a torchrun worker)."""
    return dict(
        path=model_dir,
        size=config.tensor_parallel_size,
        dtype=_dtype(load),
        device=_device(load),
        dequantize=load.dequantize,
        quantization=load.quantization,
    )


def is_worker_rank(config: EngineConfig) -> bool:
    """Whether this process is a tensor-parallel rank other than 0 that torchrun started (with
    the same command as rank 0): it serves rank 0's steps (serve_worker_rank), not the command."""
    if config.tensor_parallel_size == 1:
        return False
    from astrai.distributed import is_torchrun_worker

    return is_torchrun_worker()


def serve_worker_rank(args: argparse.Namespace, config: EngineConfig) -> None:
    """A torchrun worker rank's part in any command: load its shard of the model the flags name
    and serve rank 0's steps on it; returns once rank 0's engine has closed."""
    from astrai.distributed import run_worker

    model_dir = model_path(args)
    # Held as load_model holds it on rank 0: the file's metadata is parsed once, not twice.
    held_reader = _gguf_reader(model_dir)
    run_worker(**_shard_arguments(from_flags(LoadConfig, args), config, model_dir))
    del held_reader


def open_server(args: argparse.Namespace, config: EngineConfig):
    """Load the engine `astrai serve`'s flags describe and create the app serving it.

    Returns (engine, app); the caller closes the engine. astrai.deploy's replicas run this too.
    """
    from astrai.server import create_app

    if serves_several(args):
        raise ConfigError(
            "this command serves one model; --models-dir and several --model are astrai serve's"
        )
    if args.max_loaded_models is not None or args.idle_unload is not None:
        raise ConfigError(
            "--max-loaded-models and --idle-unload are for several models (--models-dir, or "
            "--model given more than once); one model stays loaded while the server runs"
        )
    model_dir = model_path(args)
    name = args.model_name or model_name(args, model_dir)
    config = _checkpoint_pooling(config, model_dir)
    sampling = _server_sampling(model_dir, _sampling_override(args))
    engine = load_engine(args, config, model_dir)
    try:
        app = create_app(
            engine,
            name,
            sampling=sampling,
            lora_dir=args.lora_dir,
            **_app_settings(args),
        )
    except BaseException:
        engine.close()
        raise
    log.info("serving model %r%s", name, " (API key required)" if args.api_key else "")
    return engine, app


def _checkpoint_pooling(config: EngineConfig, model_dir: Path) -> EngineConfig:
    """config pooling embeddings as the checkpoint says, unless --pooling says otherwise."""
    from astrai.model.pooling import checkpoint_pooling

    if config.pooling is None and (pooling := checkpoint_pooling(model_dir)) is not None:
        log.info("embeddings pool by %s, as the checkpoint's pooling config says", pooling)
        config = dataclasses.replace(config, pooling=pooling)
    return config


def serves_several(args: argparse.Namespace) -> bool:
    """Whether `astrai serve` serves several models, each loaded on demand."""
    return args.models_dir is not None or len(getattr(args, "models", [])) > 1


def open_router(args: argparse.Namespace, config: EngineConfig):
    """The app serving the models of --models-dir and of each --model, none loaded yet.

    Returns (registry, app); the caller closes the registry (every model still loaded).
    """
    from astrai.server.app import ModelSource, create_router_app

    _refuse_for_several(args, config)
    sources = _router_models(args)
    if not sources:
        raise ConfigError(
            f"--models-dir {args.models_dir} holds no model (.gguf file or model "
            "directory with a config.json); put models there or give --model"
        )
    loaded_at_once = args.max_loaded_models or len(sources)
    config = _kv_share(config, from_flags(LoadConfig, args), loaded_at_once)
    override = _sampling_override(args)

    def loader(path: Path):
        def load():
            model_config = _checkpoint_pooling(config, path)
            sampling = _server_sampling(path, override)
            return load_engine(args, model_config, path), sampling

        return load

    app = create_router_app(
        [ModelSource(name, path, loader(path)) for name, path in sources.items()],
        max_loaded_models=args.max_loaded_models,
        idle_unload=args.idle_unload,
        **_app_settings(args),
    )
    for name, path in sources.items():
        log.info("serving model %r from %s, loaded when a request names it", name, path)
    log.info(
        "models loaded at once: %d at most%s%s",
        loaded_at_once,
        "" if args.idle_unload is None else f"; each unloaded after {args.idle_unload:g}s idle",
        " (API key required)" if args.api_key else "",
    )
    return app.state.models, app


def _refuse_for_several(args: argparse.Namespace, config: EngineConfig) -> None:
    """A ConfigError for the flags that name one model's settings, given with several models."""
    per_model = {
        "--lora": config.loras,
        "--max-loras": config.max_loras,
        "--lora-dir": args.lora_dir,
        "--model-name": args.model_name,
        "--revision": getattr(args, "revision", None),
        "--gguf-file": getattr(args, "gguf_file", None),
        "--mmproj": getattr(args, "mmproj", None),
    }
    given = [flag for flag, value in per_model.items() if value]
    if config.tensor_parallel_size > 1:
        given.append("--tensor-parallel-size")
    if given:
        raise ConfigError(
            f"{', '.join(given)} set one model's settings, but --models-dir or several --model "
            "serve several models; leave them out, or serve that model alone with --model"
        )


def _router_models(args: argparse.Namespace) -> dict[str, Path]:
    """Each model to serve on demand by its name: the models found in --models-dir, named by
    their path under it, then each --model, named as one model served alone is."""
    from astrai.model.weights.hub import resolve_model

    sources: dict[str, Path] = {}
    if args.models_dir is not None:
        sources.update(_models_in(Path(args.models_dir)))
    for model in getattr(args, "models", []):
        path = resolve_model(model)
        local = Path(model).exists()
        name = path.resolve().name if local else model
        if name in sources and sources[name] != path:
            raise ConfigError(
                f"two models go by the name {name!r}: {sources[name]} and {path}; rename one"
            )
        sources[name] = path
    return sources


def _models_in(directory: Path) -> dict[str, Path]:
    """The models below directory by their path under it: .gguf files (but vision projectors,
    mmproj*.gguf) and directories with a config.json (not looked into further)."""
    if not directory.is_dir():
        raise ConfigError(f"--models-dir {directory} is not a directory")
    found = {}
    for path in sorted(directory.rglob("*")):
        if any(parent in found.values() for parent in path.parents):
            continue  # a file of a model directory
        is_gguf = path.suffix == ".gguf" and path.is_file() and not path.name.startswith("mmproj")
        if is_gguf or (path.is_dir() and (path / "config.json").is_file()):
            found[path.relative_to(directory).as_posix()] = path
    return found


def _kv_share(config: EngineConfig, load: LoadConfig, models: int) -> EngineConfig:
    """config with its KV budget split evenly among the models loaded at once: a fraction of
    free memory is taken of the memory free now, before any model loads."""
    from astrai.inference.kv_cache import free_memory

    budget = config.kv_cache_memory
    if budget <= 1:
        budget *= free_memory(_device(load))
    share = int(budget // models)
    log.info(
        "KV cache budget %.0f MB: %.0f MB for each model, %d loaded at once at most",
        budget / 2**20,
        share / 2**20,
        models,
    )
    return dataclasses.replace(config, kv_cache_memory=share)


def _app_settings(args: argparse.Namespace) -> dict:
    """The serve flags an app of one model and a router of several both take."""
    return dict(
        api_key=args.api_key,
        allowed_hosts=[args.host, *args.allowed_hosts],
        max_request_bytes=args.max_request_bytes,
        read_timeout=args.read_timeout,
        docs=args.docs,
        webui=args.webui,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        allowed_media_domains=args.allowed_media_domains,
        media_fetch_timeout=args.media_fetch_timeout,
    )
