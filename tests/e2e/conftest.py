"""Fixtures for end-to-end tests: real data, prepared once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def shakespeare_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shakespeare tokenized with GPT-2 BPE, prepared once per test session."""
    from plugintrain.data import prepare_shakespeare

    out = tmp_path_factory.mktemp("shakespeare_gpt2")
    prepare_shakespeare(out, tokenizer="gpt2")
    return out


@pytest.fixture(scope="session")
def shakespeare_llama3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shakespeare tokenized with the Llama 3 tokenizer, prepared once per test session."""
    from plugintrain.data import prepare_shakespeare

    out = tmp_path_factory.mktemp("shakespeare_llama3")
    prepare_shakespeare(out, tokenizer="llama3")
    return out


@pytest.fixture(scope="session")
def mnist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 5,000 real MNIST digits as IDX files, prepared once per test session."""
    from plugintrain.data import prepare_mnist

    out = tmp_path_factory.mktemp("mnist")
    prepare_mnist(out)
    return out


@pytest.fixture(scope="session")
def uninterrupted_llama3_run(
    shakespeare_llama3: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[int, float], Path]:
    """One uninterrupted single-process run of the Llama debug recipe (8 steps at batch 4,
    seq_len 32, a checkpoint every 2 steps, all kept): step -> loss, and its checkpoint
    directory (``epoch=0-step=<n>.ckpt`` files), shared by every test that needs it."""
    from kill_during_save import NAME, STEPS, save_events

    work = tmp_path_factory.mktemp("uninterrupted")
    losses, _ = save_events(shakespeare_llama3, work, "single", "--checkpoint.save_top_k=-1")
    assert sorted(losses) == list(range(STEPS))
    return losses, work / "single_reference" / NAME / "checkpoints"


@pytest.fixture(scope="session")
def uninterrupted_llama3(
    uninterrupted_llama3_run: tuple[dict[int, float], Path],
) -> dict[int, float]:
    """Step -> loss of the uninterrupted single-process run: what every resumed layout
    must reproduce."""
    return uninterrupted_llama3_run[0]
