"""The on-disk cache of timed kernel choices: keyed by what the timing depends on, and never a
reason to fail when the file is broken or cannot be written."""

from __future__ import annotations

import torch

from astrai.kernels import tuning_cache


def test_stored_paths_come_back_under_their_key_only(tmp_path, monkeypatch):
    monkeypatch.setenv("ASTRAI_CACHE_DIR", str(tmp_path))
    key = tuning_cache.tuning_key("linear", torch.float32, ((8, 16),))
    assert tuning_cache.lookup(key) is None
    tuning_cache.store(key, ["kernel", "gemm"])
    other = tuning_cache.tuning_key("linear", torch.float32, ((8, 32),))
    tuning_cache.store(other, ["gemm", "gemm"])
    assert tuning_cache.lookup(key) == ["kernel", "gemm"]
    assert tuning_cache.lookup(other) == ["gemm", "gemm"]
    assert [p.name for p in tmp_path.iterdir()] == [tuning_cache.CACHE_FILE]  # no leftovers


def test_the_key_follows_dtype_shapes_kind_and_threads(monkeypatch):
    key = tuning_cache.tuning_key("linear", torch.float32, ((8, 16),))
    assert key == tuning_cache.tuning_key("linear", torch.float32, ((8, 16),))
    assert key != tuning_cache.tuning_key("linear", torch.bfloat16, ((8, 16),))
    assert key != tuning_cache.tuning_key("quant_linear", torch.float32, ((8, 16),))
    assert key != tuning_cache.tuning_key("linear", torch.float32, ((16, 16),))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert key != tuning_cache.tuning_key("linear", torch.float32, ((8, 16),))
    finally:
        torch.set_num_threads(threads)


def test_a_broken_or_unwritable_cache_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("ASTRAI_CACHE_DIR", str(tmp_path))
    (tmp_path / tuning_cache.CACHE_FILE).write_text("{not json")
    assert tuning_cache.lookup("anything") is None
    tuning_cache.store("key", ["kernel"])  # replaces the broken file
    assert tuning_cache.lookup("key") == ["kernel"]
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("ASTRAI_CACHE_DIR", str(blocked / "below a file"))
    tuning_cache.store("key", ["gemm"])  # no directory can be made: nothing raised
    assert tuning_cache.lookup("key") is None


def test_default_location_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("ASTRAI_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuning_cache.cache_dir() == tmp_path / "astrai"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert tuning_cache.cache_dir() == tmp_path.home() / ".cache" / "astrai"
