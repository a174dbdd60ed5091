"""resolve_model: local paths as they are, hub ids from a Hugging Face cache made here.

Nothing is downloaded: every test runs with HF_HUB_OFFLINE=1 against a cache laid out as
huggingface_hub writes it (blobs, snapshots/<commit> of links to them, refs/<branch>).
"""

from __future__ import annotations

import importlib
import shutil

import huggingface_hub.constants
import pytest
from tiny_models import add_snapshot

from astrai.model import CheckpointError
from astrai.model.weights.hub import resolve_model

REPO = "org/name"
MAIN = "a" * 40
OTHER = "b" * 40


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty offline Hugging Face cache under HF_HOME; huggingface_hub reads its settings
    from the environment once, at import, so they are read again here and after the test."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    importlib.reload(huggingface_hub.constants)
    yield tmp_path / "hf" / "hub"
    monkeypatch.undo()
    importlib.reload(huggingface_hub.constants)


def test_a_hub_id_resolves_to_its_cached_snapshot(hf_cache, llama_dir):
    snapshot = add_snapshot(hf_cache, REPO, MAIN, llama_dir, "main")
    assert resolve_model(REPO) == snapshot
    assert resolve_model(REPO, revision="main") == snapshot
    assert (resolve_model(REPO) / "config.json").read_bytes() == (
        llama_dir / "config.json"
    ).read_bytes()


def test_hf_hub_cache_wins_over_hf_home(hf_cache, tmp_path, llama_dir, monkeypatch):
    cache = tmp_path / "elsewhere"
    snapshot = add_snapshot(cache, REPO, MAIN, llama_dir, "main")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    importlib.reload(huggingface_hub.constants)
    assert resolve_model(REPO) == snapshot


def test_revision_picks_a_branch_or_a_commit(hf_cache, llama_dir, tmp_path):
    main = add_snapshot(hf_cache, REPO, MAIN, llama_dir, "main")
    other = add_snapshot(hf_cache, REPO, OTHER, llama_dir, "v2")
    assert resolve_model(REPO) == main
    assert resolve_model(REPO, revision="v2") == other
    assert resolve_model(REPO, revision=OTHER) == other
    with pytest.raises(CheckpointError, match="revision v3"):
        resolve_model(REPO, revision="v3")


def test_gguf_file_picks_a_file_of_the_snapshot(hf_cache, tmp_path):
    files = tmp_path / "repo"
    files.mkdir()
    (files / "model.Q4_1.gguf").write_bytes(b"GGUF q4_1")
    (files / "model.Q8_0.gguf").write_bytes(b"GGUF q8_0")
    snapshot = add_snapshot(hf_cache, REPO, MAIN, files, "main")
    assert resolve_model(REPO, gguf_file="model.Q8_0.gguf") == snapshot / "model.Q8_0.gguf"
    assert resolve_model(REPO, gguf_file="model.Q4_1.gguf").read_bytes() == b"GGUF q4_1"
    with pytest.raises(CheckpointError, match="model.F16.gguf") as error:
        resolve_model(REPO, gguf_file="model.F16.gguf")
    assert "huggingface-cli download org/name model.F16.gguf" in str(error.value)


def test_a_missing_id_offline_says_where_it_looked_and_how_to_download(hf_cache):
    with pytest.raises(CheckpointError) as error:
        resolve_model("org/absent", revision="v1")
    message = str(error.value)
    assert "org/absent (revision v1)" in message
    assert str(hf_cache / "models--org--absent") in message
    assert "huggingface-cli download org/absent --revision v1" in message
    assert "unset HF_HUB_OFFLINE" in message


def test_a_snapshot_without_weights_is_not_taken_for_the_model(hf_cache, tmp_path):
    """transformers caches config.json alone when asked for a config."""
    files = tmp_path / "config_only"
    files.mkdir()
    (files / "config.json").write_text("{}")
    add_snapshot(hf_cache, REPO, MAIN, files, "main")
    with pytest.raises(CheckpointError, match="is not in the Hugging Face cache"):
        resolve_model(REPO)


def test_local_paths_are_returned_as_they_are(hf_cache, llama_dir, tmp_path):
    assert resolve_model(llama_dir) == llama_dir
    assert resolve_model(str(llama_dir)) == llama_dir
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(gguf) == gguf
    shutil.copy(gguf, tmp_path / "repo.gguf")
    assert resolve_model(tmp_path, gguf_file="repo.gguf") == tmp_path / "repo.gguf"


@pytest.mark.parametrize("name", ["nope", "/no/such/dir", "a/b/c", "org/bad..name"])
def test_a_name_that_is_no_path_nor_hub_id_does_not_exist(hf_cache, name):
    with pytest.raises(CheckpointError, match=f"model '{name}' does not exist"):
        resolve_model(name)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    config = tmp_path / "config.json"
    config.write_text("{}")
    with pytest.raises(CheckpointError, match="is a file but not a .gguf model"):
        resolve_model(config)


def test_options_a_local_path_cannot_use_are_refused(llama_dir, tmp_path):
    """--revision and --gguf-file must not be accepted and then ignored."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    for name in (llama_dir, gguf):
        with pytest.raises(CheckpointError, match="--revision 'v2' applies to Hugging Face ids"):
            resolve_model(name, revision="v2")
    with pytest.raises(CheckpointError, match="is a file already; drop --gguf-file"):
        resolve_model(gguf, gguf_file="other.gguf")
