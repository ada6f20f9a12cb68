"""Checkpoint folders: manifests, verification naming the damaged file, the resume fallback and
atomic copies (folders built from plain files: no model needed)."""
import json
import shutil

import pytest

from dmc.megatron import checkpoint as ckpt


def _folder(root, name, step, latest=True):
    """A checkpoint-shaped folder: state.json, a shard, an RNG file and the manifest."""
    folder = root / name
    (folder / "shards").mkdir(parents=True)
    (folder / ckpt.STATE).write_text(json.dumps({"kind": "retrofit", "step": step}))
    (folder / "shards" / "0.distcp").write_bytes(bytes(range(256)) * 64)
    (folder / "rng_rank0.pt").write_bytes(b"rng" * 100)
    ckpt.write_manifest(folder)
    if latest:
        (root / ckpt.LATEST).write_text(name)
    return folder


def _flip(path, at=100):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_manifest_lists_every_file_with_size_and_checksum(tmp_path):
    folder = _folder(tmp_path, "step_0000003", 3)
    files = json.loads((folder / ckpt.MANIFEST).read_text())["files"]
    assert sorted(files) == ["rng_rank0.pt", "shards/0.distcp", "state.json"]
    assert files["shards/0.distcp"]["size"] == 256 * 64
    assert ckpt.verify_checkpoint(folder) is True


@pytest.mark.parametrize("damage, message", [
    (lambda f: _flip(f / "shards" / "0.distcp"), "shards/0.distcp: contents changed"),
    (lambda f: (f / "rng_rank0.pt").write_bytes(b"rng"), "rng_rank0.pt: 3 bytes, 300"),
    (lambda f: (f / "shards" / "0.distcp").unlink(), "shards/0.distcp: missing"),
    (lambda f: (f / ckpt.MANIFEST).write_text("{trunc"), "manifest.json: unreadable"),
])
def test_damage_is_an_error_naming_the_file(tmp_path, damage, message):
    folder = _folder(tmp_path, "step_0000003", 3)
    damage(folder)
    with pytest.raises(ckpt.CheckpointError, match=message):
        ckpt.verify_checkpoint(folder)
    assert not ckpt.is_complete(folder)


def test_a_size_check_catches_truncation_without_reading(tmp_path):
    folder = _folder(tmp_path, "step_0000003", 3)
    _flip(folder / "shards" / "0.distcp")  # same size: only the hash sees it
    assert ckpt.verify_checkpoint(folder, contents=False) is True
    with pytest.raises(ckpt.CheckpointError, match="contents changed"):
        ckpt.verify_checkpoint(folder)
    shard = folder / "shards" / "0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(ckpt.CheckpointError, match=r"0.distcp: 16383 bytes, 16384 when written"):
        ckpt.verify_checkpoint(folder, contents=False)


def test_truncated_state_is_named(tmp_path):
    folder = _folder(tmp_path, "step_0000003", 3)
    (folder / ckpt.STATE).write_text('{"kind": "retro')
    with pytest.raises(ckpt.CheckpointError, match="state.json: not valid JSON"):
        ckpt.read_state(folder)


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path):
    older = _folder(tmp_path, "step_0000003", 3)
    _folder(tmp_path, "cr_1.5", 5, latest=False)
    newest = _folder(tmp_path, "step_0000006", 6)
    assert ckpt.resumable_checkpoint(tmp_path) == newest
    _flip(newest / "shards" / "0.distcp")
    with pytest.warns(UserWarning, match=r"step_0000006/shards/0.distcp.*resuming from .*cr_1.5"):
        assert ckpt.resumable_checkpoint(tmp_path) == tmp_path / "cr_1.5"
    _flip(tmp_path / "cr_1.5" / "rng_rank0.pt")
    with pytest.warns(UserWarning, match="resuming from .*step_0000003"):
        assert ckpt.resumable_checkpoint(tmp_path) == older
    with pytest.raises(ckpt.CheckpointError, match="checkpoint.fallback is false"):
        ckpt.resumable_checkpoint(tmp_path, fallback=False)
    _flip(older / "shards" / "0.distcp")
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint verifies"):
        ckpt.resumable_checkpoint(tmp_path)


def test_a_fresh_run_and_a_dangling_pointer(tmp_path):
    assert ckpt.resumable_checkpoint(tmp_path / "none") is None
    older = _folder(tmp_path, "step_0000003", 3)
    (tmp_path / ckpt.LATEST).write_text("step_0000009")  # killed between rename and pointer
    with pytest.warns(UserWarning, match="'step_0000009'.*resuming from .*step_0000003"):
        assert ckpt.resumable_checkpoint(tmp_path) == older


def test_folders_without_a_manifest_load_with_a_warning(tmp_path):
    folder = _folder(tmp_path, "step_0000003", 3)
    (folder / ckpt.MANIFEST).unlink()
    with pytest.warns(UserWarning, match="no manifest.json"):
        assert ckpt.verify_checkpoint(folder) is False
    assert ckpt.resumable_checkpoint(tmp_path) == folder


def test_copy_is_atomic_and_redone_after_a_kill(tmp_path, monkeypatch):
    src = _folder(tmp_path, "step_0000006", 6)
    dst = tmp_path / "retrofit"
    real_copytree = shutil.copytree

    def killed_midway(a, b, **kw):
        (b / "shards").mkdir(parents=True)
        shutil.copy(a / "shards" / "0.distcp", b / "shards" / "0.distcp")
        raise KeyboardInterrupt("killed during the copy")

    monkeypatch.setattr(shutil, "copytree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        ckpt.copy_checkpoint(src, dst)
    assert not dst.exists() and not ckpt.is_complete(tmp_path / "retrofit.tmp")
    monkeypatch.setattr(shutil, "copytree", real_copytree)
    ckpt.copy_checkpoint(src, dst)
    assert ckpt.verify_checkpoint(dst) and not (tmp_path / "retrofit.tmp").exists()
    assert ckpt.read_state(dst)["step"] == 6


def test_content_digest_follows_the_files_not_the_folder(tmp_path):
    first = tmp_path / "run_a" / "checkpoints" / "pretrain"
    first.mkdir(parents=True)
    (first / "__0_0.distcp").write_bytes(b"weights")
    (first / "state.json").write_text(json.dumps({"run_dir": str(tmp_path / "run_a")}))
    ckpt.write_manifest(first)
    moved = tmp_path / "elsewhere" / "base"
    shutil.copytree(first, moved)
    (moved / "state.json").write_text(json.dumps({"run_dir": str(tmp_path / "elsewhere")}))
    ckpt.write_manifest(moved)
    assert ckpt.content_digest(moved) == ckpt.content_digest(first)
    (moved / "__0_0.distcp").write_bytes(b"weights, trained on")
    ckpt.write_manifest(moved)
    assert ckpt.content_digest(moved) != ckpt.content_digest(first)
    (moved / "manifest.json").unlink()  # a folder without one (a converted checkpoint)
    assert ckpt.content_digest(moved) != ckpt.content_digest(first)
    (moved / "__0_0.distcp").write_bytes(b"weights")
    assert ckpt.content_digest(moved) == ckpt.content_digest(first)
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint files"):
        ckpt.content_digest(tmp_path / "empty")


def test_pruning_keeps_latest_and_orders_by_the_saved_step(tmp_path):
    """Names that do not sort like their steps (step_999 after step_1000): the newest by
    state.json are kept, and the folder ``latest`` names is never removed."""
    for step in (998, 999):
        _folder(tmp_path, f"step_{step}", step)
    _folder(tmp_path, "step_1000", 1000)
    ckpt.prune_checkpoints(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_1000", "step_999"]
    ckpt.prune_checkpoints(tmp_path, keep_last=1)
    assert [p.name for p in tmp_path.glob("step_*")] == ["step_1000"]


def test_pruning_after_a_fallback_resume_keeps_what_the_run_saved(tmp_path):
    """A run fell back from a damaged step_0000006 to step 2 and has just saved step 4: the
    damaged folder (above the latest step) and a truncated one do not count as the newest,
    so the newest folder that verifies is kept beside latest; the uncounted are left in place
    (a later save of that name replaces them)."""
    _folder(tmp_path, "step_0000001", 1)
    _folder(tmp_path, "step_0000002", 2)
    truncated = _folder(tmp_path, "step_0000003", 3)
    (truncated / "rng_rank0.pt").write_bytes(b"rng")
    _flip(_folder(tmp_path, "step_0000006", 6) / "shards" / "0.distcp")
    _folder(tmp_path, "cr_1.5", 5, latest=False)
    _folder(tmp_path, "step_0000004", 4)
    ckpt.prune_checkpoints(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "cr_1.5", "step_0000002", "step_0000003", "step_0000004", "step_0000006"]
    assert ckpt.resumable_checkpoint(tmp_path) == tmp_path / "step_0000004"
