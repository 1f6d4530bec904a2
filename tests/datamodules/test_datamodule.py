"""`SemanticProbeDataModule` on synthetic shards: batches, splits, shuffling, workers, ranks, faults."""

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from datamodules.labels import shards as S
from generation.fingerprints import sha256_file
from datamodules.datamodule import SemanticProbeDataModule
from generation.specs import SamplingSpec, StepSpec
from datamodules.stream import SPLITS, ShardStream, split_of
from tests.conftest import STATS, TOPK, WIDTH, make_dataset

N_STATS = len(STATS)


def _rows(loader, extra=N_STATS):
    seen = {r: [] for r in WIDTH}
    for batch in loader:
        for r, t in batch.items():
            assert t["features"].dtype == torch.float32 and t["label"].dtype == torch.float32
            assert t["features"].shape == (len(t["label"]), WIDTH[r] + extra) and len(t["label"]) > 0
            assert t["writer"].shape == t["label"].shape
            seen[r] += t["features"][:, 0].long().tolist()
    return seen


@pytest.fixture()
def data(tmp_path):
    return make_dataset(tmp_path / "d")


def _dm(d, **kw):
    # 0.25 each: the default 0.1 leaves the tiny data's val or test split empty, which the datamodule warns about
    kw = {"batch_size": 10, "shuffle_buffer": 20, "val_fraction": 0.25, "test_fraction": 0.25, **kw}
    dm = SemanticProbeDataModule(str(d), build=None, **kw)
    dm.setup()
    return dm


def test_input_spec_and_batches(data):
    dm = _dm(data)
    assert dm.input_spec["target"]["hidden_size"] == 16 and dm.input_spec["draft"]["features"].layer_ids == (-1,)
    assert set(dm.input_spec["target"]) == {"hidden_size", "features", "reads", "step", "sampling", "labels"}
    # a build before the topk_stats group (format 2): none streamed, read in-process
    features = dm.input_spec["target"]["features"]
    assert (features.topk_stats, features.source, features.pooling) == ((), "transformers", "mean")
    assert dm.input_spec["draft"]["sampling"] == SamplingSpec(0.6, 0.95)
    assert dm.input_spec["draft"]["step"] == StepSpec(("\n\n",), 32)
    assert dm.input_spec["draft"]["labels"] == {"n_samples": 3}  # the step cap has one home: the step spec
    assert features.groups == ("hidden", "token_stats") and list(features.token_stats) == STATS
    batches = list(dm.train_dataloader())
    assert all(sum(len(t["label"]) for t in b.values()) == 10 for b in batches[:-1])
    assert any(len(b) == 2 for b in batches)  # mixed batches hold both roles


def test_splits_by_problem_cover_every_row_once(data):
    dm = _dm(data, val_fraction=0.25, test_fraction=0.25)
    per_split = {s: _rows(getattr(dm, f"{s}_dataloader")()) for s in SPLITS}
    for r in WIDTH:
        ids = [i for s in SPLITS for i in per_split[s][r]]
        assert len(ids) == len(set(ids)) == sum(e["count"][r] for e in S.read_manifest(data)["shards"])
    problems = {s: {i // 6 // 2 for r in WIDTH for i in per_split[s][r]} for s in SPLITS}  # sample -> prefix -> problem
    assert all(problems[a].isdisjoint(problems[b]) for a in SPLITS for b in SPLITS if a < b)
    assert all(problems[s] for s in SPLITS)
    # the split is a pure function of (seed, problem id)
    pids = torch.tensor([3, 1, 3, 2])
    assert torch.equal(split_of(pids, 0, 0.3, 0.3), split_of(pids, 0, 0.3, 0.3))
    assert split_of(pids, 0, 0.3, 0.3)[0] == split_of(pids, 0, 0.3, 0.3)[2]


def test_shuffling_is_seeded_and_changes_per_epoch(data):
    dm = _dm(data)
    loader = dm.train_dataloader()
    first, second = _rows(loader), _rows(loader)
    assert sorted(first["target"]) == sorted(second["target"]) and first["target"] != second["target"]
    again = _rows(_dm(data).train_dataloader())
    assert again == first
    in_order = _rows(dm.val_dataloader())
    assert in_order == _rows(dm.val_dataloader())
    resumed = _dm(data)  # a run resumed at epoch 1 reads epoch 1 as the uninterrupted run did, not epoch 0
    resumed.trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_progress=SimpleNamespace(
        current=SimpleNamespace(processed=1))))
    assert _rows(resumed.train_dataloader()) == second


def test_workers_and_ranks_split_the_stream(data):
    dm = _dm(data, num_workers=2)
    with_workers = _rows(dm.train_dataloader())
    alone = _rows(_dm(data).train_dataloader())
    assert sorted(with_workers["target"]) == sorted(alone["target"])
    parts = []
    for rank in range(3):
        stream = ShardStream(dm.shards, ["target", "draft"], "train", 7, True, 30, 0, (0.1, 0.1),
                             groups=("hidden", "token_stats"))
        stream.rank, stream.world, stream.epoch = rank, 3, 0
        parts.append(_rows(stream))
    sizes = [len(p["target"]) + len(p["draft"]) for p in parts]
    assert len(set(sizes)) == 1  # every rank the same number of rows: no DDP hang
    union = [(r, i) for p in parts for r in WIDTH for i in p[r]]
    assert len(union) == len(set(union)) and len(alone["target"]) + len(alone["draft"]) - len(union) < 3


@pytest.mark.slow  # worker processes per rank: 4.6 s
def test_ranks_with_several_workers_each_yield_the_same_number_of_batches(tmp_path):
    """Each worker ends with a short batch of its own shards, and a rank's rows of a worker's shards can differ from
    another rank's by one: their batch counts differed (for batch sizes such as 5, 6, 9), and DDP's collectives then
    waited or failed (here 20 and 21 batches at batch size 2 in epoch 1). Every worker now yields, on every rank,
    the fewest batches any rank's share makes."""
    from datamodules.stream import EpochLoader

    dm = _dm(make_dataset(tmp_path / "d", n_shards=5, prefixes_per_shard=3, n=3))
    for batch_size in range(2, 9):
        for epoch in range(3):
            counts = []
            for rank in (0, 1):
                stream = ShardStream(dm.shards, ["target", "draft"], "train", batch_size, True, 30, 0, (0.25, 0.25),
                                     groups=("hidden", "token_stats"), num_workers=2)
                stream.rank, stream.world = rank, 2
                loader = EpochLoader(stream, batch_size=None, num_workers=2, epoch_of=lambda e=epoch: e)
                counts.append(sum(1 for _ in loader))
            assert counts[0] == counts[1], (batch_size, epoch, counts)


def test_with_workers_the_loaders_length_is_unknown_and_every_epoch_validates(data):
    """Each worker ends with a short batch of its own shards, so the count depends on the epoch's deal: the loader
    has no length, and Lightning validates when it ends. An upper bound made Lightning wait for a last batch that
    never came: no validation ran, and EarlyStopping on a val metric failed."""
    import lightning as L

    from probes.config import ProbeConfig
    from probes.module import SemanticProbeModule

    with pytest.raises(TypeError, match="num_workers=2"):
        len(_dm(data, num_workers=2).train_dataloader())
    assert len(_dm(data).train_dataloader()) == sum(1 for _ in _dm(data).train_dataloader())  # exact alone
    dm = SemanticProbeDataModule(str(data), build=None, batch_size=10, shuffle_buffer=20, val_fraction=0.25,
                                 test_fraction=0.25, num_workers=2)
    module = SemanticProbeModule(ProbeConfig(hidden_dims=[4]), ["target", "draft"], dm.input_spec)
    trainer = L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, datamodule=dm)
    assert trainer.fit_loop.epoch_loop.val_loop.batch_progress.total.completed > 0
    assert any(k.startswith("val/") for k in trainer.callback_metrics)


def test_a_role_absent_from_a_batch_is_absent_from_its_dict(tmp_path):
    d = make_dataset(tmp_path / "d", n_shards=1, drop_draft_in=0)
    dm = _dm(d, val_fraction=0.0, test_fraction=0.0)  # one shard's problems: a held-out split would be empty
    assert all(set(b) == {"target"} for b in dm.train_dataloader())
    dm = _dm(d, roles=["draft"], val_fraction=0.0, test_fraction=0.0)
    assert list(dm.train_dataloader()) == []


@pytest.mark.parametrize("damage", ["truncate", "alter"])
def test_corrupt_shard_is_named_with_checksums_or_skipped(data, damage):
    path = data / "shard-00002.safetensors"
    raw = bytearray(path.read_bytes())
    raw = raw[:-50] if damage == "truncate" else raw[:-1] + bytes([raw[-1] ^ 1])
    path.write_bytes(bytes(raw))
    expected = S.read_manifest(data)["shards"][2]["sha256"]
    with pytest.raises(S.CorruptShardError) as err:
        _dm(data)
    assert str(path) in str(err.value) and expected in str(err.value) and sha256_file(path) in str(err.value)
    assert "--data.skip_corrupt true" in str(err.value)
    with pytest.warns(UserWarning, match="skipping corrupt shard") as said:
        dm = _dm(data, skip_corrupt=True)
    assert dm.skipped_shards == [str(path)] and len(dm.shards) == 3
    assert "skip_corrupt" not in str(said[0].message)  # it advised the option that was skipping the shard


def test_nonfinite_features_error_or_drop(tmp_path):
    d = make_dataset(tmp_path / "d", nan_rows=5)
    with pytest.raises(ValueError, match="shard-00000.safetensors has 5 target rows with NaN/inf"):
        _dm(d)
    dm = _dm(d, nonfinite="drop", val_fraction=0.0, test_fraction=0.0)
    assert dm.dropped_rows == 5
    rows = _rows(dm.train_dataloader())
    total = sum(e["count"]["target"] for e in S.read_manifest(d)["shards"])
    assert len(rows["target"]) == total - 5


def test_width_mismatch_names_both_numbers(data):
    m = S.read_manifest(data)
    m["build"]["reads"]["target"]["hidden_size"] = 20
    S.atomic_write_json(data / S.MANIFEST, m)
    with pytest.raises(ValueError, match="target.features are 16 wide, expected 20"):
        _dm(data)


def test_missing_or_empty_data_dir_without_build(tmp_path):
    for d in (tmp_path / "nowhere", tmp_path):
        dm = SemanticProbeDataModule(str(d), build=None)
        with pytest.raises(FileNotFoundError, match=str(d)):
            dm.prepare_data()
        with pytest.raises(FileNotFoundError, match=str(d)):
            dm.setup()
        with pytest.raises(FileNotFoundError, match=str(d)):
            _ = dm.input_spec


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="roles=\\['verifier'\\]"):
        SemanticProbeDataModule(build=None, roles=["verifier"])
    with pytest.raises(ValueError, match="nonfinite='skip'"):
        SemanticProbeDataModule(build=None, nonfinite="skip")
    with pytest.raises(ValueError) as err:
        SemanticProbeDataModule(build=None, batch_size=0)
    assert "batch_size=0: expected an integer >= 1" in str(err.value)
    assert "num_workers" not in str(err.value) and "shuffle_buffer" not in str(err.value)  # only what is wrong
    # each below was accepted and failed at the first batch (or, skip_corrupt="no", skipped corrupt shards)
    for kwargs, says in [({"seed": None}, r"seed=None: expected an integer in \[0, 2\*\*32\)"),
                         ({"seed": 2**70}, r"seed=\d+: expected an integer"),
                         ({"skip_corrupt": "no"}, r"skip_corrupt='no': expected true or false"),
                         ({"val_fraction": "0.1"}, r"val_fraction='0.1', test_fraction=0.1: need numbers"),
                         ({"build": {"n_problems": 3}}, r"build=\{'n_problems': 3\}: expected a BuildConfig"),
                         ({"data_dir": None}, r"data_dir=None: expected a folder path")]:
        with pytest.raises(ValueError, match=says):
            SemanticProbeDataModule(**{"build": None, **kwargs})


def test_len_bounds_the_batches(data):
    dm = _dm(data)
    loader = dm.train_dataloader()
    n = len(list(loader))
    assert n <= len(loader) and len(loader) == math.ceil(sum(s["rows"]["train"] for s in dm.shards) / 10)


@pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__`")  # as probes.fit does: the length holds
def test_feeds_a_lightning_trainer(data, tmp_path):
    import lightning.pytorch as pl

    class Probe(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.heads = torch.nn.ModuleDict({r: torch.nn.Linear(w + len(STATS), 1) for r, w in WIDTH.items()})
            self.seen = 0

        def training_step(self, batch, _):
            self.seen += sum(len(t["label"]) for t in batch.values())
            return sum(((self.heads[r](t["features"]).squeeze(1) - t["label"]) ** 2).mean() for r, t in batch.items())

        def validation_step(self, batch, _):
            self.log("val", sum(t["label"].mean() for t in batch.values()), batch_size=1)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), 0.01)

    dm = SemanticProbeDataModule(str(data), build=None, batch_size=16, val_fraction=0.25, test_fraction=0.0)
    probe = Probe()
    trainer = pl.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, accelerator="cpu")
    trainer.fit(probe, datamodule=dm)
    assert probe.seen == 2 * sum(s["rows"]["train"] for s in dm.shards)


@pytest.mark.parametrize("groups, width", [(["hidden"], WIDTH["target"]), (["token_stats"], 2),
                                           (["hidden", "token_stats"], WIDTH["target"] + 2)])
def test_feature_groups_are_chosen_and_concatenated_in_order(data, groups, width):
    dm = _dm(data, feature_groups=groups, roles=["target"], val_fraction=0.0, test_fraction=0.0)
    assert list(dm.input_spec["target"]["features"].groups) == groups
    batch = next(iter(dm.train_dataloader()))["target"]
    assert batch["features"].shape[1] == width
    if "token_stats" in groups:  # the stats' column 1 is the writer code: the last column here
        torch.testing.assert_close(batch["features"][:, -1], batch["writer"].float())
    if groups[0] == "hidden":  # feature 0 holds the sample id
        assert torch.equal(batch["features"][:, 0].long() % 6 >= 3, batch["writer"].bool())


@pytest.mark.parametrize("groups, width", [(["topk_stats"], 3), (["token_stats", "topk_stats"], 5),
                                           (["hidden", "topk_stats"], WIDTH["target"] + 3)])
def test_the_topk_stats_group_is_streamed_last_with_its_spec(tmp_path, groups, width):
    d = make_dataset(tmp_path / "d", topk=True)
    dm = _dm(d, feature_groups=groups, roles=["target"], val_fraction=0.0, test_fraction=0.0)
    spec = dm.input_spec["target"]["features"]
    assert (list(spec.topk_stats), spec.top_k, spec.hidden_norm) == (TOPK, 20, "final_norm")
    batch = next(iter(dm.train_dataloader()))["target"]
    assert batch["features"].shape[1] == width and batch["features"].dtype == torch.float32
    torch.testing.assert_close(batch["features"][:, -3], batch["writer"].float())  # topk column 0: the writer
    with pytest.raises(ValueError, match=r"reads feature groups \['topk_stats'\].*missing \['topk_stats'\]"):
        _dm(make_dataset(tmp_path / "old"), feature_groups=["topk_stats"])


def test_groups_the_data_lacks_are_refused_naming_both_lists(tmp_path):
    d = make_dataset(tmp_path / "d", stats=False)  # a format-1 build: pooled states only
    dm = _dm(d)  # None = what the data holds
    assert dm.input_spec["target"]["features"].groups == ("hidden",)
    with pytest.raises(ValueError, match=r"reads feature groups \['hidden', 'token_stats'\].*provides \['hidden'\]"):
        _dm(d, feature_groups=["hidden", "token_stats"])
    with pytest.raises(ValueError, match="feature groups.*expected a non-empty subset"):
        SemanticProbeDataModule(str(d), build=None, feature_groups=["pixels"])


def test_nonfinite_token_stats_error_or_drop(tmp_path):
    d = make_dataset(tmp_path / "d", nan_stats=4)
    with pytest.raises(ValueError, match="shard-00000.safetensors has 4 target rows with NaN/inf"):
        _dm(d)
    _dm(d, feature_groups=["hidden"])  # the pooled states alone are finite
    dm = _dm(d, nonfinite="drop", val_fraction=0.0, test_fraction=0.0)
    assert dm.dropped_rows == 4


def test_feature_moments_are_the_training_rows_mean_and_std(data):
    dm = _dm(data, val_fraction=0.3, test_fraction=0.2)
    mean, std = dm.feature_moments("target")
    rows = []
    for shard in dm.shards:
        t = S.read_shard(shard["path"])
        train = split_of(t["target.problem_id"], dm.seed, 0.3, 0.2) == 0
        rows.append(torch.cat([t["target.features"].float(), t["target.token_stats"]], 1)[train])
    x = torch.cat(rows).double()
    torch.testing.assert_close(mean, x.mean(0).float(), atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(std, x.std(0, unbiased=False).float(), atol=1e-3, rtol=1e-4)
    # moments of data that has changed since (a shard skipped as corrupt, then rebuilt) were kept across setup()
    dm._moments["target"] = (mean + 1, std)
    dm.setup()
    torch.testing.assert_close(dm.feature_moments("target")[0], mean)


def test_an_empty_validation_split_is_named(tmp_path):
    from datamodules.datamodule import SemanticProbeDataModule

    data = make_dataset(tmp_path / "d")  # 12 problems: a 0.1 share hashes none of them into val
    with pytest.warns(UserWarning, match=r"data.val_fraction=0.1 put none of the problems .* into the val split"):
        SemanticProbeDataModule(str(data), build=None, val_fraction=0.1, test_fraction=0.0).setup()
    SemanticProbeDataModule(str(data), build=None, val_fraction=0.4, test_fraction=0.0).setup()  # some: no warning


@pytest.mark.parametrize("entry", ["../../elsewhere", "/etc/passwd", "sub/shard.safetensors"])
def test_manifest_paths_stay_inside_data_dir(tmp_path, entry):
    import json

    d = make_dataset(tmp_path / "d", n_shards=2)
    manifest = json.loads((d / S.MANIFEST).read_text())
    manifest["shards"][1]["file"] = entry
    (d / S.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=rf"shards\[1\].file='{entry}' is not a file name inside {d}"):
        SemanticProbeDataModule(str(d), build=None).setup()


@pytest.mark.parametrize("edit, says", [
    # a newer format was read as this one; the others ended in AttributeError and KeyError
    (lambda m: {**m, "format_version": 99}, "has format_version 99; this semanticspec-probes reads up to"),
    (lambda m: [m], "is not a label build's manifest"),
    (lambda m: {k: v for k, v in m.items() if k != "shards"}, "records a finished build but no shards"),
])
def test_a_manifest_of_a_newer_format_or_another_shape_is_refused_naming_it(tmp_path, edit, says):
    import json

    d = make_dataset(tmp_path / "d")
    (d / S.MANIFEST).write_text(json.dumps(edit(json.loads((d / S.MANIFEST).read_text()))))
    with pytest.raises(ValueError, match=rf"{d / S.MANIFEST} .*{re.escape(says)}"):
        SemanticProbeDataModule(str(d), build=None).setup()


def test_setup_before_prepare_data_says_so_and_misread_arguments_are_named(data, tmp_path):
    from datamodules.labels.config import BuildConfig

    with pytest.raises(FileNotFoundError, match="holds no finished build yet: call prepare_data\\(\\) first"):
        SemanticProbeDataModule(str(tmp_path / "new"), build=BuildConfig()).setup()  # it said "build=None"
    with pytest.raises(ValueError, match=r"feature groups 'hidden': expected a list of group names, e.g. \['hidden'\]"):
        SemanticProbeDataModule(str(data), build=None, feature_groups="hidden")  # listed its letters
    with pytest.raises(ValueError, match=r"feature_moments\('verifier'\): expected one of .*\['target', 'draft'\]"):
        _dm(data).feature_moments("verifier")  # a bare KeyError


def test_reusing_is_said_once_per_datamodule(data, capsys):
    dm = SemanticProbeDataModule(str(data), build=None)
    dm.prepare_data()  # Lightning prepares the data for fit, then again for test
    dm.prepare_data()
    assert capsys.readouterr().out.count("reusing 4 shards") == 1


def test_sigterm_while_the_data_builds_stops_it_as_ctrl_c_does(tmp_path, monkeypatch):
    # the fit's label build runs before Lightning puts its SIGTERM handler in: a scheduler's stop ended it at once,
    # without a word; as a KeyboardInterrupt, Lightning shuts down and the fit prints how to resume
    import os
    import signal

    from datamodules import datamodule as D
    from datamodules.labels.config import BuildConfig

    monkeypatch.setattr(D, "build", lambda *a, **k: os.kill(os.getpid(), signal.SIGTERM))

    def found(*_):
        raise AssertionError("the build left SIGTERM to the handler it found")

    before = signal.signal(signal.SIGTERM, found)
    try:
        with pytest.raises(KeyboardInterrupt):
            SemanticProbeDataModule(str(tmp_path / "d"), build=BuildConfig()).prepare_data()
        assert signal.getsignal(signal.SIGTERM) is found  # Lightning finds it, as before the build
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__`")
def test_load_from_checkpoint_rebuilds_the_data_with_its_own_arguments(data, tmp_path):
    """``SemanticProbeDataModule.load_from_checkpoint`` gave a datamodule of the defaults (``data/arithmetic``, batch
    128): its arguments were not kept. A ``BuildConfig`` built in Python loads with torch's weights_only unpickler."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from datamodules.labels.config import BuildConfig, JudgeConfig
    from probes.config import ProbeConfig
    from probes.module import SemanticProbeModule

    dm = SemanticProbeDataModule(str(data), build=None, batch_size=10, val_fraction=0.25, test_fraction=0.25, seed=3)
    module = SemanticProbeModule(ProbeConfig(hidden_dims=[4]), ["target", "draft"], dm.input_spec)
    trainer = pl.Trainer(max_epochs=1, default_root_dir=tmp_path, enable_progress_bar=False, log_every_n_steps=1,
                         enable_model_summary=False, accelerator="cpu", logger=CSVLogger(tmp_path))  # hparams logged
    trainer.fit(module, datamodule=dm)
    path = trainer.checkpoint_callback.best_model_path
    again = SemanticProbeDataModule.load_from_checkpoint(path)
    assert (again.data_dir, again.build, again.batch_size, again.seed, again.val_fraction) == (data, None, 10, 3, 0.25)
    # the module's hparams.yaml is plain YAML: it held !!python/object specs, which Lightning's own loader refused
    hparams = Path(trainer.logger.log_dir) / "hparams.yaml"
    assert "!!" not in hparams.read_text()
    from lightning.pytorch.core.saving import load_hparams_from_yaml

    reloaded = SemanticProbeModule.load_from_checkpoint(path, hparams_file=str(hparams))
    assert reloaded.probe_configs == module.probe_configs and load_hparams_from_yaml(hparams)["roles"] == module.roles
    build = BuildConfig(n_problems=7, judge=JudgeConfig(threshold=0.6))
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["datamodule_hyper_parameters"] = dict(SemanticProbeDataModule(str(data), build=build).hparams)
    torch.save(checkpoint, tmp_path / "built.ckpt")
    assert SemanticProbeDataModule.load_from_checkpoint(tmp_path / "built.ckpt").build == build
