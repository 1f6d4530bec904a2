"""Agreement of two label builds: shared step texts, their groups and their q labels."""

import json

import pytest

from datamodules.labels.agreement import label_agreement


def _dataset(folder, prefixes):
    """A finished dataset's manifest and step texts: ``prefixes`` is ``{(problem, prefix): [(text, group, q)]}``."""
    folder.mkdir()
    lines = [json.dumps({"problem_id": pid, "prefix_id": xid, "prefix": f"P{pid}.{xid}", "step_index": 0,
                         "samples": [{"sample_id": i, "writer": 0, "text": t, "group": g, "q": q, "p": 0.5}
                                     for i, (t, g, q) in enumerate(samples)]})
             for (pid, xid), samples in prefixes.items()]
    (folder / "steps-00000.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "manifest.json").write_text(json.dumps({
        "format_version": 3, "complete": True,
        "shards": [{"file": "shard-00000.safetensors", "sha256": "0" * 64, "steps_file": "steps-00000.jsonl"}]}))
    return folder


def test_identical_builds_agree_fully(tmp_path):
    pre = {(0, 0): [("a", 0, 0.5), ("b", 0, 0.5), ("c", 1, 0.5)], (1, 0): [("x", 0, 1.0), ("y", 1, 0.0)]}
    got = label_agreement(_dataset(tmp_path / "a", pre), _dataset(tmp_path / "b", pre))
    assert got["prefixes"] == 2 and got["shared_texts"] == 5
    assert got["ari"] == pytest.approx(1.0) and got["mean_abs_dq"] == 0.0
    assert got["coverage"] == {"a": 1.0, "b": 1.0}


def test_other_groupings_and_labels_of_the_shared_texts_lower_ari_and_raise_dq(tmp_path):
    a = {(0, 0): [("a", 0, 0.75), ("b", 0, 0.75), ("c", 1, 0.25), ("d", 1, 0.25), ("only-a", 2, 0.1)]}
    b = {(0, 0): [("a", 0, 0.5), ("b", 1, 0.5), ("c", 0, 0.5), ("d", 1, 0.5), ("only-b", 0, 0.9), ("only-b", 0, 0.9)]}
    got = label_agreement(_dataset(tmp_path / "a", a), _dataset(tmp_path / "b", b))
    assert got["shared_texts"] == 4  # a, b, c, d
    assert got["ari"] < 0.5  # {a,b},{c,d} against {a,c},{b,d}
    assert got["mean_abs_dq"] == pytest.approx(0.25)
    assert got["coverage"]["a"] == pytest.approx(4 / 5) and got["coverage"]["b"] == pytest.approx(4 / 6)


def test_a_text_sampled_twice_counts_once_with_its_group(tmp_path):
    a = {(0, 0): [("a", 0, 0.5), ("a", 0, 0.5), ("b", 1, 0.5)]}
    b = {(0, 0): [("a", 3, 0.5), ("b", 4, 0.5)]}
    got = label_agreement(_dataset(tmp_path / "a", a), _dataset(tmp_path / "b", b))
    assert got["shared_texts"] == 2 and got["ari"] == pytest.approx(1.0)  # group ids differ, the grouping does not


def test_prefixes_with_other_text_are_not_compared(tmp_path):
    a = _dataset(tmp_path / "a", {(0, 0): [("a", 0, 0.5)]})
    b = tmp_path / "b"
    _dataset(b, {(0, 0): [("a", 0, 0.5)]})
    text = (b / "steps-00000.jsonl").read_text().replace('"P0.0"', '"another prefix"')
    (b / "steps-00000.jsonl").write_text(text)
    with pytest.raises(ValueError, match="share no prefix"):
        label_agreement(a, b)


def test_a_folder_without_a_finished_build_is_refused_by_name(tmp_path):
    a = _dataset(tmp_path / "a", {(0, 0): [("a", 0, 0.5)]})
    with pytest.raises(ValueError, match="no finished dataset"):
        label_agreement(a, tmp_path)
