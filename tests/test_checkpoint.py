"""Checkpoint files: round trip, atomic replacement, and refusal of truncated/tampered files."""

import json

import numpy as np
import pytest
import torch

from fedadapt.federation.server.checkpoint import (
    ARRAYS,
    CHECKPOINTS,
    LATEST,
    STATE,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    load_client_state,
    save_checkpoint,
    save_client_state,
)


def save(tmp_path, rnd, value=1.0):
    return save_checkpoint(tmp_path, server_round=rnd,
                           arrays={"head.weight": torch.full((2, 3), value)},
                           state={"history": [{"round": rnd}], "strategy": {"rng": [1, 2]}},
                           config_sha="abc")


def test_round_trip_and_latest(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    save(tmp_path, 2, 1.0)
    folder = save(tmp_path, 4, 2.0)
    assert latest_checkpoint(tmp_path) == folder
    assert [p.name for p in (tmp_path / CHECKPOINTS).iterdir() if p.is_dir()] == [folder.name]
    arrays, state = load_checkpoint(folder, config_sha="abc")
    torch.testing.assert_close(arrays["head.weight"], torch.full((2, 3), 2.0))
    assert state["round"] == 4 and state["strategy"] == {"rng": [1, 2]}


@pytest.mark.parametrize("damage", ["truncate", "flip", "state", "manifest"])
def test_damaged_checkpoint_is_refused_naming_the_file(tmp_path, damage):
    folder = save(tmp_path, 3)
    target = {"truncate": ARRAYS, "flip": ARRAYS, "state": STATE, "manifest": "manifest.json"}[
        damage]
    path = folder / target
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "state":
        path.write_text(json.dumps({**json.loads(data), "round": 99}))
    else:
        path.unlink()
    with pytest.raises(CheckpointError, match=target.replace(".", r"\.")):
        load_checkpoint(folder)


def test_checkpoint_of_another_config_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="different config"):
        load_checkpoint(save(tmp_path, 1), config_sha="other")


def test_dangling_latest_pointer(tmp_path):
    save(tmp_path, 1)
    (tmp_path / CHECKPOINTS / LATEST).write_text("round-000007")
    with pytest.raises(CheckpointError, match="round-000007"):
        latest_checkpoint(tmp_path)


def test_client_state_newest_not_after_round(tmp_path):
    for rnd in (1, 3, 5):
        save_client_state(tmp_path, rnd, {"head.bias": torch.full((2,), float(rnd))})
    assert load_client_state(tmp_path, 0) is None
    torch.testing.assert_close(load_client_state(tmp_path, 4)["head.bias"], torch.full((2,), 3.))
    torch.testing.assert_close(load_client_state(tmp_path, 9)["head.bias"], torch.full((2,), 5.))
    path = tmp_path / "round-000005.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CheckpointError, match="round-000005"):
        load_client_state(tmp_path, 9)


def test_client_files_are_pruned_behind_the_checkpoint(tmp_path):
    for rnd in range(1, 7):
        save_client_state(tmp_path, rnd, {"t": torch.zeros(1)}, checkpoint_round=4)
    names = sorted(p.name for p in tmp_path.iterdir())
    # the newest file not after the checkpoint (round 4) and everything after it
    assert names == ["round-000004.safetensors", "round-000005.safetensors",
                     "round-000006.safetensors"]


def test_stale_temporary_folders_are_removed(tmp_path):
    stale = tmp_path / CHECKPOINTS / ".round-000002.tmp999999"
    stale.mkdir(parents=True)
    save(tmp_path, 3)
    assert not stale.exists()


def test_manifest_must_cover_both_files(tmp_path):
    folder = save(tmp_path, 1)
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["files"][STATE]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="manifest"):
        load_checkpoint(folder)


def test_client_state_of_the_checkpoints_own_round_is_loaded(tmp_path):
    """Pins ``load_client_state`` asking ``<`` instead of ``<=``: a resume after round 3 loads
    the tensors the client saved after round 3, not an older file."""
    for rnd in (1, 3):
        save_client_state(tmp_path, rnd, {"head.bias": torch.full((2,), float(rnd))})
    torch.testing.assert_close(load_client_state(tmp_path, 3)["head.bias"], torch.full((2,), 3.))
    torch.testing.assert_close(load_client_state(tmp_path, 1)["head.bias"], torch.full((2,), 1.))


def test_the_strategys_arrays_round_trip_through_the_checkpoint(tmp_path):
    """Pins a checkpoint written without the strategy's arrays (FedAdam's moments, FedAvgM's
    momentum): they are loaded back as ``state["strategy_arrays"]``, bit for bit."""
    momentum = {"momentum.head.weight": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
                "m_t.0": np.array([1e-30, -2.5], dtype=np.float64)}
    folder = save_checkpoint(tmp_path, server_round=2,
                             arrays={"head.weight": torch.ones(2, 3)}, state={},
                             config_sha="abc", strategy_arrays=momentum)
    _, state = load_checkpoint(folder, config_sha="abc")
    assert sorted(state["strategy_arrays"]) == sorted(momentum)
    for name, value in momentum.items():
        assert state["strategy_arrays"][name].dtype == value.dtype
        np.testing.assert_array_equal(state["strategy_arrays"][name], value)
