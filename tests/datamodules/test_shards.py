"""Shards: atomic writes, checksums, corruption reported by name with both checksums."""

import hashlib
import os
import shutil

import pytest
import torch

from datamodules.labels import shards as S
from generation.fingerprints import sha256_file


def _tensors():
    return {"target.features": torch.randn(5, 8).half(), "target.label": torch.rand(5),
            "draft.features": torch.zeros(0, 4).half()}


def test_write_and_read_round_trip(tmp_path):
    path = S.write_shard(tmp_path / S.shard_name(3), _tensors(), {"shard": "3"})
    assert path.name == "shard-00003.safetensors"
    back = S.read_shard(path)
    for k, v in _tensors().items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
    assert S.shard_shapes(path)["draft.features"] == [0, 4]
    assert sha256_file(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    def boom(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a shard")
        raise KeyboardInterrupt  # killed mid-write

    monkeypatch.setattr("safetensors.torch.save_file", boom)  # write_shard imports it when it writes
    with pytest.raises(KeyboardInterrupt):
        S.write_shard(tmp_path / "shard-00000.safetensors", _tensors())
    assert list(tmp_path.iterdir()) == []


def test_atomic_json_replaces_whole_file(tmp_path):
    S.atomic_write_json(tmp_path / "m.json", {"a": 1})
    S.atomic_write_json(tmp_path / "m.json", {"b": [1, 2]})
    assert S.read_manifest(tmp_path) is None
    (tmp_path / S.MANIFEST).write_text("{broken")
    with pytest.raises(ValueError, match="manifest.json is not valid JSON"):
        S.read_manifest(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_verify_names_shard_and_both_checksums(tmp_path, damage):
    path = S.write_shard(tmp_path / "shard-00000.safetensors", _tensors())
    expected = sha256_file(path)
    S.verify_file(path, expected)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    actual = hashlib.sha256(bytes(data)).hexdigest()
    with pytest.raises(S.CorruptShardError) as err:
        S.verify_file(path, expected)
    assert str(path) in str(err.value) and expected in str(err.value) and actual in str(err.value)
    with pytest.raises(S.CorruptShardError, match="missing"):
        S.verify_file(tmp_path / "shard-00009.safetensors", expected)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_shards_take_the_same_mode_as_the_manifest(tmp_path, umask):
    import os
    import stat

    old = os.umask(umask)
    try:
        shard = S.write_shard(tmp_path / S.shard_name(0), _tensors())
        manifest = S.atomic_write_json(tmp_path / S.MANIFEST, {"complete": True})
    finally:
        os.umask(old)
    def mode(p):
        return stat.S_IMODE(p.stat().st_mode)
    assert mode(shard) == mode(manifest) == 0o666 & ~umask  # 0644 under umask 022 (safetensors alone writes 0600)


def test_write_dataset_records_every_shard_and_role(tmp_path):
    reads = {r: {"name_or_path": r, "hidden_size": w} for r, w in (("target", 8), ("draft", 4))}
    build = {"reads": reads, "layer_ids": [-1], "pooling": "mean"}
    shards = ({"target.features": torch.randn(k + 2, 8).half(),
               "draft.features": torch.randn(k, 4).half()} for k in range(3))
    m = S.write_dataset(tmp_path / "d", shards, build, n_prefixes=7)  # a generator: shards are written one by one
    assert m == S.read_manifest(tmp_path / "d") and m["complete"] and m["build"] == build and m["n_prefixes"] == 7
    assert m["roles"] == {"target": {"width": 8, "rows": 2 + 3 + 4}, "draft": {"width": 4, "rows": 0 + 1 + 2}}
    assert [e["count"] for e in m["shards"]] == [{"target": k + 2, "draft": k} for k in range(3)]
    for e in m["shards"]:
        S.verify_file(tmp_path / "d" / e["file"], e["sha256"])
        assert "steps_file" not in e  # no step texts were given
    again = S.write_dataset(tmp_path / "e", [S.read_shard(tmp_path / "d" / e["file"]) for e in m["shards"]], build)
    assert [e["sha256"] for e in again["shards"]] == [e["sha256"] for e in m["shards"]]  # byte-stable shards


def test_shard_files_carry_their_step_texts(tmp_path):
    steps = [{"prefix_id": 0, "samples": [{"text": "3 + 4 = 7.\n\n"}]}]
    S.write_shard_files(tmp_path, 0, {"target.features": torch.zeros(1, 2).half()}, steps)
    m = S.write_manifest(tmp_path, {"reads": {"target": {"hidden_size": 2}}}, 1)
    (entry,) = m["shards"]
    assert entry["steps_file"] == S.steps_name(0) and entry["steps_sha256"] == sha256_file(tmp_path / S.steps_name(0))
    assert (tmp_path / S.steps_name(0)).read_text() == '{"prefix_id": 0, "samples": [{"text": "3 + 4 = 7.\\n\\n"}]}\n'
    assert list(m["roles"]) == ["target"]  # the roles the build record reads, not a fixed pair


def test_the_weights_stamp_sees_a_change_anywhere_in_a_large_file_and_only_the_content(tmp_path):
    """A retrained layer in the middle of a large weights file changes the stamp (the first and last MiB, all it once
    read, can stay the same); a copy of the folder elsewhere keeps it."""
    from generation.fingerprints import weights_stamp

    g = torch.Generator().manual_seed(0)
    blob = bytearray(torch.randint(0, 256, (12 << 20,), dtype=torch.uint8, generator=g).numpy().tobytes())
    a = tmp_path / "a"
    a.mkdir()
    (a / "model.safetensors").write_bytes(blob)
    stamp = weights_stamp(a)
    blob[5 << 20 : 7 << 20] = bytes(2 << 20)  # two middle MiB, as a retrained layer
    b = tmp_path / "b"
    b.mkdir()
    (b / "model.safetensors").write_bytes(blob)
    assert weights_stamp(b) != stamp
    c = tmp_path / "c"
    shutil.copytree(b, c)
    assert weights_stamp(c) == weights_stamp(b) and weights_stamp(tmp_path / "empty") == weights_stamp(tmp_path / "x")
    weights = a / "model.safetensors"  # retrained in place in this process: stamped again, not taken from memory
    before = weights.stat().st_mtime_ns
    weights.write_bytes(blob)
    os.utime(weights, ns=(before + 10**9, before + 10**9))  # a retraining's write comes later than the clock's tick
    assert weights_stamp(a) == weights_stamp(b) != stamp
