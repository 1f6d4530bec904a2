"""The probe, its config, export/load round trips and fingerprint checks, and the LightningModule."""

import json
import warnings

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from probes.config import ProbeConfig
from probes.export import export_probe, load_probe, model_fingerprint
from probes.model import SemanticProbe
from probes.module import SemanticProbeModule
from tests.conftest import tiny_llama


def test_paper_architecture_and_options():
    probe = SemanticProbe(ProbeConfig(hidden_size=64))
    linears = [m for m in probe.mlp if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(64, 2048), (2048, 512), (512, 256), (256, 1)]
    assert all(m.p == 0.3 for m in probe.mlp if isinstance(m, torch.nn.Dropout))
    linear = SemanticProbe(ProbeConfig(hidden_size=64, hidden_dims=[]))
    assert [type(m) for m in linear.mlp] == [torch.nn.Linear]
    concat = SemanticProbe(ProbeConfig(hidden_size=8, layer_ids=[-1, -2, 3], hidden_dims=[4]))
    assert concat.mlp[0].in_features == 24
    mixed = SemanticProbe(ProbeConfig(hidden_size=8, layer_ids=[-1, -2], layer_combine="weighted_sum", hidden_dims=[4]))
    assert mixed.mlp[0].in_features == 8 and mixed.layer_logits.shape == (2,)
    out = mixed.eval()(torch.randn(5, 16))
    assert out.shape == (5,) and bool(((out > 0) & (out < 1)).all())
    torch.testing.assert_close(mixed(torch.randn(5, 2, 8)).shape, torch.Size([5]))


def test_width_mismatch_names_both_numbers():
    probe = SemanticProbe(ProbeConfig(hidden_size=16, hidden_dims=[4]))
    with pytest.raises(ValueError, match=r"expects 16 features.*got 12"):
        probe(torch.randn(2, 12))


@pytest.mark.parametrize(
    "kwargs, field",
    [({"pooling": "max"}, "pooling"), ({"role": "judge"}, "role"), ({"layer_ids": []}, "layer_ids"), ({"dropout": 1.5}, "dropout")],
)
def test_config_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ProbeConfig(**kwargs)


def test_config_from_dict_upgrades_and_names_unknown_keys():
    old = {"hidden_size": 8, "layer_ids": [-1]}  # a version-0 export without format_version
    assert ProbeConfig.from_dict(old).format_version == 0
    with pytest.raises(ValueError, match="hidden_szie"):
        ProbeConfig.from_dict({"hidden_szie": 8})


def _export(tmp_path, model, tok, **kw):
    cfg = ProbeConfig(hidden_size=model.config.hidden_size, hidden_dims=[16, 8], reads=model_fingerprint(model, tok), **kw)
    probe = SemanticProbe(cfg).eval()
    return probe, export_probe(probe, tmp_path / "probe")


def test_export_round_trip_strict(tmp_path, world_tokenizer):
    model = tiny_llama(len(world_tokenizer), 32)
    probe, path = _export(tmp_path, model, world_tokenizer, role="draft", test_metrics={"mse": 0.01})
    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in path.iterdir()}
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["role"] == "draft" and cfg["reads"]["hidden_size"] == 32 and cfg["reads"]["tokenizer_hash"]
    loaded = load_probe(path, model=model, tokenizer=world_tokenizer)
    x = torch.randn(4, 32)
    torch.testing.assert_close(loaded(x), probe(x))
    assert loaded.config.test_metrics == {"mse": 0.01}


def test_load_refuses_other_model_naming_fields(tmp_path, world_tokenizer):
    model = tiny_llama(len(world_tokenizer), 32, layers=2)
    _, path = _export(tmp_path, model, world_tokenizer)
    other = tiny_llama(len(world_tokenizer), 24, layers=1)
    with pytest.raises(ValueError) as err:
        load_probe(path, model=other, tokenizer=world_tokenizer)
    assert "hidden_size: probe has 32, model has 24" in str(err.value)
    assert "num_layers: probe has 2, model has 1" in str(err.value)


def test_load_refuses_other_tokenizer(tmp_path, world_tokenizer):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    model = tiny_llama(len(world_tokenizer), 32)
    _, path = _export(tmp_path, model, world_tokenizer)
    vocab = {f"w{i}": i for i in range(len(world_tokenizer))}
    other_tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="w1")))
    with pytest.raises(ValueError, match="tokenizer_hash"):
        load_probe(path, model=model, tokenizer=other_tok)


@pytest.mark.parametrize("damage, says", [
    ("config_not_json", "config.json is not valid JSON"),
    ("config_not_a_probe", "config.json is not a probe config"),
    ("weights_pickled", "model.safetensors is not a readable safetensors file"),
    ("weights_truncated", "model.safetensors is not a readable safetensors file"),
    ("weights_other_shapes", "model.safetensors does not hold the weights"),
])
def test_unreadable_export_names_the_file_and_what_to_do(tmp_path, world_tokenizer, damage, says):
    import pickle

    model = tiny_llama(len(world_tokenizer), 32)
    _, path = _export(tmp_path, model, world_tokenizer)
    weights, config = path / "model.safetensors", path / "config.json"
    if damage == "config_not_json":
        config.write_text("{\"hidden_size\": 32,")
    elif damage == "config_not_a_probe":
        config.write_text("[1, 2]")
    elif damage == "weights_pickled":
        weights.write_bytes(pickle.dumps({"mlp.0.weight": torch.zeros(16, 32)}))
    elif damage == "weights_truncated":
        weights.write_bytes(weights.read_bytes()[:20])
    else:
        cfg = json.loads(config.read_text())
        config.write_text(json.dumps({**cfg, "hidden_dims": [8]}))
    with pytest.raises(ValueError) as err:
        load_probe(path, model=model, tokenizer=world_tokenizer)
    assert f"{path}/{says}" in str(err.value) and "re-export the probe" in str(err.value)


def test_probe_without_reads_warns_naming_the_file(tmp_path, world_tokenizer):
    model = tiny_llama(len(world_tokenizer), 32)
    path = export_probe(SemanticProbe(ProbeConfig(hidden_size=32, hidden_dims=[4])).eval(), tmp_path / "old")
    with pytest.warns(UserWarning, match=rf"{path}/config.json records no `reads` fingerprint"):
        load_probe(path, model=model, tokenizer=world_tokenizer)  # old exports keep loading, loudly
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, path = _export(tmp_path / "new", model, world_tokenizer)
        load_probe(path, model=model, tokenizer=world_tokenizer)


def test_load_missing_files_named(tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_probe(tmp_path / "half")


def test_interrupted_export_keeps_old_probe(tmp_path, world_tokenizer, monkeypatch):
    model = tiny_llama(len(world_tokenizer), 32)
    old, path = _export(tmp_path, model, world_tokenizer)
    new = SemanticProbe(ProbeConfig(hidden_size=32, hidden_dims=[16, 8], reads=model_fingerprint(model, world_tokenizer)))

    def crash(self, save_directory, **kw):  # dies after writing part of the files
        (save_directory / "config.json").write_text("{")
        raise KeyboardInterrupt

    monkeypatch.setattr(SemanticProbe, "save_pretrained", crash)
    with pytest.raises(KeyboardInterrupt):
        export_probe(new, path)
    x = torch.randn(3, 32)
    torch.testing.assert_close(load_probe(path, model=model)(x), old(x))
    assert [p.name for p in tmp_path.iterdir()] == ["probe"]  # no temporary leftovers


def _batches(n, widths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        batch = {}
        for role, d in widths.items():
            x = torch.randn(64, d, generator=g)
            batch[role] = {"features": x, "label": torch.sigmoid(3 * x[:, 0])}
        out.append(batch)
    return DataLoader(out, batch_size=None)


def _spec(widths):
    return {r: {"hidden_size": d, "layer_ids": [-1], "pooling": "mean", "reads": {"hidden_size": d}} for r, d in widths.items()}


@pytest.mark.parametrize("loss", ["mse", "bce"])
def test_module_learns_both_roles(tmp_path, loss):
    widths = {"target": 16, "draft": 8}
    module = SemanticProbeModule(ProbeConfig(hidden_dims=[32]), ["target", "draft"], _spec(widths), loss=loss)
    trainer = L.Trainer(max_epochs=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    with torch.no_grad():
        val = list(_batches(4, widths, seed=1))
        before = sum(float(((module(r, b[r]["features"]) - b[r]["label"]) ** 2).mean()) for b in val for r in widths) / 8
    trainer.fit(module, _batches(30, widths), _batches(4, widths, seed=1))
    metrics = trainer.callback_metrics
    assert float(metrics["val/mse"]) < 0.6 * before
    for role in widths:
        for name in ("mse", "mae", "r2", "pearson", "auroc", "ece"):
            assert f"val/{role}/{name}" in metrics
        assert float(metrics[f"val/{role}/auroc"]) > 0.8
    assert module.probes["draft"].config.role == "draft" and module.probes["draft"].config.hidden_size == 8


def _written_batches(n, width=8, seed=0):
    """Target rows whose writer is in ``writer``; draft-written rows are rare and carry the low labels."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(64, width, generator=g)
        writer = (torch.rand(64, generator=g) < 0.2).to(torch.int8)
        label = torch.where(writer.bool(), torch.sigmoid(4 * x[:, 0]), torch.full((64,), 0.9))
        out.append({"target": {"features": x, "label": label, "writer": writer}})
    return DataLoader(out, batch_size=None)


def test_module_reports_the_rows_each_model_wrote_and_weights_the_drafts_wrong_steps(tmp_path):
    module = SemanticProbeModule(ProbeConfig(hidden_dims=[16]), ["target"], _spec({"target": 8}),
                                 draft_low_label_weight=5.0)
    trainer = L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, _written_batches(20), _written_batches(4, seed=1))
    metrics = trainer.callback_metrics
    for name in ("mse", "auroc", "ece"):
        assert f"val/target/draft_written/{name}" in metrics and f"val/target/target_written/{name}" in metrics
    # the per-writer sets split the same rows: their MSEs bracket the overall one
    parts = sorted(float(metrics[f"val/target/{w}/mse"]) for w in ("draft_written", "target_written"))
    assert parts[0] <= float(metrics["val/target/mse"]) <= parts[1]
    batch = next(iter(_written_batches(1)))["target"]
    w = module._weights("target", batch)
    low_draft = (batch["writer"] == 1) & (batch["label"] < 0.5)
    assert bool(low_draft.any()) and torch.all(w[low_draft] == 5.0) and torch.all(w[~low_draft] == 1.0)
    logits = torch.zeros(64)
    weighted = module._loss(logits, batch["label"], w)
    plain = module._loss(logits, batch["label"])
    expected = (((0.5 - batch["label"]) ** 2) * w).sum() / w.sum()
    torch.testing.assert_close(weighted, expected)
    assert not torch.isclose(weighted, plain)
    assert module._weights("draft", batch) is None
    with pytest.raises(ValueError, match="draft_low_label_weight=0"):
        SemanticProbeModule(draft_low_label_weight=0)


def test_module_rejects_bad_arguments():
    with pytest.raises(ValueError, match="roles"):
        SemanticProbeModule(roles=["judge"])
    with pytest.raises(ValueError, match="loss"):
        SemanticProbeModule(loss="hinge")
    with pytest.raises(ValueError, match=r"input_spec lacks roles \['draft'\]"):
        SemanticProbeModule(roles=["target", "draft"], input_spec=_spec({"target": 8}))


def test_module_width_mismatch_in_data(tmp_path):
    module = SemanticProbeModule(ProbeConfig(hidden_dims=[8]), ["target"], _spec({"target": 16}))
    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"expects 16 features.*got 12"):
        trainer.fit(module, _batches(2, {"target": 12}))


def test_export_takes_the_umask_modes(tmp_path):
    """An export folder and its files get what mkdir/open give (not mkdtemp's 0700 or a writer's 0600)."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        path = export_probe(SemanticProbe(ProbeConfig(hidden_size=8, hidden_dims=[4])), tmp_path / "p")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    assert {stat.S_IMODE(f.stat().st_mode) for f in path.iterdir()} == {0o644}


def test_module_refuses_data_with_other_feature_groups(tmp_path):
    """A probe built for [hidden] handed data streaming [hidden, token_stats] is refused naming both lists."""
    from tests.conftest import make_dataset
    from datamodules.datamodule import SemanticProbeDataModule

    data = SemanticProbeDataModule(str(make_dataset(tmp_path / "d")), build=None, batch_size=8, roles=["target"])
    spec = {"target": {"hidden_size": 16, "layer_ids": [-1], "reads": {"hidden_size": 16}}}  # no feature groups: [hidden]
    module = SemanticProbeModule(ProbeConfig(hidden_dims=[4]), ["target"], spec)
    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"reads feature groups \['hidden'\].*streams \['hidden', 'token_stats'\]"):
        trainer.fit(module, datamodule=data)
    ok = SemanticProbeModule(ProbeConfig(hidden_dims=[4]), ["target"], data.input_spec)
    trainer.fit(ok, datamodule=data)  # built from the datamodule's input_spec, as the CLI links it
    assert ok.probes["target"].input_std.ne(1).any()  # standardised with the training rows' moments
    # the step and sampling spec of the data travel with the probe (the decoder reads them)
    c = ok.probes["target"].config
    assert c.sampling == {"n_samples": 3, "temperature": 0.6, "top_p": 0.95}
    assert c.delimiters == ["\n\n"] and c.labels["max_step_tokens"] == 32


def test_probes_exported_before_the_sampling_spec_take_it_from_their_labels(world_tokenizer, tmp_path):
    import shutil
    from pathlib import Path

    from datamodules.arithmetic.models import load_model

    root = Path(__file__).resolve().parents[1] / "checkpoints" / "arithmetic"
    for role in ("target", "draft"):
        # a format-2 export of the shipped probe: what format 3 added (the sampling spec) taken out
        folder = shutil.copytree(root / "probes" / role, tmp_path / role)
        config = json.loads((folder / "config.json").read_text())
        config["labels"].update(config.pop("sampling"))  # format 2 kept it among the labels' provenance
        config["format_version"] = 2
        (folder / "config.json").write_text(json.dumps(config))
        probe = load_probe(folder, model=load_model(role), tokenizer=world_tokenizer)
        # format 2 kept the sampling spec among the labels' provenance; it is read from there, not made up
        assert probe.config.sampling == {k: config["labels"][k] for k in ("n_samples", "temperature", "top_p")}
        assert probe.config.labels["max_step_tokens"] == 32
    v1 = {k: v for k, v in config.items() if k not in ("labels",)} | {"format_version": 1}
    assert ProbeConfig.from_dict(v1).sampling == {}  # nothing recorded: nothing to enforce
