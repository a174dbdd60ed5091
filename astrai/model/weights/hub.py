"""What a model name points at: a local directory, a local .gguf file, or a Hugging Face id."""

from __future__ import annotations

import logging
from os import PathLike
from pathlib import Path

from astrai.model.checkpoint import CheckpointError

log = logging.getLogger(__name__)

# The files astrai reads from a Hugging Face checkpoint; a download fetches these and no more.
CHECKPOINT_FILES = [
    "config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
]


class ModelNotFoundError(CheckpointError):
    """A model name is no local path, or a hub id neither cached nor downloadable."""


def resolve_model(
    name: str | PathLike, revision: str | None = None, gguf_file: str | None = None
) -> Path:
    """The local path of the model `name` names: a directory or .gguf file as is, a hub id
    (`org/name`) as its snapshot in the Hugging Face cache, downloaded unless HF_HUB_OFFLINE=1.

    With gguf_file, the path of that file inside the directory or snapshot. revision (a
    branch, tag or commit) applies to hub ids only: given with a local path it is refused.
    """
    path = Path(name)
    if revision is not None and (path.is_dir() or path.is_file()):
        raise ModelNotFoundError(
            f"--revision {revision!r} applies to Hugging Face ids, but {str(name)!r} is a local "
            "path; drop the revision or name the model by its hub id"
        )
    if path.is_dir():
        return _gguf_in(path, gguf_file, str(name)) if gguf_file else path
    if path.is_file():
        if gguf_file:
            raise ModelNotFoundError(
                f"--gguf-file {gguf_file!r} picks a file inside a directory or hub repo, but "
                f"{str(name)!r} is a file already; drop --gguf-file"
            )
        if path.suffix != ".gguf":
            raise ModelNotFoundError(
                f"{str(name)!r} is a file but not a .gguf model; pass a model directory, a .gguf "
                "file, or a Hugging Face id such as HuggingFaceTB/SmolLM2-135M-Instruct"
            )
        return path
    repo_id = str(name)
    if not _is_hub_id(repo_id):
        raise ModelNotFoundError(
            f"model {repo_id!r} does not exist: it is no local directory or .gguf file, nor a "
            "Hugging Face id of the form org/name"
        )
    return _from_hub(repo_id, revision, gguf_file)


def _is_hub_id(text: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return text.count("/") == 1


def _gguf_in(directory: Path, gguf_file: str, where: str) -> Path:
    file = directory / gguf_file
    if not file.is_file():
        present = sorted(p.name for p in directory.glob("*.gguf")) or "none"
        raise ModelNotFoundError(f"{where} has no file {gguf_file!r}; its .gguf files: {present}")
    return file


def _from_hub(repo_id: str, revision: str | None, gguf_file: str | None) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import HfHubHTTPError, LocalEntryNotFoundError

    patterns = [gguf_file] if gguf_file else CHECKPOINT_FILES
    try:
        snapshot = Path(
            snapshot_download(
                repo_id, revision=revision, allow_patterns=patterns, local_files_only=True
            )
        )
        if _complete(snapshot, gguf_file):
            return _gguf_in(snapshot, gguf_file, repo_id) if gguf_file else snapshot
    except LocalEntryNotFoundError:
        pass
    where = f"{repo_id} (revision {revision or 'main'})"
    cache = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
    if constants.HF_HUB_OFFLINE:
        wanted = f" with {gguf_file}" if gguf_file else ""
        command = f"huggingface-cli download {repo_id}" + (f" {gguf_file}" if gguf_file else "")
        command += f" --revision {revision}" if revision else ""
        raise ModelNotFoundError(
            f"model {where} is not in the Hugging Face cache{wanted} (searched {cache}) and "
            f"HF_HUB_OFFLINE=1 forbids downloading it; download it with `{command}`, or unset "
            "HF_HUB_OFFLINE"
        )
    log.info("downloading %s into %s", where, cache)
    try:
        snapshot = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except (LocalEntryNotFoundError, HfHubHTTPError) as error:
        raise ModelNotFoundError(
            f"model {where} is not in the Hugging Face cache (searched {cache}) and could not "
            f"be downloaded: {error}"
        ) from None
    return _gguf_in(snapshot, gguf_file, repo_id) if gguf_file else snapshot


def _complete(snapshot: Path, gguf_file: str | None) -> bool:
    """Whether a cached snapshot holds the model, not only files other tools fetched
    (transformers caches config.json alone when asked for a config)."""
    if gguf_file:
        return (snapshot / gguf_file).is_file()
    return (snapshot / "config.json").is_file() and any(snapshot.glob("*.safetensors"))
