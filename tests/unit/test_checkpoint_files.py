"""Checkpoints on disk: atomic publication, recovery after a kill, and no code from files.

A planted pickle payload creates a marker file when unpickled; every reader must refuse it
with an error naming the file, and the marker must never appear.
"""

from __future__ import annotations

import pathlib
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from plugintrain.checkpoints.dcp import read_full, read_weights, save_directory
from plugintrain.checkpoints.files import (
    CorruptCheckpointError,
    UnsafeCheckpointError,
    is_complete,
    load_torch_file,
    newest_complete,
    read_dcp_metadata,
    recover,
)
from plugintrain.checkpoints.single_file import SingleFileReader
from plugintrain.core.atomic_files import publish, write_file_atomically


class Payload:
    """Unpickling this touches ``marker``: proof that loading ran code."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def _directory_checkpoint(path: pathlib.Path, step: int = 1) -> None:
    checkpoint = {
        "state_dict": {"w": torch.full((4, 3), float(step)), "b": torch.zeros(3)},
        "optimizer_states": [
            {
                "state": {"w": {"exp_avg": torch.ones(4, 3), "step": torch.tensor(3.0)}},
                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": []}],
            }
        ],
        "global_step": step,
        "hyper_parameters": {"config": "gpt2-debug"},
    }
    save_directory(checkpoint, path, write_metadata=True)


def test_a_failed_file_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "last.ckpt"
    write_file_atomically(path, lambda f: f.write(b"old"))

    def dies_midway(stream):
        stream.write(b"half of the new")
        raise KeyboardInterrupt  # stands in for a kill

    with pytest.raises(KeyboardInterrupt):
        write_file_atomically(path, dies_midway)
    assert path.read_bytes() == b"old"
    assert recover(tmp_path) == [f"removed {path}.partial (left by a killed save)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_directory_replaces_a_directory_and_a_file(tmp_path):
    target = tmp_path / "last.ckpt"
    target.write_bytes(b"single file")
    for content in ("one", "two"):
        partial = tmp_path / "new.partial"
        partial.mkdir()
        (partial / "x").write_text(content)
        publish(partial, target)
        assert (target / "x").read_text() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_recover_restores_a_checkpoint_retired_by_a_killed_swap(tmp_path):
    _directory_checkpoint(tmp_path / "a.ckpt")
    (tmp_path / "a.ckpt").rename(tmp_path / "last.ckpt.retired")  # killed between renames
    (tmp_path / "last.ckpt.partial").mkdir()  # ... while the new one was still partial
    assert newest_complete(tmp_path) is None
    done = recover(tmp_path)
    assert len(done) == 2 and "restored" in done[1] and "removed" in done[0]
    assert newest_complete(tmp_path) == tmp_path / "last.ckpt"
    assert read_weights(tmp_path / "last.ckpt")["w"].eq(1.0).all()


def test_newest_complete_skips_partial_and_incomplete_checkpoints(tmp_path):
    _directory_checkpoint(tmp_path / "step=1.ckpt", step=1)
    _directory_checkpoint(tmp_path / "step=2.ckpt", step=2)
    (tmp_path / "step=2.ckpt" / "meta.pt").unlink()  # written in place and cut short
    (tmp_path / "step=3.ckpt.partial").mkdir()
    assert not is_complete(tmp_path / "step=2.ckpt")
    assert newest_complete(tmp_path) == tmp_path / "step=1.ckpt"


def test_a_truncated_shard_file_is_named(tmp_path):
    path = tmp_path / "last.ckpt"
    _directory_checkpoint(path)
    shard = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(CorruptCheckpointError, match=f"{shard} holds 10 bytes"):
        read_weights(path)


def test_a_truncated_file_is_named(tmp_path):
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.ones(100)}}, path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CorruptCheckpointError, match=f"{path} is truncated"):
        load_torch_file(path)


def test_a_directory_reads_back_whole_for_one_process(tmp_path):
    _directory_checkpoint(tmp_path / "c.ckpt", step=5)
    checkpoint = read_full(tmp_path / "c.ckpt")
    assert checkpoint["global_step"] == 5
    assert checkpoint["state_dict"]["w"].eq(5.0).all()
    (optimizer,) = checkpoint["optimizer_states"]
    assert optimizer["state"]["w"]["exp_avg"].eq(1.0).all()
    assert optimizer["param_groups"][0]["betas"] == (0.9, 0.95)


def test_a_single_file_reads_as_the_directory_would(tmp_path):
    file = tmp_path / "one.ckpt"
    state = {"exp_avg": torch.arange(12.0).reshape(4, 3), "step": torch.tensor(2.0)}
    torch.save(
        {
            "state_dict": {"w": torch.ones(4, 3)},
            "optimizer_states": [{"state": {0: state}, "param_groups": [{"lr": 1, "params": [0]}]}],
            "optimizer_param_names": [[["w"]]],
        },
        file,
    )
    reader = SingleFileReader(file)
    keys = set(reader.read_metadata().state_dict_metadata)
    assert {"state_dict.w", "optimizer_0.state.w.exp_avg", "optimizer_0.param_groups.0.lr"} <= keys
    target = {"optimizer_0": {"state": {"w": {"exp_avg": torch.zeros(2, 3)}}}}
    # A rank that owns rows 2..3 asks for that box only.
    from plugintrain.checkpoints.dcp import ShardBoxes, ShardLoadPlanner

    flat = torch.zeros(6)
    target["optimizer_0"]["state"]["w"]["exp_avg"] = ShardBoxes.of_range(torch.empty(4, 3), 6, flat)
    dcp.load(target, storage_reader=reader, planner=ShardLoadPlanner())
    assert flat.tolist() == list(range(6, 12))


# ---- planted payloads: nothing runs, the error names the file ----------------------------


def test_a_payload_in_a_single_file_checkpoint_is_refused(tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"x": Payload(marker)}}, path)
    with pytest.raises(UnsafeCheckpointError, match=str(path)):
        load_torch_file(path)
    with pytest.raises(UnsafeCheckpointError, match=str(path)):
        SingleFileReader(path)
    assert not marker.exists()


@pytest.mark.parametrize("planted", ["meta.pt", ".metadata"])
def test_a_payload_in_a_directory_metadata_file_is_refused(tmp_path, planted):
    marker, path = tmp_path / "ran", tmp_path / "last.ckpt"
    _directory_checkpoint(path)
    if planted == ".metadata":
        (path / planted).write_bytes(pickle.dumps(Payload(marker)))
        with pytest.raises(UnsafeCheckpointError, match=str(path / planted)):
            read_dcp_metadata(path)
    else:
        torch.save({"global_step": Payload(marker)}, path / planted)
    with pytest.raises(UnsafeCheckpointError, match=str(path / planted)):
        read_full(path)
    assert not marker.exists()


def test_a_payload_among_the_saved_extras_is_refused(tmp_path):
    """DCP stores non-tensor values (optimizer group settings) as pickled bytes in the
    shard files; they are read with ``weights_only=True``."""
    marker, path = tmp_path / "ran", tmp_path / "last.ckpt"
    checkpoint = {
        "state_dict": {"w": torch.ones(2)},
        "optimizer_states": [{"state": {}, "param_groups": [{"lr": Payload(marker)}]}],
    }
    save_directory(checkpoint, path, write_metadata=True)
    refused = rf"{path}/.*\.distcp holds a value .*Unsupported global"
    with pytest.raises(UnsafeCheckpointError, match=refused):
        read_full(path)
    assert not marker.exists()


def test_a_payload_in_the_hyperparameters_json_cannot_run(tmp_path):
    from plugintrain.checkpoints.dcp import HPARAMS_FILENAME, read_hparams

    marker, path = tmp_path / "ran", tmp_path / "last.ckpt"
    _directory_checkpoint(path)
    (path / HPARAMS_FILENAME).write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(ValueError, match=str(path / HPARAMS_FILENAME)):
        read_hparams(path)
    assert not marker.exists()


def test_metadata_allow_list_admits_what_dcp_writes(tmp_path):
    _directory_checkpoint(tmp_path / "ok.ckpt")
    metadata = read_dcp_metadata(tmp_path / "ok.ckpt")
    assert "state_dict.w" in metadata.state_dict_metadata
