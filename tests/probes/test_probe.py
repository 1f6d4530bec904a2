"""The probe, its config, export/load round trips and fingerprint checks, and the LightningModule."""

import dataclasses
import json
import math
from pathlib import Path
import warnings

import lightning as L
import pytest
import torch
from huggingface_hub import ModelCard
from torch import nn

from generation.specs import FeatureSpec, SamplingSpec, StepSpec
from torch.utils.data import DataLoader

from probes.config import FORMAT_VERSION, ProbeConfig
from probes.model import SemanticProbe, export_probe, load_probe, load_probes, run_probe
from generation.fingerprints import model_fingerprint
from probes.module import SemanticProbeModule
from tests.conftest import tiny_llama


def test_paper_architecture_and_options():
    probe = SemanticProbe(ProbeConfig(hidden_size=64))
    linears = [m for m in probe.mlp if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(64, 2048), (2048, 512), (512, 256), (256, 1)]
    assert all(m.p == 0.3 for m in probe.mlp if isinstance(m, torch.nn.Dropout))
    linear = SemanticProbe(ProbeConfig(hidden_size=64, hidden_dims=[]))
    assert [type(m) for m in linear.mlp] == [torch.nn.Linear]
    concat = SemanticProbe(ProbeConfig(hidden_size=8, features=FeatureSpec(layer_ids=[-1, -2, 3]), hidden_dims=[4]))
    assert concat.mlp[0].in_features == 24
    mixed = SemanticProbe(ProbeConfig(hidden_size=8, features=FeatureSpec(layer_ids=[-1, -2]),
                                      layer_combine="weighted_sum", hidden_dims=[4]))
    assert mixed.mlp[0].in_features == 8 and mixed.layer_logits.shape == (2,)
    out = mixed.eval()(torch.randn(5, 16))
    assert out.shape == (5,) and bool(((out > 0) & (out < 1)).all())
    torch.testing.assert_close(mixed(torch.randn(5, 2, 8)).shape, torch.Size([5]))


def test_a_nan_score_is_warned_about_once_naming_the_probe():
    # a NaN input (a float16 overflow upstream) made every step's q NaN, and every step was refused without a word
    probe = SemanticProbe(ProbeConfig(hidden_size=4, role="target", features=FeatureSpec(["hidden"], [-1]))).eval()
    x = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_probe(probe, x)  # finite inputs: no warning
    x[1, 2] = float("nan")
    with pytest.warns(RuntimeWarning, match="the target probe scored NaN: its input held NaN or inf"):
        scores = run_probe(probe, x)
    assert scores[1] != scores[1] and scores[0] == scores[0]


@pytest.mark.parametrize("combine, dims", [("concat", [32, 16]), ("concat", []), ("weighted_sum", [8])])
def test_predict_equals_forward_in_eval_and_follows_weight_updates(combine, dims):

    probe = SemanticProbe(ProbeConfig(hidden_size=8, layer_combine=combine, hidden_dims=dims,
                                      features=FeatureSpec(["hidden", "token_stats"], [-1, -2],
                                                           token_stats=["min_logprob"])))
    x = torch.randn(6, 17) * 5 + 2
    probe.set_standardization(x.mean(0), x.std(0))
    probe.eval()
    torch.testing.assert_close(probe.predict(x), probe(x), atol=1e-6, rtol=0)
    assert run_probe(probe, x) == probe(x).tolist()
    with torch.no_grad():  # an optimiser step in place: predict reads the new weights
        probe.mlp[0].weight.mul_(-2.0)
    torch.testing.assert_close(probe.predict(x), probe(x), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"expects 17 features.*got 12"):
        probe.predict(torch.randn(2, 12))
    probe.train()  # dropout on: predict is forward (random), still a probability per row
    assert probe.predict(x).shape == (6,)


def test_predict_is_bitwise_forward_and_falls_back_for_an_edited_mlp():
    """predict runs the Linear layers it found once; replacing a module is noticed (another layout runs forward)."""
    probe = SemanticProbe(ProbeConfig(hidden_size=8, hidden_dims=[16, 8])).eval()
    x = torch.randn(4, 8)
    assert torch.equal(probe.predict(x), probe(x))
    probe.mlp[0] = nn.Linear(8, 16)  # same layout, new weights: found again
    assert torch.equal(probe.predict(x), probe(x))
    probe.mlp[1] = nn.GELU()  # another layout: predict is forward, not Linear/ReLU
    assert torch.equal(probe.predict(x), probe(x))
    probe.mlp[1] = nn.ReLU()
    probe.mlp.half()  # the dtype follows the weights
    assert torch.equal(probe.predict(x), probe(x)) and probe.predict(x).dtype == torch.float32


def test_a_half_precision_mlp_predicts_close_to_float32_and_returns_float32():
    """``probe.mlp.half()`` runs the MLP in float16 (standardization stays float32): the decoder's cheaper call
    (``benchmarks/probe_cost.py`` measures its time and decisions)."""
    probe = SemanticProbe(ProbeConfig(hidden_size=8, hidden_dims=[64, 16],
                                      features=FeatureSpec(["hidden", "token_stats"], token_stats=["min_logprob"])))
    x = torch.randn(32, 9) * 40 + 100  # raw features far from 0: standardizing in float16 would lose them
    probe.set_standardization(x.mean(0), x.std(0))
    probe.eval()
    full = probe.predict(x)
    probe.mlp.half()
    assert probe.mlp_dtype == torch.float16 and probe.input_mean.dtype == torch.float32
    half = probe.predict(x)
    assert half.dtype == torch.float32 and probe(x).dtype == torch.float32
    torch.testing.assert_close(half, full, atol=5e-3, rtol=0)
    torch.testing.assert_close(probe(x), half, atol=1e-3, rtol=0)
    assert not torch.equal(half, full)  # it did run in float16


def test_width_mismatch_names_both_numbers():
    probe = SemanticProbe(ProbeConfig(hidden_size=16, hidden_dims=[4]))
    with pytest.raises(ValueError, match=r"expects 16 features.*got 12"):
        probe(torch.randn(2, 12))
    two = SemanticProbe(ProbeConfig(hidden_size=8, hidden_dims=[4], features={"layer_ids": [-1, -2]}))
    assert two(torch.randn(3, 2, 8)).shape == (3,)  # (batch, layers, hidden) is flattened
    with pytest.raises(ValueError, match=r"expects 16 features.*got shape \(3, 4, 4\)"):
        two(torch.randn(3, 4, 4))  # 4 x 4 = 16 columns, but not 2 layers of 8: it was read as if it were
    with pytest.raises(TypeError, match=r"probe features must be a torch.Tensor, got list"):
        probe([[0.0] * 16])


@pytest.mark.parametrize(
    "kwargs, field",
    [({"features": {"pooling": "max"}}, "features.pooling"), ({"role": "judge"}, "role"),
     ({"features": {"layer_ids": []}}, "features.layer_ids"),
     ({"dropout": 1.5}, "dropout"),
     # each below was accepted, or failed with a TypeError naming no field
     ({"features": {"layer_ids": ["a"]}}, r"features.layer_ids=\['a'\]: expected integers"),
     ({"features": {"layer_ids": None}}, r"features.layer_ids=None: expected a list"),
     ({"features": {"groups": ["hidden", "token_stats"], "token_stats": ["mean_logprob", "mean_logprob"]}},
      r"\['mean_logprob'\] named twice"),
     ({"format_version": 99}, r"format_version=99: a ProbeConfig holds today's layout"),  # written, then unloadable
     ({"reads": {"num_layers": "2"}}, r"reads.num_layers='2': expected an integer >= 1")],
)
def test_config_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ProbeConfig(**kwargs)


def test_config_from_dict_upgrades_and_names_unknown_keys():
    old = {"hidden_size": 8, "layer_ids": [-1]}  # a version-0 export without format_version
    assert ProbeConfig.from_dict(old).format_version == FORMAT_VERSION  # upgraded: a re-export writes today's layout
    with pytest.raises(ValueError, match="hidden_szie"):
        ProbeConfig.from_dict({"hidden_szie": 8})


@pytest.mark.parametrize("version", [0, 1, 2, 3, 4])
def test_configs_before_format_5_load_as_in_process_probes_without_topk_stats(version):
    old = {"hidden_size": 8, "layer_ids": [-1], "format_version": version}
    f = ProbeConfig.from_dict(old).features
    assert (f.source, f.hidden_norm, f.top_k, f.topk_stats) == ("transformers", "final_norm", 20, ())
    assert not f.needs_topk


def test_a_shipped_format_3_probe_re_exported_loads_back_and_scores_the_same(tmp_path):
    """Loading upgrades an old layout; the re-export writes today's (it wrote the new layout as format 3, which the
    next load read as an old one and dropped the token statistics)."""
    root = Path(__file__).resolve().parents[2] / "checkpoints" / "arithmetic" / "probes" / "target"
    assert json.loads((root / "config.json").read_text())["format_version"] == 3
    probe = load_probe(root)
    again = load_probe(export_probe(probe, tmp_path / "target"))
    assert json.loads((tmp_path / "target" / "config.json").read_text())["format_version"] == FORMAT_VERSION
    assert again.config == probe.config
    x = torch.randn(4, probe.config.input_size)
    assert torch.equal(probe(x), again(x))


def test_a_format_5_config_nests_its_flat_feature_keys():
    """Formats 0-5 kept what a probe reads as flat keys; they load into the one ``features`` spec."""
    flat = {"hidden_size": 8, "layer_ids": [-1, 2], "pooling": "last", "feature_groups": ["hidden", "topk_stats"],
            "token_stats": ["mean_logprob"], "top_k": 10, "topk_stats": ["min_logprob"], "source": "llama.cpp",
            "hidden_norm": "pre_norm", "format_version": 5}
    c = ProbeConfig.from_dict(flat)
    assert c.features == FeatureSpec(("hidden", "topk_stats"), (-1, 2), "last", (), 10, ("min_logprob",), "llama.cpp",
                                     "pre_norm")
    assert c.input_size == 2 * 8 + 1 and dataclasses.asdict(c)["features"]["layer_ids"] == (-1, 2)


def test_a_topk_probe_config_counts_its_statistics_and_carries_its_source():
    c = ProbeConfig(hidden_size=8, features=FeatureSpec(["hidden", "topk_stats"], top_k=10,
                                                        topk_stats=["min_logprob", "not_topk_share"],
                                                        source="llama.cpp", hidden_norm="pre_norm"))
    assert c.input_size == 8 + 2 and c.format_version == FORMAT_VERSION
    spec = c.features
    assert (spec.top_k, spec.topk_stats, spec.source, spec.hidden_norm) == (10, ("min_logprob", "not_topk_share"),
                                                                            "llama.cpp", "pre_norm")
    assert ProbeConfig.from_dict(dataclasses.asdict(c)) == c
    with pytest.raises(ValueError, match=r"expects 10 features.*2 top-k statistics"):
        SemanticProbe(c)(torch.randn(1, 8))


@pytest.mark.parametrize("kwargs, says", [
    ({"top_k": 3}, "top_k=3: expected an integer >= 5"),
    ({"source": "ollama"}, "source='ollama': expected one of"),
    ({"hidden_norm": "rms"}, "hidden_norm='rms': expected one of"),
    ({"groups": ["topk_stats"], "topk_stats": []}, r"topk_stats \[\]: expected a non-empty subset"),
])
def test_config_names_a_bad_topk_or_source_field(kwargs, says):
    with pytest.raises(ValueError, match=f"features.{says}"):
        ProbeConfig(features=kwargs)


def _export(tmp_path, model, tok, **kw):
    cfg = ProbeConfig(hidden_size=model.config.hidden_size, hidden_dims=[16, 8], reads=model_fingerprint(model, tok),
                      **kw)
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


def test_a_pair_loads_with_what_its_labels_were_made_with_and_two_that_disagree_are_refused(world_tokenizer):
    """``load_probes``: each probe checked in its role, the step and sampling their labels were made with recorded
    with whose they are, a bad dtype refused without a probe too, and two probes trained on other steps refused."""
    step, sampling = StepSpec((".\n\n",), 7), SamplingSpec(0.6, 0.9)
    target = SemanticProbe(ProbeConfig(hidden_size=32, hidden_dims=[8], step=step, sampling=sampling))
    draft = SemanticProbe(ProbeConfig(hidden_size=24, hidden_dims=[8], role="draft", step=step))
    pair = load_probes((target, draft), (None, None), (None, None), "float32")
    assert pair.target.config.role == "target" and pair.draft.config.role == "draft"
    assert pair.labelled_with == {"step": (step, "target probe"), "temperature": (0.6, "target probe"),
                                  "top_p": (0.9, "target probe")}
    assert load_probes((None, None), (None, None), (None, None)).labelled_with == {}
    with pytest.raises(ValueError, match="probe_dtype='half'"):
        load_probes((None, None), (None, None), (None, None), "half")
    with pytest.raises(ValueError, match="role 'target'"):
        load_probes((None, target), (None, None), (None, None))
    draft.config.step = StepSpec((".\n\n",), 9)
    with pytest.raises(ValueError, match=r"the target probe has step=.*=7\), the draft probe .*=9\)"):
        load_probes((target, draft), (None, None), (None, None))


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
    # without the model (a served one) the tokenizer is still checked, as the docstring says, from a folder or memory
    for probe in (path, load_probe(path)):
        with pytest.raises(ValueError, match="exported for another model.*tokenizer_hash: probe has"):
            load_probe(probe, tokenizer=other_tok)
        assert load_probe(probe, tokenizer=world_tokenizer).config.reads["tokenizer_hash"]


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


def test_load_given_a_file_of_the_probe_says_to_pass_the_folder(tmp_path):
    path = export_probe(SemanticProbe(ProbeConfig(hidden_size=32, hidden_dims=[4])).eval(), tmp_path / "target")
    for name in ("config.json", "model.safetensors"):
        with pytest.raises(FileNotFoundError, match=rf"{path / name} is a file; pass the folder .* e\.g\. {path}$"):
            load_probe(path / name)  # it said the folder misses config.json


def test_an_export_over_a_folder_replaces_the_probe_and_keeps_the_users_files(tmp_path, world_tokenizer):
    """A second export into a folder replaces the probe's files whole (atomically) and carries over what the user
    put there, as ``save_pretrained`` does; it deleted them without a word."""
    model = tiny_llama(len(world_tokenizer), 32)
    _, path = _export(tmp_path, model, world_tokenizer)
    (path / "notes.txt").write_text("mine\n")
    (path / "extra").mkdir()
    (path / "extra" / "a.bin").write_bytes(b"\x00\x01")
    new = SemanticProbe(ProbeConfig(hidden_size=32, hidden_dims=[8], reads=model_fingerprint(model, world_tokenizer)))
    export_probe(new, path)
    assert list(load_probe(path, model=model).config.hidden_dims) == [8]
    assert (path / "notes.txt").read_text() == "mine\n" and (path / "extra" / "a.bin").read_bytes() == b"\x00\x01"


def test_interrupted_export_keeps_old_probe(tmp_path, world_tokenizer, monkeypatch):
    model = tiny_llama(len(world_tokenizer), 32)
    old, path = _export(tmp_path, model, world_tokenizer)
    new = SemanticProbe(ProbeConfig(hidden_size=32, hidden_dims=[16, 8],
                                    reads=model_fingerprint(model, world_tokenizer)))

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
    return {r: {"hidden_size": d, "features": FeatureSpec(), "reads": {"hidden_size": d}} for r, d in widths.items()}


@pytest.mark.parametrize("loss", ["mse", "bce"])
def test_module_learns_both_roles(tmp_path, loss):
    widths = {"target": 16, "draft": 8}
    module = SemanticProbeModule(ProbeConfig(hidden_dims=[32]), ["target", "draft"], _spec(widths), loss=loss)
    trainer = L.Trainer(max_epochs=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    with torch.no_grad():
        val = list(_batches(4, widths, seed=1))
        before = sum(float(((module(**{r: b[r]["features"]})[r] - b[r]["label"]) ** 2).mean()) for b in val
                     for r in widths) / 8
    trainer.fit(module, _batches(30, widths), _batches(4, widths, seed=1))
    metrics = trainer.callback_metrics
    assert float(metrics["val/mse"]) < 0.6 * before
    for role in widths:
        for name in ("mse", "mae", "r2", "pearson", "auroc", "ece"):
            assert f"val/{role}/{name}" in metrics
        assert float(metrics[f"val/{role}/auroc"]) > 0.8
    assert module.probes["draft"].config.role == "draft" and module.probes["draft"].config.hidden_size == 8


def test_a_module_training_fewer_roles_than_the_data_streams_skips_batches_of_the_others_alone(tmp_path):
    """The validation split is cut in file order, so a batch can hold only the role the module does not train: the
    fit ended with "val batch has no rows for roles ['target']". Such a batch is skipped; the figures are the
    module's role's over the batches that hold it."""
    both = list(_batches(6, {"target": 8, "draft": 4}))
    mixed = DataLoader([{"draft": b["draft"]} if k % 2 else b for k, b in enumerate(both)], batch_size=None)
    module = SemanticProbeModule(ProbeConfig(hidden_dims=[8]), ["target"], _spec({"target": 8, "draft": 4}))
    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match="`training_step` returned `None`"):  # Lightning's word for a skipped step
        trainer.fit(module, mixed, mixed)
    kept, _ = [b["target"] for b in mixed if "target" in b], module.eval()
    with torch.no_grad():
        mse = torch.cat([(module(target=b["features"])["target"] - b["label"]) ** 2 for b in kept]).mean()
    torch.testing.assert_close(trainer.callback_metrics["val/target/mse"], mse)


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
    for kwargs, says in [({"draft_low_label_weight": float("inf")}, r"draft_low_label_weight=inf: expected a finite"),
                         ({"draft_low_label_weight": "2"}, r"draft_low_label_weight='2'"),
                         ({"roles": None}, r"roles=None: expected a non-empty list"),
                         ({"probe": None}, r"probe=None: expected a ProbeConfig"),
                         ({"optimizer": "adam"}, r"optimizer='adam': expected a callable")]:
        with pytest.raises(ValueError, match=says):  # a loss of NaN, or a TypeError naming no argument, before
            SemanticProbeModule(**kwargs)
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
    # no feature groups: [hidden]
    spec = {"target": {"hidden_size": 16, "features": FeatureSpec(), "reads": {"hidden_size": 16}}}
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
    assert c.sampling == SamplingSpec(0.6, 0.95) and c.labels["n_samples"] == 3
    assert c.step == StepSpec(("\n\n",), 32) and "max_step_tokens" not in c.labels  # one typed home


def test_probes_exported_before_the_sampling_spec_take_it_from_their_labels(world_tokenizer, tmp_path):
    import shutil
    from pathlib import Path

    from arithmetic_world.models import load_model

    root = Path(__file__).resolve().parents[2] / "checkpoints" / "arithmetic"
    for role in ("target", "draft"):
        # a format-2 export of the shipped probe: what format 3 added (the sampling spec) taken out
        folder = shutil.copytree(root / "probes" / role, tmp_path / role)
        config = json.loads((folder / "config.json").read_text())
        config["labels"].update(config.pop("sampling"))  # format 2 kept it among the labels' provenance
        config["format_version"] = 2
        (folder / "config.json").write_text(json.dumps(config))
        probe = load_probe(folder, model=load_model(role), tokenizer=world_tokenizer)
        # format 2 kept the sampling spec among the labels' provenance; it is read from there, not made up
        labels = config["labels"]
        assert probe.config.sampling == SamplingSpec(labels["temperature"], labels["top_p"])
        assert probe.config.labels["n_samples"] == labels["n_samples"]
        assert probe.config.step == StepSpec(tuple(config["delimiters"]), labels["max_step_tokens"])
    v1 = {k: v for k, v in config.items() if k not in ("labels",)} | {"format_version": 1}
    assert ProbeConfig.from_dict(v1).sampling is None  # nothing recorded: nothing to enforce


# --------------------------------------------------------------------------- role and config validation at load


def test_a_probe_used_in_the_other_role_is_refused_naming_both(tmp_path, world_tokenizer):
    """A draft probe handed over as the target probe is refused by its role, before any fingerprint check."""
    model = tiny_llama(len(world_tokenizer), 32)
    probe, path = _export(tmp_path, model, world_tokenizer, role="draft")
    with pytest.raises(ValueError, match=r"exported with role 'draft'.*used as the target probe"):
        load_probe(path, model=model, tokenizer=world_tokenizer, role="target")
    assert load_probe(path, model=model, tokenizer=world_tokenizer, role="draft").config.role == "draft"
    assert load_probe(path, model=model, tokenizer=world_tokenizer).config.role == "draft"  # role=None: either
    with pytest.raises(ValueError, match="role='judge'"):
        load_probe(path, role="judge")
    # a probe object, as the decoders hand it over, is checked as a folder is
    for given in (path, probe):
        with pytest.raises(ValueError, match=r"exported with role 'draft'.*used as the target probe"):
            load_probe(given, model, world_tokenizer, role="target")
        assert load_probe(given, model, world_tokenizer, role="draft").config.role == "draft"
    # a probe of another model in the wrong slot: the role is named first (the fingerprint would give no hint)
    other = tiny_llama(len(world_tokenizer), 24, layers=1)
    for given in (path, probe):
        with pytest.raises(ValueError, match="exported with role 'draft'"):
            load_probe(given, other, world_tokenizer, role="target")
    with pytest.raises(TypeError, match="must be a path or a SemanticProbe, got int"):
        load_probe(3, model, world_tokenizer)


def test_decoder_refuses_a_draft_probe_as_target_probe(tmp_path, world_tokenizer):
    from semanticspec.decoder import SemanticSpecDecoder

    model = tiny_llama(len(world_tokenizer), 32)
    _, path = _export(tmp_path, model, world_tokenizer, role="draft")
    with pytest.raises(ValueError, match=r"exported with role 'draft'.*used as the target probe"):
        SemanticSpecDecoder(model, model, world_tokenizer, target_probe=path)


def _edit_config(path, **changes):
    """Change ``config.json``'s fields; ``features.<field>`` changes one field of what the probe reads."""
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        (cfg["features"] if k.startswith("features.") else cfg)[k.removeprefix("features.")] = v
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, says", [
    ({"features.layer_ids": [-100]},
     r"features.layer_ids=\[-100\]: \[-100\] out of range for a model with 2 layers \(3 hidden_states"),
    ({"features.layer_ids": []}, r"features.layer_ids=\[\]: expected a non-empty list of layer indices"),
    ({"features.layer_ids": [-1, -1]}, r"features.layer_ids=\[-1, -1\]: a layer is listed twice"),
    ({"features.layer_ids": ["-1"]}, r"features.layer_ids=\['-1'\]: expected integers"),
    ({"sampling": {"temperature": float("nan"), "top_p": 0.95}}, r"sampling\.temperature=nan: expected a finite"),
    ({"sampling": {"temperature": float("inf")}}, r"sampling\.temperature=inf"),
    ({"sampling": {"top_p": 0}}, r"sampling\.top_p=0: expected a number in \(0, 1\]"),
    ({"format_version": 99}, r"format_version=99: written by a newer semanticspec-probes.*upgrade semanticspec-probes"),
    ({"hidden_size": 32.0}, r"hidden_size=32\.0: expected an integer >= 1"),  # a torch error when built, before
    ({"hidden_dims": [16.0]}, r"hidden_dims=\[16\.0\]: expected a list of integer widths"),
    ({"dropout": "x"}, r"dropout='x': expected a number"),  # a comparison's TypeError, naming no field, before
    ({"standardize": "false"}, r"standardize='false': expected true or false"),  # loaded as true before
    # each below loaded, and a later export or card failed with an AttributeError naming no file
    ({"features": ["hidden"]}, r"features=\['hidden'\]: expected a generation.specs.FeatureSpec"),
    ({"labels": None}, r"labels=None: expected an object"),
    ({"reads": "target"}, r"reads='target': expected an object"),
    ({"test_metrics": {"mse": "low"}}, r"test_metrics=\{'mse': 'low'\}: expected finite numbers"),
    ({"test_metrics": {"pearson": float("nan")}}, r"test_metrics=\{'pearson': nan\}: expected finite numbers"),
])
def test_invalid_config_is_refused_at_load_naming_the_file_and_field(tmp_path, world_tokenizer, changes, says):
    model = tiny_llama(len(world_tokenizer), 32)
    _, path = _export(tmp_path, model, world_tokenizer)
    _edit_config(path, **changes)  # json writes nan/inf as NaN/Infinity, which json (and config.json readers) read back
    with pytest.raises(ValueError, match=says) as err:
        load_probe(path, model=model, tokenizer=world_tokenizer)
    assert f"{path}/config.json" in str(err.value)


def test_a_config_json_that_is_no_object_is_refused_not_read_as_the_defaults(tmp_path, world_tokenizer):
    model = tiny_llama(len(world_tokenizer), 32)
    _, path = _export(tmp_path, model, world_tokenizer)
    (path / "config.json").write_text("[]")  # it read as a default config, and the weights were blamed
    with pytest.raises(ValueError, match=rf"{path}/config.json is not a probe config: expected a JSON object"):
        load_probe(path, model=model, tokenizer=world_tokenizer)


def test_layer_ids_are_checked_against_the_model_given_even_without_a_fingerprint(tmp_path, world_tokenizer):
    """An old export records no `reads`; a layer the model lacks is still refused at load, not in decoding."""
    model = tiny_llama(len(world_tokenizer), 32, layers=2)
    path = export_probe(SemanticProbe(ProbeConfig(hidden_size=32, features=FeatureSpec(layer_ids=[3]),
                                                  hidden_dims=[4])), tmp_path / "p")
    assert load_probe(path).config.features.layer_ids == (3,)  # no model: nothing to check the index against
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the "records no reads" warning
        with pytest.raises(ValueError,
                           match=rf"probe at {path} reads layers the model does not have.*\[3\] out of range.*-3\.\.2"):
            load_probe(path, model=model)
        ok = export_probe(SemanticProbe(ProbeConfig(hidden_size=32, features=FeatureSpec(layer_ids=[0, 2, -3]),
                                                    hidden_dims=[4])), tmp_path / "ok")
        assert load_probe(ok, model=model).config.features.layer_ids == (0, 2, -3)


def test_shapes_are_checked_in_the_header_before_anything_is_allocated(tmp_path, world_tokenizer, monkeypatch):
    from probes import model as model_module
    from probes.model import expected_shapes

    for cfg in (ProbeConfig(hidden_size=8, hidden_dims=[4, 3]), ProbeConfig(hidden_size=8, hidden_dims=[]),
                ProbeConfig(hidden_size=8, layer_combine="weighted_sum", hidden_dims=[5],
                            features=FeatureSpec(["hidden", "token_stats"], [-1, 0], token_stats=["mean_logprob"]))):
        assert expected_shapes(cfg) == {k: tuple(v.shape) for k, v in SemanticProbe(cfg).state_dict().items()}
    model = tiny_llama(len(world_tokenizer), 32)
    _, path = _export(tmp_path, model, world_tokenizer)
    _edit_config(path, hidden_dims=[1_000_000_000])

    def no_build(*a, **kw):
        raise AssertionError("the probe was built before its shapes were checked")

    monkeypatch.setattr(model_module.SemanticProbe, "__init__", no_build)
    with pytest.raises(ValueError) as err:
        load_probe(path, model=model, tokenizer=world_tokenizer)
    msg = str(err.value)
    assert f"{path}/model.safetensors does not hold the weights {path}/config.json describes" in msg
    assert "mlp.0.weight has shape [16, 32], expected [1000000000, 32]" in msg and "hidden_dims=[1000000000]" in msg


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, world_tokenizer, bad):
    from safetensors.torch import save_file

    model = tiny_llama(len(world_tokenizer), 32)
    probe, path = _export(tmp_path, model, world_tokenizer)
    state = {k: v.clone().contiguous() for k, v in probe.state_dict().items()}
    state["mlp.3.bias"][0] = bad
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{path}/model.safetensors holds NaN or infinite values in \['mlp.3.bias'\]"):
        load_probe(path, model=model, tokenizer=world_tokenizer)


def test_a_probe_in_memory_holding_nan_is_refused_as_a_file_is(tmp_path, world_tokenizer):
    # it was taken as it was, and every step scored NaN with a warning that blamed the model's hidden states
    model = tiny_llama(len(world_tokenizer), 32)
    probe, _ = _export(tmp_path, model, world_tokenizer)
    with torch.no_grad():
        probe.mlp[3].bias[0] = float("nan")
    with pytest.raises(ValueError, match=r"the target probe holds NaN or infinite values in \['mlp.3.bias'\]"):
        load_probe(probe, model=model, tokenizer=world_tokenizer, role="target")


def test_weights_that_would_score_every_step_nan_are_refused(tmp_path, world_tokenizer):
    """A zero standardisation, or integer tensors (which truncate it to zero), load without a NaN in the file but
    make every score NaN: refused, naming the tensor."""
    from safetensors.torch import save_file

    model = tiny_llama(len(world_tokenizer), 32)
    probe, path = _export(tmp_path, model, world_tokenizer)
    state = {k: v.clone().contiguous() for k, v in probe.state_dict().items()}
    save_file({**state, "input_std": torch.zeros_like(state["input_std"])}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"holds an input_std that is not positive everywhere"):
        load_probe(path, model=model, tokenizer=world_tokenizer)
    save_file({k: v.to(torch.int64) for k, v in state.items()}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"input_std is I64, expected floating point"):
        load_probe(path, model=model, tokenizer=world_tokenizer)


def test_non_finite_sampling_is_refused_on_the_config_not_on_a_decoder_argument():
    with pytest.raises(ValueError, match=r"invalid ProbeConfig: sampling\.temperature=nan"):
        ProbeConfig(sampling={"temperature": float("nan")})


def test_the_shipped_probes_still_load_with_every_check(world_tokenizer):
    from pathlib import Path

    from arithmetic_world.models import load_model

    root = Path(__file__).resolve().parents[2] / "checkpoints" / "arithmetic"
    for folder, groups in (("probes", ["hidden", "token_stats"]), ("probes-topk", ["topk_stats"])):
        for role in ("target", "draft"):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                probe = load_probe(root / folder / role, model=load_model(role), tokenizer=world_tokenizer, role=role)
            assert probe.config.role == role and list(probe.config.features.groups) == groups


def test_export_writes_a_model_card_from_the_config(tmp_path, world_tokenizer):
    """README.md says what the probe reads, which model, its labels and metrics, and how to load it."""
    model = tiny_llama(len(world_tokenizer), 32)
    labels = {"labelling": "joint", "clustering": "hdbscan+judge", "seed": 7, "n_samples": 5,
              "judge": {"kind": "llm", "model": {"name_or_path": "judges/tiny"}}}
    _, path = _export(tmp_path, model, world_tokenizer, role="draft",
                      features=FeatureSpec(["hidden", "token_stats"], [-1, 1], "last",
                                           token_stats=["mean_logprob", "max_entropy"]),
                      labels=labels, sampling={"temperature": 0.7, "top_p": 0.9}, step={"max_step_tokens": 24},
                      test_metrics={"mse": 0.0123, "draft_written/auroc": 0.987})
    card = (path / "README.md").read_text()
    tok_hash = model_fingerprint(model, world_tokenizer)["tokenizer_hash"]
    assert "More Information Needed" not in card and "pushed to the Hub" not in card
    assert card.startswith("---\nlibrary_name: semanticspec-probes\n")
    data = ModelCard.load(path / "README.md").data  # the front matter is Hub metadata the Hub's own parser reads
    assert data.license == "apache-2.0" and data.tags == ["semanticspec", "speculative-decoding", "draft-probe"]
    assert "# SemanticSpec draft probe for" in card and "**draft** model would write" in card
    for fact in ("`hidden`, `token_stats`", "`[-1, 1]`", "`last` over the step's tokens",
                 # 2 layers x 32 + 2 statistics
                 "`mean_logprob`, `max_entropy`", "MLP 66 → 16 → 8 → 1", "at most 24 tokens",
                 "| num_layers | `2` |", "| hidden_size | `32` |", f"| tokenizer_hash | `{tok_hash}` |",
                 "| samples per prefix and model (N) | 5 |", "temperature 0.7, top_p 0.9", "`hdbscan+judge`",
                 "`llm` (`judges/tiny`)", "| seed | 7 |", "| mse | 0.0123 |", "| draft_written/auroc | 0.9870 |",
                 'role="draft"', "draft_probe=", f"format version {FORMAT_VERSION}",
                 "| read by | `transformers`, hidden states `final_norm` |"):
        assert fact in card, fact
    no_judge = ProbeConfig(hidden_size=8, hidden_dims=[4], labels={"clustering": "hdbscan", "judge": {"kind": "none"}})
    assert "| judge | `none` |" in (export_probe(SemanticProbe(no_judge), tmp_path / "nj") / "README.md").read_text()
    bare = export_probe(SemanticProbe(ProbeConfig(hidden_size=8, hidden_dims=[4])), tmp_path / "bare")
    card = (bare / "README.md").read_text()  # an old-style config: what is missing is said, not invented
    assert "Not recorded (an old export)" in card and "None recorded at export" in card
    assert "No label provenance recorded" in card
    assert "Not recorded: the probe was trained before exports recorded" in card


def test_metrics_undefined_on_the_rows_are_nan_not_zero():
    # test rows all labelled 1: AUROC and R² are undefined, and the results table showed them as a measured 0.0000
    import torchmetrics.functional as F

    from probes.module import regression_metrics

    metrics, preds = regression_metrics(), torch.rand(8)
    metrics.update(preds, torch.ones(8))
    out = metrics.compute()
    assert math.isnan(out["auroc"]) and math.isnan(out["r2"]) and out["mse"] > 0
    metrics.reset()
    labels = torch.tensor([0.0, 0.2, 0.7, 1.0, 0.4, 0.9, 0.1, 0.6])
    metrics.update(preds, labels)  # where they are defined, they are torchmetrics' own
    out = metrics.compute()
    torch.testing.assert_close(out["r2"], F.r2_score(preds, labels))
    torch.testing.assert_close(out["auroc"], F.classification.binary_auroc(preds, (labels >= 0.5).long()))


def test_a_module_built_in_python_reloads_from_its_checkpoint(tmp_path):
    """``SemanticProbeModule(ProbeConfig(...))`` keeps the config object in its hyperparameters; Lightning's
    ``load_from_checkpoint`` (torch's weights_only unpickler) refused it as an unsupported global."""
    import lightning as L

    from datamodules.datamodule import SemanticProbeDataModule
    from probes.module import SemanticProbeModule
    from tests.conftest import make_dataset

    make_dataset(tmp_path / "d")
    dm = SemanticProbeDataModule(str(tmp_path / "d"), build=None, batch_size=10, val_fraction=0.25,
                                 test_fraction=0.25)
    module = SemanticProbeModule(ProbeConfig(hidden_dims=[4]), ["target", "draft"], dm.input_spec)
    trainer = L.Trainer(max_epochs=1, logger=False, default_root_dir=tmp_path, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, datamodule=dm)
    again = SemanticProbeModule.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)
    x = torch.randn(3, module.probes["target"].config.input_size)
    torch.testing.assert_close(again.probes["target"].eval()(x), module.probes["target"].eval()(x))


def test_a_probe_given_as_a_dict_of_fields_is_read_in_todays_layout(tmp_path):
    """``SemanticProbeModule(probe={"hidden_dims": [16]})`` was read as a format-0 config.json: standardisation off,
    and with the data's input_spec refused for a step field the user never set."""
    from datamodules.datamodule import SemanticProbeDataModule
    from probes.module import SemanticProbeModule
    from tests.conftest import make_dataset

    assert SemanticProbeModule(probe={"hidden_dims": [16]}).probes["target"].config.standardize
    make_dataset(tmp_path / "d")
    dm = SemanticProbeDataModule(str(tmp_path / "d"), build=None, batch_size=10, val_fraction=0.25,
                                 test_fraction=0.25)
    module = SemanticProbeModule(probe={"hidden_dims": [16]}, input_spec=dm.input_spec)
    assert module.probes["draft"].config.standardize and list(module.probes["draft"].config.hidden_dims) == [16]
    old = SemanticProbeModule(probe={"hidden_dims": [16], "format_version": 1})  # a format it says: upgraded as such
    assert not old.probes["target"].config.standardize


def test_trainer_predict_scores_the_held_out_rows(tmp_path):
    """``trainer.predict(module, datamodule=dm)`` had no predict_dataloader, and with a loader Lightning's default
    step called ``module(batch)``, which takes keyword arguments."""
    import lightning as L

    from datamodules.datamodule import SemanticProbeDataModule
    from probes.module import SemanticProbeModule
    from tests.conftest import make_dataset

    make_dataset(tmp_path / "d")
    dm = SemanticProbeDataModule(str(tmp_path / "d"), build=None, batch_size=10, val_fraction=0.25,
                                 test_fraction=0.25)
    module = SemanticProbeModule(ProbeConfig(hidden_dims=[4]), ["target", "draft"], dm.input_spec)
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    out = trainer.predict(module, datamodule=dm)
    rows = sum(len(b["target"]["q"]) for b in out if "target" in b)
    assert rows == sum(len(b["target"]["label"]) for b in dm.test_dataloader() if "target" in b) > 0
    b = next(b for b in out if "target" in b)
    torch.testing.assert_close(b["target"]["q"], module.probes["target"].eval()(next(
        x for x in dm.test_dataloader() if "target" in x)["target"]["features"]))


def test_overfit_batches_repeats_its_batches_and_a_loaded_module_keeps_the_callers_seed(tmp_path):
    """The stream shuffled on its own, so ``overfit_batches`` drew other batches every epoch; a module only loaded
    from a checkpoint restored the checkpoint's random state at its next fit's first epoch, over the caller's seed.
    Bad loader sizes and repeated roles are one ValueError naming them."""
    import lightning as L

    from datamodules.datamodule import SemanticProbeDataModule
    from probes.module import SemanticProbeModule
    from tests.conftest import make_dataset

    make_dataset(tmp_path / "d")
    dm = SemanticProbeDataModule(str(tmp_path / "d"), build=None, batch_size=10, val_fraction=0.25,
                                 test_fraction=0.25)
    seen = []

    class Labels(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, i):
            seen.append(float(sum(p["label"].sum() for p in batch.values())))

    def trainer(**kw):
        return L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         **kw)

    module = SemanticProbeModule(ProbeConfig(hidden_dims=[4]), ["target", "draft"], dm.input_spec)
    fitted = trainer(max_epochs=3, overfit_batches=2, callbacks=[Labels()])
    fitted.fit(module, datamodule=dm)
    assert len(seen) == 6 and seen[:2] == seen[2:4] == seen[4:]
    path = tmp_path / "m.ckpt"
    fitted.save_checkpoint(path)
    weights = []
    for seed in (1, 2):
        L.seed_everything(seed, verbose=False)
        again = SemanticProbeModule.load_from_checkpoint(path)
        trainer(max_epochs=1, enable_checkpointing=False).fit(again, datamodule=dm)
        weights.append(again.probes["target"].mlp[0].weight.detach().clone())
    assert not torch.equal(*weights)  # each seed's dropout draws
    for bad, said in (({"batch_size": 2.5}, "batch_size=2.5: expected an integer >= 1"),
                      ({"roles": ["target", "target"]}, "without repeats")):
        with pytest.raises(ValueError, match=said):
            SemanticProbeDataModule(str(tmp_path / "d"), build=None, **bad)


def test_a_module_and_a_datamodule_that_disagree_on_roles_or_layers_are_refused_naming_them(tmp_path):
    import dataclasses

    import lightning as L

    from datamodules.datamodule import SemanticProbeDataModule
    from probes.module import SemanticProbeModule
    from tests.conftest import make_dataset

    make_dataset(tmp_path / "d")

    def fit(module, **dm):
        data = SemanticProbeDataModule(str(tmp_path / "d"), build=None, batch_size=10, val_fraction=0.25,
                                       test_fraction=0.25, **dm)
        L.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                  enable_checkpointing=False).fit(module, datamodule=data)

    spec = SemanticProbeDataModule(str(tmp_path / "d"), build=None).input_spec
    with pytest.raises(ValueError, match=r"probes for \['target', 'draft'\] but the datamodule streams roles "
                                         r"\['target'\] \(missing \['draft'\]\)"):
        fit(SemanticProbeModule(ProbeConfig(hidden_dims=[4]), ["target", "draft"], spec), roles=["target"])
    other = {r: dict(s, features=dataclasses.replace(s["features"], layer_ids=(-2,))) for r, s in spec.items()}
    with pytest.raises(ValueError, match=r"differing: layer_ids: probe \(-2,\), data \(-1,\)"):
        fit(SemanticProbeModule(ProbeConfig(hidden_dims=[4]), ["target", "draft"], other))


def test_from_pretrained_loads_through_load_probe_and_save_pretrained_writes_the_probe_as_it_is(tmp_path):
    """huggingface_hub's methods: from_pretrained checks a folder as load_probe does (it loaded a missing tensor at
    its random initial value, and took no role); save_pretrained writes the probe's config as it is now, in today's
    layout, beside a card from the same config (it wrote the config the probe was built from: a format-3 probe's
    old layout under a card saying format 6, and a changed config not at all)."""
    shipped = Path(__file__).resolve().parents[2] / "checkpoints" / "arithmetic" / "probes" / "target"
    probe = SemanticProbe.from_pretrained(shipped)
    x = torch.randn(3, probe.config.input_size)
    assert torch.equal(probe(x), load_probe(shipped)(x)) and not probe.training
    probe.config.test_metrics = {"mse": 0.5}
    probe.save_pretrained(tmp_path / "again")
    saved = json.loads((tmp_path / "again" / "config.json").read_text())
    assert saved["format_version"] == FORMAT_VERSION and "features" in saved and saved["test_metrics"] == {"mse": 0.5}
    assert "| mse | 0.5000 |" in (tmp_path / "again" / "README.md").read_text()
    with pytest.raises(ValueError, match="exported with role 'target'.*used as the draft probe"):
        SemanticProbe.from_pretrained(shipped, role="draft")
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tmp_path / "again" / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k != "mlp.0.bias"}, str(tmp_path / "again" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"does not hold the weights .*missing tensors \['mlp.0.bias'\]"):
        SemanticProbe.from_pretrained(tmp_path / "again")


def test_an_export_records_portable_paths_refuses_a_file_and_expands_the_home_folder(tmp_path, monkeypatch):
    """export_probe (and save_pretrained) wrote the exporting machine's folders into config.json and the card (only
    the fit made them portable), replaced a file in its way without a word, and made a folder named "~"."""
    cfg = ProbeConfig(hidden_size=8, hidden_dims=[4], reads={"name_or_path": "/home/someone/models/target-7b"},
                      labels={"judge": {"model": "/home/someone/models/judge"}})
    probe = SemanticProbe(cfg)
    out = export_probe(probe, tmp_path / "probe")
    text = (out / "config.json").read_text() + (out / "README.md").read_text()
    assert "/home/someone" not in text and "target-7b" in text
    assert probe.config.reads["name_or_path"] == "/home/someone/models/target-7b"  # the caller's probe unchanged
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(ValueError, match="afile is a file; export a probe into a folder"):
        export_probe(probe, tmp_path / "afile")
    assert (tmp_path / "afile").read_text() == "mine"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    export_probe(probe, "~/p")
    assert load_probe("~/p").config.hidden_size == 8 and not Path("~").exists()
    assert SemanticProbe.from_pretrained("~/p").config.hidden_size == 8  # the mixin read "~/p" as a hub repo id
    (tmp_path / "home" / "p" / "config.json").write_text("{")
    with pytest.raises(ValueError, match=r"p/config.json is not valid JSON"):  # the mixin's bare JSONDecodeError
        SemanticProbe.from_pretrained(tmp_path / "home" / "p")
    with pytest.raises(FileNotFoundError, match="does not exist; pass the folder of an exported probe"):
        load_probe(tmp_path / "nowhere")


def test_a_path_that_is_no_probe_folder_and_a_bad_device_or_model_are_named(tmp_path, monkeypatch, world_tokenizer):
    """from_pretrained sent every path that was not a folder to the Hub (an absolute one: "Repo id must be in the form
    ...", a relative one: network retries, then LocalEntryNotFoundError); a bad device, a tokenizer for the model, or a
    string for the tokenizer failed in torch or with an AttributeError; save_pretrained("") wrote into the working
    folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    export_probe(SemanticProbe(ProbeConfig(hidden_size=8, hidden_dims=[4])), tmp_path / "probe")
    for path, says in [(tmp_path / "typo", "typo does not exist"), ("typo/probe/target", "typo/probe/target does not"),
                       (tmp_path / "probe" / "config.json", r"config.json is a file; pass the folder")]:
        with pytest.raises(FileNotFoundError, match=says):
            SemanticProbe.from_pretrained(path)
    with pytest.raises(ValueError, match=r"map_location: 'nope' is not a torch device"):
        SemanticProbe.from_pretrained(tmp_path / "probe", map_location="nope")
    with pytest.raises(ValueError, match=r"device: 'nope' is not a torch device"):
        load_probe(tmp_path / "probe", device="nope")
    with pytest.raises(TypeError, match=r"model: expected the transformers model the probe reads"):
        load_probe(tmp_path / "probe", model=world_tokenizer)
    with pytest.raises(TypeError, match=r"tokenizer: expected the model's tokenizer, got str"):
        load_probe(tmp_path / "probe", model=tiny_llama(len(world_tokenizer), 8), tokenizer="tok")
    with pytest.raises(ValueError, match=r"save_directory='': expected a folder path"):
        load_probe(tmp_path / "probe").save_pretrained("")
    assert not (tmp_path / "config.json").exists()


def test_a_config_dict_without_a_format_reads_as_todays_layout():
    """A dict written by hand is today's layout (it was read as format 0: no standardisation, and a nested
    ``features`` replaced by the pooled last layer)."""
    probe = SemanticProbe({"hidden_size": 8, "hidden_dims": [4], "features": {"groups": ["token_stats"]}})
    assert probe.config.standardize and probe.config.features.groups == ("token_stats",)
    assert ProbeConfig.from_dict({"hidden_size": 8, "features": {"groups": ["token_stats"]}}).features.groups == (
        "token_stats",)


def test_save_pretrained_takes_a_config_dict_as_huggingface_hubs_mixin_does(tmp_path):
    """The mixin's save_pretrained takes a dict as its config: it was an AttributeError ('dict' has no 'reads')."""
    probe = SemanticProbe(ProbeConfig(hidden_size=8, hidden_dims=[4]))
    probe.save_pretrained(tmp_path / "p", config={"hidden_size": 8, "hidden_dims": [4], "role": "target"})
    assert load_probe(tmp_path / "p").config.hidden_size == 8


def test_a_transformers_model_given_as_the_probe_is_a_type_error():
    """A model has a config too: it was an AttributeError ('LlamaConfig' has no 'role')."""
    from tests.conftest import tiny_llama

    with pytest.raises(TypeError, match="must be a path or a SemanticProbe"):
        load_probe(tiny_llama(100, 8), role="target")


def test_a_float64_weights_file_whose_values_overflow_float32_is_refused(tmp_path):
    """1e300 is finite in a float64 file, which the header allows, and infinite in the float32 probe: it loaded."""
    from safetensors.torch import load_file, save_file

    export_probe(SemanticProbe(ProbeConfig(hidden_size=8, hidden_dims=[4])), tmp_path / "p")
    weights = {k: v.double() for k, v in load_file(str(tmp_path / "p" / "model.safetensors")).items()}
    weights["mlp.0.weight"][0, 0] = 1e300
    save_file(weights, str(tmp_path / "p" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"NaN or infinite values in \['mlp.0.weight'\]"):
        load_probe(tmp_path / "p")


def test_a_probe_loaded_in_float16_exports_float32_weights(tmp_path):
    """An export's weights are float32: one of a probe loaded with dtype float16 (or auto on AVX2) wrote its MLP in
    float16, its precision lost for good."""
    from safetensors import safe_open

    export_probe(SemanticProbe(ProbeConfig(hidden_size=8, hidden_dims=[4])), tmp_path / "a")
    half = load_probe(tmp_path / "a", dtype="float16")
    export_probe(half, tmp_path / "b")
    with safe_open(str(tmp_path / "b" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    assert half.mlp_dtype == torch.float16  # the probe itself is left as it was
