"""Checkpoint files: round trip, atomic replacement, and refusal of truncated/tampered files."""

import errno
import json
import os

import numpy as np
import pytest
import torch

from fedadapt.federation.server import checkpoint
from fedadapt.federation.server.checkpoint import (
    ARRAYS,
    CHECKPOINTS,
    LATEST,
    MANIFEST,
    STATE,
    STRATEGY_ARRAYS,
    CheckpointError,
    client_rounds,
    latest_checkpoint,
    load_checkpoint,
    load_client_context,
    load_client_state,
    save_checkpoint,
    save_client_context,
    save_client_state,
    sha256_file,
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


# -- the mutants checkpoint.py's first mutation run left (docs/reliability.md) -----------------

def test_a_full_disk_names_the_file_and_leaves_no_partial_folder(tmp_path, monkeypatch):
    """A write that fails without naming its file (a full disk: ``fsync`` raises ENOSPC) is
    raised with the file's path, its errno and its message; the checkpoint's temporary folder
    is removed and ``LATEST`` still points at the previous checkpoint. Pins the mutants of
    ``_fsync_write``'s re-raise and of the error path's ``rmtree(tmp)``."""
    before = save(tmp_path, 1)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.os, "fsync", full)
    with pytest.raises(OSError) as caught:
        save(tmp_path, 2)
    assert caught.value.errno == errno.ENOSPC
    assert caught.value.strerror == "No space left on device"
    assert caught.value.filename.endswith(ARRAYS)
    assert ".round-000002.tmp" in caught.value.filename
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / CHECKPOINTS).iterdir()) == [LATEST, before.name]
    assert latest_checkpoint(tmp_path) == before


def test_an_error_naming_its_file_is_raised_as_it_is(tmp_path, monkeypatch):
    named = OSError(errno.EACCES, "Permission denied", "/somewhere/else")

    def refused(path, mode="r", *args, **kwargs):
        raise named

    monkeypatch.setattr("builtins.open", refused)
    with pytest.raises(OSError) as caught:
        checkpoint._fsync_write(tmp_path / "x", b"data")
    assert caught.value is named


def test_a_round_written_again_replaces_its_folder(tmp_path):
    """A run killed after its checkpoint's folder was renamed but before ``LATEST`` moved runs
    that round again: the second checkpoint of the round replaces the first."""
    save(tmp_path, 2, 1.0)
    folder = save(tmp_path, 2, 5.0)
    arrays, _ = load_checkpoint(folder)
    torch.testing.assert_close(arrays["head.weight"], torch.full((2, 3), 5.0))


def test_the_checkpoints_folder_is_made_with_its_parents(tmp_path):
    folder = save(tmp_path / "not" / "yet", 1)
    assert folder == tmp_path / "not" / "yet" / CHECKPOINTS / "round-000001"


def test_the_manifest_records_the_round_and_every_files_digest(tmp_path):
    folder = save(tmp_path, 7)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest == {"round": 7, "files": {
        name: sha256_file(folder / name) for name in (ARRAYS, STATE, STRATEGY_ARRAYS)}}


def test_a_garbled_latest_lists_the_checkpoints_there(tmp_path):
    """The line names the pointer's first 40 characters and the checkpoint folders present
    (or ``none``): what a user needs to mend it."""
    save(tmp_path, 4)
    pointer = tmp_path / CHECKPOINTS / LATEST
    pointer.write_text("x" * 39 + "yz")
    with pytest.raises(CheckpointError) as caught:
        latest_checkpoint(tmp_path)
    assert f"({'x' * 39 + 'y'!r} names no checkpoint folder" in str(caught.value)
    assert "checkpoints there: round-000004; write the one" in str(caught.value)
    (tmp_path / CHECKPOINTS / "round-000004").rename(tmp_path / CHECKPOINTS / "elsewhere")
    (tmp_path / CHECKPOINTS / "round-000002").mkdir()
    (tmp_path / CHECKPOINTS / "round-000003").mkdir()
    with pytest.raises(CheckpointError, match="checkpoints there: round-000002, round-000003;"):
        latest_checkpoint(tmp_path)
    for name in ("round-000002", "round-000003"):
        (tmp_path / CHECKPOINTS / name).rmdir()
    (tmp_path / CHECKPOINTS / "round-000009").write_text("a file, not a checkpoint folder")
    with pytest.raises(CheckpointError, match="checkpoints there: none;"):
        latest_checkpoint(tmp_path)


def test_an_unreadable_latest_is_refused_in_one_line(tmp_path):
    save(tmp_path, 1)
    (tmp_path / CHECKPOINTS / LATEST).write_bytes(b"\xff\xfe round")
    with pytest.raises(CheckpointError, match="<unreadable: 'utf-8' codec"):
        latest_checkpoint(tmp_path)


def test_refusals_name_what_is_wrong(tmp_path):
    """Each refusal of ``load_checkpoint`` says which file and what: the manifest's list
    against the expected one, a missing file, a file that is not safetensors (with a manifest
    that matches it)."""
    folder = save(tmp_path, 1)
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({"files": {ARRAYS: "0"}}))
    with pytest.raises(CheckpointError, match=r"it lists \['arrays\.safetensors'\], not "
                       r"\['arrays\.safetensors', 'state\.json', 'strategy\.safetensors'\]"):
        load_checkpoint(folder)
    (folder / MANIFEST).write_text(json.dumps(manifest))
    os.unlink(folder / STATE)
    with pytest.raises(CheckpointError, match=f"checkpoint file {folder / STATE} is missing"):
        load_checkpoint(folder)
    folder = save(tmp_path, 2)
    (folder / ARRAYS).write_bytes(b"not safetensors at all")
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"][ARRAYS] = sha256_file(folder / ARRAYS)
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError,
                       match=f"checkpoint file {folder / ARRAYS} is not valid safetensors"):
        load_checkpoint(folder)


def test_a_client_file_that_is_not_safetensors_is_refused_naming_it(tmp_path):
    (tmp_path / "round-000002.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError,
                       match=f"client state {tmp_path / 'round-000002.safetensors'} is unreadable"):
        load_client_state(tmp_path, 2)


def test_a_client_tensor_reshaped_fails_its_checksum(tmp_path):
    """The digest covers each tensor's shape: the same bytes as a (3, 2) tensor where (2, 3)
    was saved are refused."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    save_client_state(tmp_path, 1, {"w": torch.arange(6.0).reshape(2, 3)})
    path = tmp_path / "round-000001.safetensors"
    with safe_open(str(path), framework="pt") as fh:
        meta, w = fh.metadata(), fh.get_tensor("w")
    assert meta["round"] == "1"
    save_file({"w": w.reshape(3, 2).contiguous()}, str(path), metadata=meta)
    with pytest.raises(CheckpointError, match="fails its checksum"):
        load_client_state(tmp_path, 1)


def test_client_rounds_lists_the_saved_rounds(tmp_path):
    assert client_rounds(tmp_path / "none") == []
    for rnd in (2, 5):
        save_client_state(tmp_path, rnd, {"t": torch.zeros(1)})
    save_client_context(tmp_path, 3, b"ctx")  # a context file is not a tensor file
    assert client_rounds(tmp_path) == [2, 5]


def test_client_contexts_round_trip_newest_not_after_the_round(tmp_path):
    """A client's Flower ``Context.state`` bytes: the newest saved at a round <= the one
    asked, ``None`` before any or without the folder."""
    assert load_client_context(tmp_path / "none", 5) is None
    for rnd in (1, 3):
        save_client_context(tmp_path / "c", rnd, f"state {rnd}".encode())
    assert load_client_context(tmp_path / "c", 0) is None
    assert load_client_context(tmp_path / "c", 1) == b"state 1"
    assert load_client_context(tmp_path / "c", 2) == b"state 1"
    assert load_client_context(tmp_path / "c", 3) == b"state 3"
    assert load_client_context(tmp_path / "c", 9) == b"state 3"


def test_client_contexts_are_pruned_behind_the_checkpoint_and_tensors_alone(tmp_path):
    """Pruning a client's contexts removes contexts (all but the newest not after the
    checkpoint, everything after it stays), never its tensor files, and the reverse."""
    for rnd in range(1, 4):
        save_client_state(tmp_path, rnd, {"t": torch.zeros(1)})
    for rnd in range(1, 7):
        save_client_context(tmp_path, rnd, b"x", checkpoint_round=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "round-000001.safetensors", "round-000002.safetensors", "round-000003.safetensors",
        "round-000004.recorddict.pb", "round-000005.recorddict.pb", "round-000006.recorddict.pb"]
    save_client_state(tmp_path, 4, {"t": torch.zeros(1)}, checkpoint_round=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "round-000003.safetensors", "round-000004.recorddict.pb", "round-000004.safetensors",
        "round-000005.recorddict.pb", "round-000006.recorddict.pb"]
    save_client_context(tmp_path, 7, b"x")  # no checkpoint yet: nothing is removed
    assert len(list(tmp_path.glob("*.recorddict.pb"))) == 4


def test_a_file_pruned_by_someone_else_meanwhile_is_not_an_error(tmp_path, monkeypatch):
    """Pruning tolerates a file gone between the listing and its removal."""
    for rnd in (1, 2):
        save_client_state(tmp_path, rnd, {"t": torch.zeros(1)})
    listed = checkpoint._client_files

    def listing_then_gone(folder, suffix="safetensors"):
        files = listed(folder, suffix)
        files[0][1].unlink()
        return files

    monkeypatch.setattr(checkpoint, "_client_files", listing_then_gone)
    save_client_state(tmp_path, 3, {"t": torch.zeros(1)}, checkpoint_round=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round-000003.safetensors"]



def test_a_clients_context_folder_is_made_with_its_parents(tmp_path):
    """The first save of a client's Context makes ``clients/<id>/`` (its parent may not exist
    yet)."""
    folder = tmp_path / "clients" / "3"
    save_client_context(folder, 1, b"state")
    assert load_client_context(folder, 1) == b"state"
