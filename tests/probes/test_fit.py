"""`python -m probes.fit`: configs, --help, bad keys, the end-to-end default (reduced), Ctrl-C and resume, DDP."""

import csv
import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch
import yaml

from generation.specs import FeatureSpec, StepSpec
from generation.steps import DEFAULT_DELIMITERS
from probes.config import FORMAT_VERSION
from probes.model import load_probe
from probes.fit import DEFAULT_CONFIG, main
from tests.conftest import refuse_in_a_fresh_process

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses(path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(path), "--print_config"])
    assert exit_.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["probe"]["hidden_dims"] and printed["data"]["roles"]


def _one_line_error(capsys, args) -> str:
    """Run main(args), expect exit 2 and return the single error line it wrote to stderr."""
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]  # no "Seed set to 0" before it
    assert len(lines) == 1 and lines[0].startswith("python -m probes.fit: error: "), err
    assert "Traceback" not in err and "usage:" not in err
    return lines[0]


def test_unknown_key_is_named(capsys):
    assert "max_epochz" in _one_line_error(capsys, ["--trainer.max_epochz", "3", "--print_config"])


def test_a_mistyped_argument_of_a_chosen_class_is_not_blamed_on_the_default_config(capsys):
    """jsonargparse's "Option 'lrr' is not accepted" names no parent: it was read as a key of configs/arithmetic.yaml,
    the default config the command line was given after."""
    line = _one_line_error(capsys, ["--model.optimizer.init_args.lrr", "3"])
    assert "Option 'lrr' is not accepted" in line and "a key of" not in line, line


def test_a_config_file_that_is_empty_or_holds_a_mistyped_key_is_named(tmp_path, capsys):
    """jsonargparse said "Unexpected config:" of an empty file and named no file for a key it does not know."""
    empty, listed, typo = tmp_path / "empty.yaml", tmp_path / "list.yaml", tmp_path / "typo.yaml"
    empty.write_text("# nothing yet\n")
    listed.write_text("- trainer\n")
    typo.write_text("trainer:\n  max_epoch: 1\n")
    assert f"--config {empty}: expected a YAML mapping of options (key: value lines), found nothing" in \
        _one_line_error(capsys, ["--config", str(empty)])
    assert "found a list" in _one_line_error(capsys, ["--config", str(listed)])
    line = _one_line_error(capsys, ["--config", str(typo)])
    assert f"--config {typo}: unknown key 'trainer.max_epoch'; did you mean --trainer.max_epochs?" in line


def test_prefix_of_a_key_is_not_expanded(capsys):
    # argparse would read --trainer.max_epoch as --trainer.max_epochs and run with it
    assert "--trainer.max_epoch 1" in _one_line_error(capsys, ["--trainer.max_epoch", "1", "--print_config"])


@pytest.mark.parametrize("args, named, not_named", [
    (["--data.batch_size", "0"], "batch_size=0: expected an integer >= 1", "num_workers"),
    (["--trainer.max_epochs", "0"], "--trainer.max_epochs 0: expected a number of epochs >= 1, or -1", "Epoch"),
    (["--data.build.sampling.n_samples", "0"], "sampling.n_samples=0: expected >= 1", "Traceback"),
    (["--data.build.sampling.backend", "openai"], "error: invalid BuildConfig: sampling.openai.target.urls=[]",
     "Union"),
    (["--trainer.max_epochs", "x"], 'Parser key "trainer.max_epochs"', "Traceback"),
    (["--trainer.precision", "bogus"], 'Parser key "trainer.precision"', "Subtypes"),  # the real parser's type error
    (["--trainer.devices", "0"], "--trainer: `Trainer(devices='0')` value is not a valid input", "Traceback"),
    # each below: a traceback (the first three once training ran, a ZeroDivisionError inside Lightning's loops) or,
    # accumulate_grad_batches -1, a fit that trained otherwise
    (["--trainer.accumulate_grad_batches", "0"], "--trainer.accumulate_grad_batches 0: expected an integer >= 1",
     "Traceback"),
    (["--trainer.accumulate_grad_batches", "-1"], "--trainer.accumulate_grad_batches -1: expected", "Traceback"),
    (["--trainer.check_val_every_n_epoch", "0"], "--trainer.check_val_every_n_epoch 0: expected", "Traceback"),
    (["--trainer.val_check_interval", "0"], "--trainer.val_check_interval 0: expected a share", "Traceback"),
    (["--trainer.limit_val_batches", "0"], "give --data.val_fraction 0", "Traceback"),
    # refused by live validation's setup, after the data was prepared (a minute's label build) and Lightning's lines
    (["--data.roles", "[draft]"], "--data.roles ['draft']: SpeculativeValidation (live validation", "Traceback"),
    (["--data.roles", "[foo]"], "roles=['foo']: expected a non-empty subset of", "SpeculativeValidation"),
    # outside Lightning's documented ranges, taken without a word
    (["--trainer.min_epochs", "-3"], "--trainer.min_epochs -3: expected an integer >= 0", "Traceback"),
    (["--trainer.log_every_n_steps", "0"], "--trainer.log_every_n_steps 0: expected an integer >= 1", "Traceback"),
    (["--trainer.num_sanity_val_steps", "-2"], "--trainer.num_sanity_val_steps -2: expected an integer >= -1",
     "Traceback"),
    (["--trainer.devices", "-2"], "--trainer: `devices` selected with `CPUAccelerator` should be an int > 0",
     "Traceback"),
    (["--export_dir", "/proc/x"], "--export_dir /proc/x: no folder can be made in /proc", "Traceback"),  # after fit
    (["--export_dir", ""], "--export_dir '': expected a folder", "Traceback"),  # the default, silently
    (["--export_dir", __file__], f"--export_dir {__file__}: is a file", "Traceback"),
    (["--ckpt_path", ""], "--ckpt_path '': expected a last.ckpt", "best weights"),  # Lightning's words, naming none
    (["--data.data_dir", ""], "data_dir '': expected a folder", "Traceback"),  # wrote into the working folder
    (["--data.build.judge.yes_answer", ""], "judge.yes_answer='': expected the answer's text", "IndexError"),
    (["--model.probe.features_dtype", "foo"], "features_dtype='foo': expected one of", "Traceback"),
    # a task refusing its own arguments: its message was buried in the unions' and the namespaces' text
    (["--data.build.task", "datamodules.tasks.choice.MultipleChoiceTask", "--data.build.task.letters", "abc"],
     "error: letters='abc': expected upper-case letters", "Namespace"),
])
def test_refused_values_end_in_one_line_and_exit_2(capsys, tmp_path, args, named, not_named):
    line = _one_line_error(capsys, args + ["--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path)])
    assert named in line and not_named not in line


def test_a_run_folder_where_nothing_can_be_made_is_named(capsys):
    """It was a bare "[Errno 2] No such file or directory: '/proc/x'" after Lightning's device lines."""
    line = _one_line_error(capsys, ["--trainer.logger", "false", "--trainer.default_root_dir", "/proc/x"])
    assert "--trainer.default_root_dir /proc/x: no folder can be made in /proc" in line


def test_bad_task_file_is_reported_before_training_in_one_line(capsys, tmp_path):
    task_file = tmp_path / "tasks.jsonl"
    task_file.write_text('{"problem": "Start with 1. Add 2. What is the result?", "answer": 3}\n')  # no trace
    line = _one_line_error(capsys, ["--data.data_dir", str(tmp_path / "data"), "--data.build.task.class_path",
                                    "datamodules.tasks.base.Task",
                                    "--data.build.task.init_args.path", str(task_file),
                                    "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path)])
    assert f"{task_file}:1" in line and "trace" in line


def test_no_lightning_warning_about_args(recwarn):
    with pytest.raises(SystemExit):
        main(["--print_config"])
    assert not [w for w in recwarn if "args parameter" in str(w.message)]


def test_print_config_takes_jsonargparses_flags_after_an_equals_sign(capsys):
    """``--print_config=skip_null`` is jsonargparse's own spelling (its value is optional): it was split into
    ``--print_config skip_null`` and refused as an unrecognized argument."""
    with pytest.raises(SystemExit) as exit_:
        main(["--print_config=skip_null"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "max_epochs:" in out and ": null" not in out


def test_help_documents_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help_all"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    words = " ".join(out.split())
    assert out.startswith("usage: python -m probes.fit ") and "train the target and draft probes" in words
    assert "Lightning Trainer command line tool" not in words
    for text in ("--data.build.help", "--data.batch_size", "--model.loss", "--export_dir", "--trainer.max_epochs",
                 "Where the best probes are exported"):
        assert text in out
    with pytest.raises(SystemExit):
        main(["--data.build.help", "BuildConfig"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m probes.fit ")  # jsonargparse's nested parser had no prog: "fit.py"
    assert "--data.build.sampling.n_samples" in out and "Steps sampled per prefix" in out
    assert "--data.build.judge.kind" in out and "--data.build.steps.max_step_tokens" in out


def test_nested_override_reaches_the_build(capsys):
    with pytest.raises(SystemExit):
        main(["--data.build.sampling.n_samples", "4", "--data.build.sampling.temperature", "0.8",
              "--data.build.judge.threshold", "0.7", "--model.optimizer.lr", "0.01", "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    build = printed["data"]["build"]
    sampling = {k: build["sampling"][k] for k in ("backend", "n_samples", "temperature", "top_p", "seed")}
    assert sampling == {"backend": "hf", "n_samples": 4, "temperature": 0.8, "top_p": 0.95, "seed": 0}
    assert build["judge"]["threshold"] == 0.7 and build["steps"]["max_step_tokens"] == 32
    assert printed["model"]["optimizer"]["init_args"]["lr"] == 0.01


def test_missing_data_dir_without_build_is_named(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    line = _one_line_error(capsys, ["--data.data_dir", str(missing), "--data.build", "null", "--trainer.logger",
                                    "false"])
    assert str(missing) in line and "python -m datamodules.labels.build" in line


def test_default_config_exports_inside_the_run_folder(capsys, tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from probes.fit import default_export_dir

    with pytest.raises(SystemExit):
        main(["--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["export_dir"] is None and printed["export"] is True  # never the shipped checkpoints/ by default
    trainer = L.Trainer(logger=CSVLogger(tmp_path, name="fit"), default_root_dir=tmp_path)
    assert default_export_dir(trainer) == tmp_path / "fit" / "version_0" / "export"


def _absolute_paths(value, where=""):
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _absolute_paths(v, f"{where}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _absolute_paths(v, f"{where}[{i}]")]
    return [f"{where}={value}"] if isinstance(value, str) and value.startswith(("/", "~")) else []


def test_exports_carry_no_absolute_path(tmp_path):
    from probes.config import ProbeConfig
    from generation.paths import REPO_ROOT
    from probes.fit import export_probes
    from probes.module import SemanticProbeModule

    inside, outside = str(REPO_ROOT / "checkpoints" / "arithmetic" / "target"), "/home/someone/models/draft-1.5b"
    spec = {r: {"hidden_size": 8, "features": FeatureSpec(), "reads": {"hidden_size": 8, "name_or_path": path},
                "labels": {"judge": {"model": {"name_or_path": inside}}}} for r, path in (("target", inside),
                                                                                          ("draft", outside))}
    module = SemanticProbeModule(ProbeConfig(hidden_dims=[4]), ["target", "draft"], spec)
    paths = export_probes(module, tmp_path, {"test/target/mse": 0.1})
    configs = {r: json.loads((paths[r] / "config.json").read_text()) for r in paths}
    assert configs["target"]["reads"]["name_or_path"] == "checkpoints/arithmetic/target"
    assert configs["draft"]["reads"]["name_or_path"] == "draft-1.5b"
    assert configs["draft"]["labels"]["judge"]["model"]["name_or_path"] == "checkpoints/arithmetic/target"
    assert not _absolute_paths(configs)


def test_an_undefined_test_metric_is_left_out_of_the_export_which_stays_json(tmp_path):
    """A metric undefined on the test rows (NaN: a Pearson of a constant prediction) was written as ``NaN``, which is
    not JSON: a strict parser, or any client outside Python, refused the exported ``config.json``."""
    from probes.config import ProbeConfig
    from probes.fit import export_probes
    from probes.module import SemanticProbeModule

    module = SemanticProbeModule(ProbeConfig(hidden_dims=[4]), ["target"],
                                 {"target": {"hidden_size": 8, "features": FeatureSpec()}})
    paths = export_probes(module, tmp_path, {"test/target/mse": 0.1, "test/target/pearson": float("nan")})

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    config = json.loads((paths["target"] / "config.json").read_text(), parse_constant=refuse)
    assert config["test_metrics"] == {"mse": 0.1}


def test_shipped_probe_configs_carry_no_absolute_path():
    from generation.paths import REPO_ROOT

    shipped = sorted((REPO_ROOT / "checkpoints").glob("*/probes/*/config.json"))
    assert shipped
    for path in shipped:
        assert not _absolute_paths(json.loads(path.read_text())), path


@pytest.fixture(scope="module")
def run_config(tmp_path_factory):
    """A reduced version of the default config: a small label build, 2 epochs, live validation every epoch."""
    root = tmp_path_factory.mktemp("fit")
    cfg = yaml.safe_load(DEFAULT_CONFIG.read_text())  # no export_dir: the probes go inside the run's folder
    cfg["trainer"].update(max_epochs=2, default_root_dir=str(root / "runs"), enable_progress_bar=False)
    cfg["trainer"]["logger"]["init_args"]["save_dir"] = str(root / "runs")
    for cb in cfg["trainer"]["callbacks"]:
        if cb["class_path"].endswith("SpeculativeValidation"):
            cb["init_args"].update(max_problems=2, max_seconds=20, every_n_epochs=1, max_new_tokens=48)
    cfg["data"]["data_dir"] = str(root / "data")
    cfg["data"]["build"] = {"n_problems": 12, "sampling": {"n_samples": 3}, "shard_size": 8}
    cfg["data"].update(val_fraction=0.25, test_fraction=0.25)
    cfg["model"]["probe"]["hidden_dims"] = [64, 32]
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return root, path


@pytest.fixture(scope="module")
def fitted(run_config):
    root, path = run_config
    return root, path, main(["--config", str(path)])


@pytest.mark.slow
def test_end_to_end_default_reduced(fitted, capsys):
    from arithmetic_world.models import load_model, load_tokenizer

    root, path, result = fitted
    tok = load_tokenizer()
    run_dir = root / "runs" / "fit" / "version_0"
    for role in ("target", "draft"):
        exported = result["export"][role]
        assert Path(exported) == run_dir / "export" / role  # inside the run's folder, not checkpoints/
        probe = load_probe(exported, model=load_model(role), tokenizer=tok)
        cfg = json.loads((Path(exported) / "config.json").read_text())
        assert cfg["role"] == role and cfg["reads"]["hidden_size"] == probe.config.hidden_size
        assert not _absolute_paths(cfg)
        m = cfg["test_metrics"]
        assert set(m) >= {"mse", "mae", "auroc"}
        prefix = f"test/{role}/"
        # a metric undefined on the test rows (Pearson on a subset whose labels are all equal, as in this reduced
        # build: nan) is left out of the export, which stays JSON; every other one is exported as tested
        tested = {k[len(prefix) :]: v for k, v in result["test"].items() if k.startswith(prefix)}
        assert m == pytest.approx({k: v for k, v in tested.items() if math.isfinite(v)})
        if role == "target":  # the rows where the decoder decides are reported on their own
            assert 0.5 <= m["draft_written/auroc"] <= 1 and 0 <= m["draft_written/mse"] < 0.25
        # values, not only names: each within its valid range (labels are probabilities)
        assert 0 <= m["mse"] <= m["mae"] <= 1 and 0 <= m["auroc"] <= 1 and 0 <= m["ece"] <= 1
        assert -1 <= m["pearson"] <= 1
        assert m["r2"] <= 1 and m["mse"] < 0.25  # a constant 0.5 scores 0.25 at worst
        assert cfg["sampling"] == {"temperature": 0.6, "top_p": 0.95} and cfg["labels"]["n_samples"] == 3  # typed specs
        assert cfg["step"] == {"delimiters": list(DEFAULT_DELIMITERS), "max_step_tokens": 32}  # the decoder reads them
        assert probe.config.step == StepSpec(DEFAULT_DELIMITERS, 32) and cfg["format_version"] == FORMAT_VERSION
        assert cfg["features"]["groups"] == list(probe.config.features.groups)  # what it reads: one nested entry
    assert result["best_ckpt"] and Path(result["best_ckpt"]).is_file()
    rows = list(csv.DictReader(next((root / "runs").rglob("metrics.csv")).open()))
    last = {k: float(v) for row in rows for k, v in row.items() if v not in ("", None)}  # last logged value of each
    for name in ("spec/accuracy", "spec/step_acceptance", "spec/draft_token_share", "val/target/auroc",
                 "val/draft/auroc"):
        assert 0 <= last[name] <= 1, (name, last[name])
    assert last["spec/speedup"] > 0 and last["spec/target_passes_per_100_tokens"] > 0
    assert -1 <= last["spec/accuracy_delta"] <= 1 and 0 <= last["val/mse"] < 0.25
    plots = {p.name for p in (root / "runs").rglob("*.png")}
    assert {"history.png", "reliability.png", "acceptance_vs_ratio.png"} <= plots


@pytest.mark.slow
def test_second_run_reuses_shards(fitted, capsys):
    root, path, _ = fitted
    shards = sorted((root / "data").glob("shard-*.safetensors"))
    stamps = [p.stat().st_mtime_ns for p in shards]
    main(["--config", str(path), "--trainer.max_epochs", "1", "--export", "false", "--test", "false"])
    assert "reusing" in capsys.readouterr().out
    assert [p.stat().st_mtime_ns for p in sorted((root / "data").glob("shard-*.safetensors"))] == stamps


@pytest.mark.slow
def test_ctrl_c_keeps_last_checkpoint_and_resumes(fitted, tmp_path):
    root, path, _ = fitted
    cfg = yaml.safe_load(path.read_text())
    cfg["trainer"]["callbacks"] = [c for c in cfg["trainer"]["callbacks"]
                                   if "SpeculativeValidation" not in c["class_path"]]
    cfg["trainer"]["callbacks"].append({"class_path": "tests.probes.test_fit.InterruptAt", "init_args": {"epoch": 1}})
    cfg["trainer"].update(max_epochs=3, default_root_dir=str(tmp_path))
    cfg["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path)
    cfg["export_dir"] = str(tmp_path / "export")
    p = tmp_path / "interrupt.yaml"
    p.write_text(yaml.safe_dump(cfg))
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):
            main(["--config", str(p)])
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT after a graceful shutdown
    last = next(tmp_path.rglob("last.ckpt"))
    # epoch 0 finished, epoch 1 interrupted
    assert torch.load(last, map_location="cpu", weights_only=False)["epoch"] == 0
    saved = last.parent.parent / "config.yaml"  # resuming reads the run's own config: drop the test's interrupter there
    run_cfg = yaml.safe_load(saved.read_text())
    run_cfg["trainer"]["callbacks"] = [c for c in run_cfg["trainer"]["callbacks"]
                                       if "InterruptAt" not in c["class_path"]]
    saved.write_text(yaml.safe_dump(run_cfg))
    result = main(["--config", str(saved), "--ckpt_path", str(last)])
    assert set(result["export"]) == {"target", "draft"}
    newest = max(tmp_path.rglob("last.ckpt"), key=lambda p: p.stat().st_mtime_ns)
    assert torch.load(newest, map_location="cpu", weights_only=False)["epoch"] == 2  # resumed and ran epochs 1 and 2


import lightning as L  # noqa: E402


class InterruptAt(L.Callback):
    """Raises KeyboardInterrupt (as Ctrl-C does) at the start of training epoch ``epoch``."""

    def __init__(self, epoch: int = 1):
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            raise KeyboardInterrupt


def test_callback_with_wrong_width_probes_is_refused():
    from callbacks.speculative_validation import SpeculativeValidation
    from probes.config import ProbeConfig
    from probes.module import SemanticProbeModule

    spec = {r: {"hidden_size": 7, "features": FeatureSpec(), "reads": {"hidden_size": 7}} for r in ("target", "draft")}
    module = SemanticProbeModule(ProbeConfig(hidden_dims=[4]), ["target", "draft"], spec)
    callback = SpeculativeValidation(max_problems=1)
    with pytest.raises(ValueError, match="hidden_size: probe has 7, model has"):
        callback.setup(L.Trainer(logger=False), module, "fit")


def test_callback_skips_an_epoch_whose_probes_diverged_with_a_warning():
    # the decoder refuses NaN probes: the fit went on to its own verdict (not exported, exit 1) instead of stopping
    from types import SimpleNamespace

    from callbacks.speculative_validation import SpeculativeValidation
    from probes.config import ProbeConfig
    from probes.module import SemanticProbeModule

    spec = {r: {"hidden_size": 7, "features": FeatureSpec(), "reads": {"hidden_size": 7}} for r in ("target", "draft")}
    module = SemanticProbeModule(ProbeConfig(hidden_dims=[4]), ["target", "draft"], spec)
    with torch.no_grad():
        module.probes["draft"].mlp[0].bias.fill_(float("inf"))
    callback = SpeculativeValidation(max_problems=1)
    trainer = SimpleNamespace(sanity_checking=False, fast_dev_run=False, current_epoch=0, max_epochs=1)
    with pytest.warns(UserWarning, match=r"decoded nothing at epoch 0: the probes hold NaN or infinite values "
                                         r"\(draft: mlp.0.bias\)"):
        callback._run(trainer, module)
    assert callback.history == []


def test_callback_bad_problem_file_fails_before_training(tmp_path):
    from callbacks.speculative_validation import SpeculativeValidation
    from arithmetic_world.task import ArithmeticTask

    bad = tmp_path / "problems.jsonl"
    bad.write_text('{"problem": "Start with 1. Add 2. What is the result?", "answer": 3}\nnot json\n')
    with pytest.raises(ValueError, match=f"{bad}:2"):
        SpeculativeValidation(task=ArithmeticTask(str(bad)))
    with pytest.raises(ValueError, match="max_seconds"):
        SpeculativeValidation(max_seconds=0)
    with pytest.raises(ValueError, match=r"draft_device='cuda:bad' is not a torch device"):
        SpeculativeValidation(draft_device="cuda:bad")


def _narrow_module(sampling=None):
    """A module whose probes read 7-wide states (no world model has them): ``setup`` checks everything before that."""
    from probes.config import ProbeConfig
    from probes.module import SemanticProbeModule

    spec = {r: {"hidden_size": 7, "features": FeatureSpec(), "reads": {"hidden_size": 7}, "sampling": sampling}
            for r in ("target", "draft")}
    return SemanticProbeModule(ProbeConfig(hidden_dims=[4]), ["target", "draft"], spec)


@pytest.mark.parametrize("kwargs, named", [
    # each was taken here and refused after the first epoch's training, some with a traceback naming nothing
    ({"tau": 2.0}, "tau=2.0: expected a number with 0 <= tau <= 1"),
    ({"rule": "foo"}, "rule='foo'"),
    ({"max_new_tokens": 0}, "max_new_tokens=0"),
    ({"temperature": -1.0}, "temperature=-1.0"),
    ({"top_p": 2.0}, "top_p=2.0"),
    ({"batch_size": 1.5}, "batch_size=1.5: expected an integer >= 1"),
    ({"max_problems": "4"}, "max_problems='4': expected an integer >= 1"),
    ({"every_n_epochs": 1.5}, "every_n_epochs=1.5: expected an integer >= 1"),
    ({"max_seconds": float("nan")}, "max_seconds=nan"),
    ({"plots_dir": 123}, "plots_dir=123: expected a folder path"),
    ({"plots_dir": __file__}, f"plots_dir={__file__}: is a file"),
    # transformers' "Repo id must be in the form ..." at setup, and a message naming SEMANTICSPEC_WORLD alone
    ({"target": "/no/such/target", "draft": "org/draft"}, "target='/no/such/target': no such file or folder"),
    ({"world_root": "/no/such/world"}, "world_root='/no/such/world': no such folder"),
    # a bare TypeError from pathlib, and ints taken for Hub ids until setup
    ({"world_root": 5}, "world_root=5: expected a folder path"),
    ({"target": 5, "draft": 6}, "target=5: expected a model folder, pypi:PACKAGE or a Hub id"),
])
def test_callback_refuses_a_bad_argument_when_built(kwargs, named):
    from callbacks.speculative_validation import SpeculativeValidation

    with pytest.raises(ValueError, match="invalid SpeculativeValidation arguments") as e:
        SpeculativeValidation(**kwargs)
    assert named in str(e.value)


def test_callback_refuses_unanswered_problems_and_the_build_s_own_before_training(tmp_path):
    from types import SimpleNamespace

    from arithmetic_world.task import ArithmeticTask
    from callbacks.speculative_validation import SpeculativeValidation
    from datamodules.labels.config import BuildConfig

    records = [{"problem": f"Start with {k}. Add 2. What is the result?", "answer": k + 2} for k in range(4)]
    file = tmp_path / "problems.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in records[:3] + [{**records[3], "answer": ""}]))
    with pytest.raises(ValueError, match=r"problem 3 \('Start with 3.*has no answer to check; 1 of 4 lack one"):
        SpeculativeValidation(task=ArithmeticTask(str(file)))  # its accuracy was 0, silently
    callback = SpeculativeValidation(task=ArithmeticTask(str(file)), max_problems=2)
    build = BuildConfig(task=ArithmeticTask(str(file)), n_problems=3, task_seed=1)
    trainer = SimpleNamespace(datamodule=SimpleNamespace(build=build), is_global_zero=True)
    with pytest.raises(ValueError, match=r"2 of its 2 problems are among the label build's \(3 from task_seed 1\)"):
        callback.setup(trainer, _narrow_module(), "fit")
    callback.setup(trainer, _narrow_module(), "test")  # no validation there: nothing checked, no model loaded
    assert callback._target is None


def test_callback_refuses_another_sampling_than_the_probes_before_training():
    """The docstring's "0 = greedy" was refused by the decoder after the first epoch, with no way to allow it."""
    from callbacks.speculative_validation import SpeculativeValidation
    from generation.specs import SamplingSpec

    module = _narrow_module(SamplingSpec(0.6, 0.95))
    with pytest.raises(ValueError, match="temperature=0.0.*allow_sampling_mismatch=True"):
        SpeculativeValidation(temperature=0.0, max_problems=1).setup(L.Trainer(logger=False), module, "fit")
    with pytest.warns(UserWarning, match="allow_sampling_mismatch=True: temperature"), \
            pytest.raises(ValueError, match="hidden_size: probe has 7"):  # past the sampling, to the models
        SpeculativeValidation(temperature=0.0, max_problems=1, allow_sampling_mismatch=True).setup(
            L.Trainer(logger=False), module, "fit")


def test_callback_plots_that_cannot_be_written_leave_the_fit_to_go_on_and_its_history_is_kept(tmp_path):
    from types import SimpleNamespace

    from callbacks.speculative_validation import SpeculativeValidation

    callback = SpeculativeValidation(max_problems=1, plots_dir=str(tmp_path / "plots"))
    callback.history = [{"epoch": 0, "speedup": 1.5, "accuracy": 1.0, "accuracy_delta": 0.0}]
    (tmp_path / "plots").write_text("made a file since\n")
    trainer = SimpleNamespace(log_dir=None, is_global_zero=True, default_root_dir=str(tmp_path), loggers=[])
    with pytest.warns(UserWarning, match="SpeculativeValidation wrote no plots: .*File exists"):
        callback.on_fit_end(trainer, None)  # raised FileExistsError: no test, no export
    resumed = SpeculativeValidation(max_problems=1)
    resumed.load_state_dict(callback.state_dict())  # a checkpoint's copy: the history plot of a resumed fit
    assert resumed.history == callback.history


def _world_module():
    from generation.specs import TOKEN_STATS
    from arithmetic_world.models import load_model, load_tokenizer
    from probes.config import ProbeConfig
    from generation.fingerprints import model_fingerprint
    from probes.module import SemanticProbeModule

    tok = load_tokenizer()
    spec = {}
    for role in ("target", "draft"):
        fp = model_fingerprint(load_model(role), tok)
        spec[role] = {"hidden_size": fp["hidden_size"], "reads": fp,
                      "features": FeatureSpec(["hidden", "token_stats"], token_stats=TOKEN_STATS)}
    return SemanticProbeModule(ProbeConfig(hidden_dims=[16]), ["target", "draft"], spec)


@pytest.mark.slow
def test_callback_respects_its_time_bound():
    from callbacks.speculative_validation import SpeculativeValidation

    callback = SpeculativeValidation(max_problems=5, batch_size=2, max_seconds=1e-3, max_new_tokens=32)
    module = _world_module()
    callback.setup(L.Trainer(logger=False), module, "fit")
    figures = callback.decode(module)
    assert figures["problems"] == 2  # the first batch always runs; the bound stops the rest
    assert module.training  # train mode restored


@pytest.mark.slow
def test_callback_drives_checkpoint_selection(fitted, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from callbacks.speculative_validation import SpeculativeValidation
    from datamodules.datamodule import SemanticProbeDataModule

    root, _, _ = fitted
    data = SemanticProbeDataModule(str(root / "data"), build=None, batch_size=64, val_fraction=0.25, test_fraction=0.25,
                                   feature_groups=["hidden", "token_stats"])  # the groups _world_module's probes read
    module = _world_module()
    spec = SpeculativeValidation(max_problems=2, max_seconds=20, max_new_tokens=48, temperature=0.6,
                                 plots_dir=str(tmp_path))
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="spec/speedup", mode="max", save_top_k=1)
    trainer = L.Trainer(max_epochs=3, logger=False, enable_progress_bar=False, callbacks=[spec, ckpt],
                        default_root_dir=tmp_path)
    trainer.fit(module, datamodule=data)
    speedups = [h["speedup"] for h in spec.history]
    assert len(speedups) == 3
    assert float(ckpt.best_model_score) == pytest.approx(max(speedups))
    assert f"epoch={speedups.index(max(speedups))}" in ckpt.best_model_path


@pytest.mark.slow
def test_default_job_on_a_fresh_clone_leaves_git_status_empty(tmp_path):
    """The README's `python -m probes.fit` (made smaller by overrides only) writes nothing over tracked files."""
    import shutil
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, check=True).stdout.decode().split("\0")
    clone = tmp_path / "clone"
    for name in filter(None, listed):
        if (root / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, clone / name)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "fresh clone"]):
        subprocess.run(git + cmd, cwd=clone, check=True, capture_output=True)
    smaller = ["--trainer.max_epochs", "1", "--data.build.n_problems", "12", "--data.build.sampling.n_samples", "3",
               "--data.build.shard_size", "8", "--data.val_fraction", "0.25", "--data.test_fraction", "0.25",
               "--model.probe.hidden_dims", "[16]", "--trainer.enable_progress_bar", "false"]
    run = subprocess.run([sys.executable, "-m", "probes.fit", *smaller], cwd=clone, capture_output=True, text=True,
                         timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(clone)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "exported target probe: runs/arithmetic/fit/version_0/export/target" in run.stdout
    status = subprocess.run(["git", "status", "--short"], cwd=clone, capture_output=True, text=True, check=True).stdout
    assert status == "", status


# -- resume, Ctrl-C, no validation split, one-line errors, -c, --key=value, short --help ---------------


def _tiny_config(root: Path, **data) -> Path:
    """The default config on synthetic shards (``make_dataset``): no build, no live decoding, seconds."""
    from tests.conftest import make_dataset

    if not (root / "d").is_dir():
        make_dataset(root / "d")
    cfg = yaml.safe_load(DEFAULT_CONFIG.read_text())
    cfg["trainer"].update(max_epochs=3, default_root_dir=str(root / "runs"), enable_progress_bar=False,
                          log_every_n_steps=1)  # 2 batches an epoch: Lightning warns about a longer interval
    cfg["trainer"]["logger"]["init_args"]["save_dir"] = str(root / "runs")
    cfg["trainer"]["callbacks"] = [c for c in cfg["trainer"]["callbacks"] if "Speculative" not in c["class_path"]]
    cfg["data"].update({"data_dir": str(root / "d"), "build": None, "val_fraction": 0.4, "test_fraction": 0.2, **data})
    cfg["model"]["probe"]["hidden_dims"] = [8]
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_lightnings_checks_once_the_data_is_there_and_a_run_too_short_to_validate_are_one_line(tmp_path, capsys):
    """Each was a traceback with status 1: Lightning checks these after the fit starts, and a run shorter than an
    epoch ended in EarlyStopping's RuntimeError, its training lost; a time interval crashed our own check."""
    cfg = str(_tiny_config(tmp_path))  # 2 batches an epoch
    line = _one_line_error(capsys, ["--config", cfg, "--trainer.val_check_interval", "5"])
    assert "`val_check_interval` (5) must be less than or equal to the number of the training batches (2)" in line
    assert not (tmp_path / "runs" / "fit").exists()  # its config.yaml and hparams.yaml went with it
    line = _one_line_error(capsys, ["--config", cfg, "--trainer.val_check_interval", "00:00:00:02",
                                    "--trainer.check_val_every_n_epoch", "null"])
    assert "--trainer.val_check_interval 00:00:00:02: a time between validations breaks Lightning" in line
    with pytest.raises(SystemExit) as exit_, pytest.warns(UserWarning, match="smaller than the logging interval"):
        main(["--config", cfg, "--trainer.max_steps", "1", "--trainer.log_every_n_steps", "5"])  # no metrics.csv
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert "error: EarlyStopping's metric `val/target/draft_written/mse` had no value: the run ended before" in err
    assert not (tmp_path / "runs" / "fit").exists()  # a version_0 holding nothing was left: the next was version_1


def test_weights_that_diverged_are_not_exported_and_the_run_fails(tmp_path, capsys, monkeypatch):
    """A 16-true fit's Adam turned every weight NaN; the run exported them (which load_probe refuses) with status 0."""
    from types import SimpleNamespace

    import probes.fit as fit_module
    from probes.config import ProbeConfig
    from probes.module import SemanticProbeModule

    spec = {r: {"hidden_size": 7, "features": FeatureSpec(), "reads": {"hidden_size": 7}} for r in ("target", "draft")}
    module = SemanticProbeModule(ProbeConfig(hidden_dims=[4]), ["target", "draft"], spec)
    trainer = SimpleNamespace(precision="16-true")
    assert fit_module._diverged(module, trainer) is None
    with torch.no_grad():
        module.probes["draft"].mlp[0].bias.fill_(float("nan"))
    assert fit_module._diverged(module, trainer).startswith(
        "the weights hold NaN or infinite values (draft: mlp.0.bias): the training diverged (--trainer.precision "
        "16-true; in 16-true Adam's updates overflow float16: use 16-mixed)")
    monkeypatch.setattr(fit_module, "_diverged", lambda module, trainer: "diverged, say")
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(_tiny_config(tmp_path)), "--export_dir", str(tmp_path / "export")])
    assert exit_.value.code == 1 and "not exported: diverged, say" in capsys.readouterr().out
    assert not (tmp_path / "export").exists()
    with pytest.raises(SystemExit) as exit_:  # not asked to export: it failed with status 1 and said nothing
        main(["--config", str(_tiny_config(tmp_path)), "--export", "false"])
    assert exit_.value.code == 1 and "failed: diverged, say" in capsys.readouterr().out


def test_a_bf16_linear_probe_exports_in_float32_with_a_card_that_says_linear_and_a_named_logger_stays_in_root(
        tmp_path, capsys):
    """A bf16-true fit exported BF16 weights (an export is float32, load_probe says), a linear probe's card said
    "MLP ..., ReLU, dropout 0.3", and --trainer.logger.name sent the run to ./runs instead of the root given."""
    from safetensors import safe_open

    root = tmp_path / "root"
    main(["--config", str(_tiny_config(tmp_path)), "--trainer.max_epochs", "1", "--trainer.precision", "bf16-true",
          "--model.probe.hidden_dims", "[]", "--trainer.default_root_dir", str(root), "--trainer.logger.name", "exp1",
          "--export_dir", str(tmp_path / "export")])
    assert (root / "exp1" / "version_0" / "checkpoints").is_dir()
    with safe_open(str(tmp_path / "export" / "target" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    card = (tmp_path / "export" / "target" / "README.md").read_text()
    assert "| network | linear " in card and "ReLU" not in card
    # how it was trained: nothing said a `loss` test metric was BCE's or MSE's
    config = json.loads((tmp_path / "export" / "target" / "config.json").read_text())
    assert config["training"] == {"loss": "mse", "optimizer": "torch.optim.adam.Adam", "lr": pytest.approx(1e-4),
                                  "epochs": 1, "best_epoch": 1, "precision": "bf16-true"}
    assert "## Training" in card and "| precision | `bf16-true` |" in card


@pytest.mark.parametrize("split", [{}, {"val_fraction": 0.0}], ids=["validated", "no_validation_rows"])
def test_ctrl_c_prints_what_was_kept_and_the_resume_command_that_continues_the_run(tmp_path, capsys, split):
    """Ctrl-C keeps the latest epoch (Lightning's save_last kept only the last improving one, so a resume redid
    epochs), and the resumed run continues the run: the same losses, and the same best checkpoint tested and exported
    (Lightning dropped the best score when a resumed run saved into its new folder, so its first epoch was "best").
    Without validation rows the checkpoints watch the training loss, under which their state was saved: the resume
    looked it up under the ``val/`` key and lost the run's folder again."""
    cfg = _tiny_config(tmp_path, **split)
    handler = signal.getsignal(signal.SIGINT)
    interrupt = '[{"class_path": "tests.probes.test_fit.InterruptAt", "init_args": {"epoch": 3}}]'
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(cfg), "--trainer.max_epochs", "5", "--trainer.callbacks+", interrupt])
    assert exit_.value.code == 130 and signal.getsignal(signal.SIGINT) == handler  # SIGINT is not left ignored
    run = tmp_path / "runs" / "fit" / "version_0"
    last = run / "checkpoints" / "last.ckpt"
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("python -m probes.fit: interrupted")]
    expected = (f"python -m probes.fit: interrupted; kept {last} (after epoch 3). "
                f"Resume with: python -m probes.fit --config {run / 'config.yaml'} --ckpt_path {last}")
    assert said == [expected], err
    # the command it printed: the run's own config (max_epochs 5, not the default 12)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["trainer"]["callbacks"] = config["trainer"]["callbacks"][:-1]  # (this test's interrupter, not the user's)
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    result = main(["--config", str(run / "config.yaml"), "--ckpt_path", str(last), "--test", "false",
                   "--export", "false"])
    resumed = tmp_path / "runs" / "fit" / "version_1"  # Lightning's way: the resumed run logs in a folder of its own
    rows = [list(csv.DictReader((d / "metrics.csv").open())) for d in (run, resumed)]
    assert max(int(r["step"]) for r in rows[1]) == 5 * 2 - 1  # 5 epochs of 2 batches, continued from epoch 3
    epochs = [{int(float(r["epoch"])) for r in rs if r.get("epoch")} for rs in rows]
    assert epochs == [{0, 1, 2}, {3, 4}], epochs  # each run's own history
    whole = main(["--config", str(cfg), "--trainer.max_epochs", "5", "--test", "false", "--export", "false"])
    rows.append(list(csv.DictReader((tmp_path / "runs" / "fit" / "version_2" / "metrics.csv").open())))

    def losses(rs):  # the training loss at each step
        return {r["step"]: r["train/loss_step"] for r in rs if r.get("train/loss_step")}
    assert losses(rows[1]) == {k: v for k, v in losses(rows[2]).items() if int(k) >= 6}  # resumed: as uninterrupted
    # the run's checkpoints stay in its folder, and its best is the uninterrupted run's (same epoch, same score)
    assert result["best_ckpt"].startswith(str(run / "checkpoints"))
    assert Path(result["best_ckpt"]).name == Path(whole["best_ckpt"]).name, (result["best_ckpt"], whole["best_ckpt"])


def test_ctrl_c_while_the_data_is_prepared_says_the_build_keeps_its_shards(tmp_path, capsys, monkeypatch):
    """It said "nothing kept to resume from", though the label build keeps every shard it finished."""
    from datamodules.datamodule import SemanticProbeDataModule

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(SemanticProbeDataModule, "prepare_data", interrupted)
    assert _interrupted_line(capsys, ["--config", str(_tiny_config(tmp_path))]) == (
        "python -m probes.fit: interrupted while preparing the data; the label build keeps the shards it finished. "
        "Rerun the command to go on from them.")


def test_ctrl_c_in_a_run_that_saves_no_checkpoints_says_so(tmp_path, capsys):
    """It said "interrupted in epoch 2 before a checkpoint was saved", as if one would have been."""
    interrupt = '[{"class_path": "tests.probes.test_fit.InterruptAt", "init_args": {"epoch": 1}}]'
    assert _interrupted_line(capsys, ["--config", str(_tiny_config(tmp_path)), "--trainer.enable_checkpointing",
                                      "false", "--trainer.callbacks", interrupt]) == (
        "python -m probes.fit: interrupted in epoch 2; this run saves no checkpoints (--trainer.enable_checkpointing "
        "false), so nothing is kept to resume from.")


def _interrupted_line(capsys, args) -> str:
    """Run main(args), which is interrupted (Ctrl-C), expect exit 130 and return the one line that says so."""
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as exit_:
            main(args)
    finally:
        signal.signal(signal.SIGINT, handler)
    said = [line for line in capsys.readouterr().err.splitlines() if "interrupted" in line]
    assert exit_.value.code == 130 and len(said) == 1, said
    return said[0]


def test_a_run_without_validation_split_monitors_the_train_loss(tmp_path, capsys, recwarn):
    cfg = _tiny_config(tmp_path, val_fraction=0.0)
    result = main(["--config", str(cfg), "--trainer.max_epochs", "2", "--export", "false"])
    # the test is given the best checkpoint's path: "best" made Lightning warn about the configs' two ModelCheckpoints
    assert not [w for w in recwarn if "multiple `ModelCheckpoint`" in str(w.message)]
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("no validation rows")]
    assert len(said) == 1 and "monitor train/loss_epoch instead" in said[0] and "EarlyStopping" in said[0]
    assert "train_loss" in Path(result["best_ckpt"]).name and result["test"]["test/target/mse"] >= 0


def test_max_epochs_minus_one_means_no_limit(tmp_path):
    cfg = _tiny_config(tmp_path)
    main(["--config", str(cfg), "--trainer.max_epochs", "-1", "--trainer.max_steps", "4", "--test", "false",
          "--export", "false"])
    rows = list(csv.DictReader((tmp_path / "runs" / "fit" / "version_0" / "metrics.csv").open()))
    assert max(int(r["step"]) for r in rows) == 3 and {int(float(r["epoch"])) for r in rows} == {0, 1}  # 2 epochs


def test_short_c_is_the_same_as_config(tmp_path, capsys):
    own = tmp_path / "own.yaml"  # no callbacks: with -c, arithmetic.yaml's stayed underneath
    cfg = yaml.safe_load(DEFAULT_CONFIG.read_text())
    cfg["trainer"]["callbacks"] = []
    cfg["trainer"]["max_epochs"] = 3
    own.write_text(yaml.safe_dump(cfg))
    printed = []
    for args in (["--config", str(own)], ["-c", str(own)], [f"--config={own}"], [f"-c={own}"]):
        with pytest.raises(SystemExit):
            main(args + ["--print_config"])
        printed.append(yaml.safe_load(capsys.readouterr().out))
    assert all(p == printed[0] for p in printed) and printed[0]["trainer"]["callbacks"] in ([], None)


def test_errors_are_one_line_yaml_names_the_file_and_typos_get_a_suggestion(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_epochs: 3\n   devices: [1\n")
    line = _one_line_error(capsys, ["--config", str(bad)])
    assert f"{bad}: invalid YAML at line 3" in line and "unicode string" not in line
    bad.write_bytes(b"\xff\xfetrainer: {}\n")  # jsonargparse's "'utf-8' codec can't decode", naming no file
    assert f"--config {bad}: not UTF-8 text" in _one_line_error(capsys, [f"--config={bad}"])
    line = _one_line_error(capsys, ["--trainer.max_epochz", "3"])
    assert "did you mean --trainer.max_epochs?" in line
    line = _one_line_error(capsys, ["--trainer.max_epochs", "-2", "--trainer.logger", "false"])
    assert "or -1 for no limit" in line
    for key, text in (("batch_sise", "data:\n  batch_sise: 64\n"),
                      ("n_sampels", "data:\n  build:\n    sampling:\n      n_sampels: 3\n")):
        bad.write_text(text)  # keys of a --config file: the real parser names them
        assert key in _one_line_error(capsys, ["--config", str(DEFAULT_CONFIG), "--config", str(bad)])


def test_short_help_names_real_options_and_help_all_lists_every_one(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    short = capsys.readouterr().out
    assert len(short.splitlines()) < 30 and "--help_all" in short
    with pytest.raises(SystemExit):
        main(["--help", "full"])
    full = capsys.readouterr().out
    assert len(full.splitlines()) > 300
    named = {w.strip(",:") for w in short.split() if w.startswith("--")} - {"--help", "--help_all"}
    assert len(named) >= 9 and not {w for w in named if w not in full}


def test_help_all_prints_where_no_default_config_is_and_keeps_a_given_config(capsys, monkeypatch, tmp_path):
    """Installed from a wheel the package has no configs/: ``--help_all`` still prints every option (it read the
    missing default config and failed, even with ``--config`` given, which it dropped)."""
    import probes.fit as F

    monkeypatch.setattr(F, "DEFAULT_CONFIG", tmp_path / "configs" / "arithmetic.yaml")
    for args in (["--help_all"], ["--help", "full"], ["--config", str(_tiny_config(tmp_path)), "--help_all"]):
        with pytest.raises(SystemExit) as exit_:
            main(args)
        assert exit_.value.code == 0, args
        assert len(capsys.readouterr().out.splitlines()) > 300, args


def test_a_normal_run_shows_no_noise(tmp_path, capsys, caplog, recwarn):
    cfg = _tiny_config(tmp_path)
    main(["--config", str(cfg), "--trainer.max_epochs", "1", "--export", "false"])
    out, err = capsys.readouterr()
    text = out + err + caplog.text + " ".join(str(w.message) for w in recwarn)
    for noise in ("litlogger", "IterableDataset` has `__len__`", "Seed set to",
                  "Skipping setting a default", "LeafSpec"):
        assert noise not in text, noise
    assert out.count("reusing 4 shards") == 1 and "| target (draft-written) |" in out  # the closing table stays


# -- refusals before torch loads, --ckpt_path, data_dir a file, YAML typos ---------------------------

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # 10 s on 2 cores (fresh processes): in CI's slow set, out of the README's 5-minute command
def test_mistyped_options_are_refused_in_one_line_before_torch_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SEMANTICSPEC_CACHE", str(tmp_path / "cache"))
    typo = tmp_path / "typo.yaml"
    typo.write_text("data:\n  build:\n    n_problem: 3\n")
    status, err, heavy = refuse_in_a_fresh_process("probes.fit", ["--trainer.max_epochz", "3"])
    assert status == 2 and len(err) == 1 and "--trainer.max_epochz" in err[0]  # no names kept yet: the real parser
    with pytest.raises(SystemExit):
        main(["--print_config"])  # the real parser keeps its option names for the next first pass
    capsys.readouterr()
    cases = [
        (["--trainer.max_epochz", "3"],
         "unrecognized arguments: --trainer.max_epochz 3; did you mean --trainer.max_epochs?"),
        (["--trainer.max_epochz=3"], "unrecognized arguments: --trainer.max_epochz 3"),
        (["--data.build.sampling.n_sampels", "3"], "did you mean --data.build.sampling.n_samples?"),
        (["--trainer.logger.init_args.save_dir", "x", "--model.probe.hidden_dimz", "[4]"],
         "did you mean --model.probe.hidden_dims?"),  # under a class chosen at parse time, anything goes
        (["--config", str(typo)], "unknown key 'data.build.n_problem'; did you mean --data.build.n_problems?"),
    ]
    for args, said in cases:  # one line, exit 2, and torch never imported
        status, err, heavy = refuse_in_a_fresh_process("probes.fit", args)
        assert status == 2 and len(err) == 1 and said in err[0] and heavy == [], (args, err, heavy)
    status, _, heavy = refuse_in_a_fresh_process("probes.fit", ["--help"])
    assert status == 0 and heavy == []


def test_the_first_pass_knows_every_option_the_real_parser_knows(tmp_path, monkeypatch, capsys):
    from probes.fit_args import first_pass, is_known, options_cache

    monkeypatch.setenv("SEMANTICSPEC_CACHE", str(tmp_path))
    with pytest.raises(SystemExit):
        main(["--print_config"])
    known = set(json.loads(options_cache().read_text()))
    assert {"--trainer.max_epochs", "--data.build.sampling.n_samples", "--ckpt_path", "--model.probe.hidden_dims",
            "--trainer.callbacks"} <= known
    assert is_known("--trainer.logger.init_args.name", known) and not is_known("--trainer.max_epochz", known)
    for config in sorted((ROOT / "configs").glob("*.yaml")):  # every key of the shipped configs is known
        first_pass(["--config", str(config)])
    capsys.readouterr()
    typo = tmp_path / "typo.yaml"  # a nested key was refused only by the real parser, after torch loaded
    typo.write_text("data:\n  build:\n    n_problem: 3\n    task:\n      class_path: x.Y\n      init_args: {a: 1}\n")
    with pytest.raises(SystemExit) as e:
        first_pass(["--config", str(typo)])
    assert e.value.code == 2 and (f"--config {typo}: unknown key 'data.build.n_problem'; did you mean "
                                  "--data.build.n_problems?") in capsys.readouterr().err
    monkeypatch.setattr("probes.fit_args.version", lambda name: "0.0.0")  # another Lightning: other names
    assert not options_cache().is_file()


def test_a_checkout_keeps_its_option_names_beside_another_checkouts(tmp_path, monkeypatch):
    """Each checkout's first full parse deleted every other ``fit-options-*.json``, another live checkout's (or
    environment's) too, which then lost its sub-second refusal of a mistyped option until its next full parse."""
    from probes.fit_args import options_cache

    monkeypatch.setenv("SEMANTICSPEC_CACHE", str(tmp_path))
    other = tmp_path / f"fit-options-00000000-{'0' * 16}.json"  # another checkout's
    mine_before = options_cache().with_name(options_cache().name.rsplit("-", 1)[0] + f"-{'1' * 16}.json")
    for path in (other, mine_before):
        path.write_text("[]")
    with pytest.raises(SystemExit):
        main(["--print_config"])
    assert options_cache().is_file() and other.is_file() and not mine_before.is_file()


def test_a_bad_checkpoint_is_refused_before_data_preparation_and_leaves_no_run_folder(tmp_path, capsys):
    cfg = _tiny_config(tmp_path)
    bad = tmp_path / "notes.txt"
    bad.write_text("hello\n")
    torch.save({"state_dict": {}}, tmp_path / "plain.ckpt")
    for ckpt, said in ((bad, "is not a Lightning checkpoint (not a torch.save archive)"),
                       (tmp_path / "missing.ckpt", "No such file"), (tmp_path, "Is a directory"),
                       (tmp_path / "plain.ckpt", "is a torch.save archive but not a Lightning checkpoint")):
        line = _one_line_error(capsys, ["--config", str(cfg), "--ckpt_path", str(ckpt)])
        assert f"--ckpt_path {ckpt}" in line and said in line
    assert not (tmp_path / "runs").exists()  # no version_N/ holding only config.yaml


def test_lightnings_word_last_is_refused_naming_the_newest_last_ckpt(tmp_path, capsys):
    """``--ckpt_path last`` was refused as a missing file: Lightning would look in the new version folder."""
    args = ["--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path)]
    assert "there is none under" in _one_line_error(capsys, ["--ckpt_path", "last", *args])
    for n in (0, 1):
        last = tmp_path / "fit" / f"version_{n}" / "checkpoints" / "last.ckpt"
        last.parent.mkdir(parents=True)
        last.write_bytes(b"")
        os.utime(last, (n, n))
    line = _one_line_error(capsys, ["--ckpt_path", "last", *args])
    assert "--ckpt_path last: Lightning looks for 'last' in the run it starts" in line
    assert line.endswith(f"the newest under {tmp_path} is {last} (see `python -m probes.fit --help`)")


def test_a_value_refused_once_the_trainer_exists_leaves_no_empty_logger_folder(tmp_path, capsys):
    cfg = _tiny_config(tmp_path)
    assert "Invalid learning rate" in _one_line_error(capsys, ["--config", str(cfg), "--model.optimizer.init_args.lr",
                                                               "-1"])
    assert not (tmp_path / "runs" / "fit").exists()  # neither version_0/ nor the fit/ above it


def test_an_optimizer_value_is_refused_before_the_data_is_built(tmp_path, capsys):
    """torch's optimizer refused ``lr=-1`` only when the fit configured it, after minutes of label building."""
    line = _one_line_error(capsys, ["--data.data_dir", str(tmp_path / "data"), "--trainer.default_root_dir",
                                    str(tmp_path / "runs"), "--model.optimizer.init_args.lr", "-1"])
    assert "--model.optimizer: Invalid learning rate: -1" in line
    assert not (tmp_path / "data").exists()  # nothing built


def test_a_checkpoint_of_another_model_is_one_line_and_leaves_no_run_folder(tmp_path, capsys):
    cfg = _tiny_config(tmp_path)
    main(["--config", str(cfg), "--trainer.max_epochs", "1", "--test", "false", "--export", "false"])
    other = tmp_path / "elsewhere.ckpt"  # outside its run folder: the config given is used, with other widths
    (tmp_path / "runs" / "fit" / "version_0" / "checkpoints" / "last.ckpt").rename(other)
    capsys.readouterr()
    args = ["--config", str(cfg), "--model.probe.hidden_dims", "[4]", "--ckpt_path", str(other)]
    line = _one_line_error(capsys, args)  # its hyperparameters record the options it trained with
    assert "differ from those the checkpoint records (its run's config.yaml is not beside it): " \
           "model.probe.hidden_dims: [8] -> [4]; resume with" in line, line
    checkpoint = torch.load(other, weights_only=False)  # one made otherwise (in Python) records none
    checkpoint["hyper_parameters"].pop("_instantiator")
    torch.save(checkpoint, other)
    assert "Error(s) in loading state_dict" in _one_line_error(capsys, args)
    assert sorted(p.name for p in (tmp_path / "runs" / "fit").iterdir()) == ["version_0"]


@pytest.mark.parametrize("debug", [["--trainer.limit_train_batches", "0"], ["--trainer.fast_dev_run", "true"]],
                         ids=["no-batch", "fast_dev_run"])
def test_a_fit_that_trained_nothing_or_a_debugging_run_exports_nothing_and_says_so(tmp_path, capsys, debug):
    """Untrained probes, or a debugging run's, must not land over an export a decoder reads (fast_dev_run's went to
    <default_root_dir>/export, the same folder every such run)."""
    cfg = _tiny_config(tmp_path)
    result = main(["--config", str(cfg), "--test", "false", *debug])
    assert result["export"] == {} and not list(tmp_path.rglob("model.safetensors"))
    assert "not exported: " in capsys.readouterr().out
    assert not list(tmp_path.rglob("*.ckpt"))  # fast_dev_run's last.ckpt landed in <default_root_dir>/checkpoints


def test_default_root_dir_alone_moves_the_whole_run(tmp_path):
    """The configs set the logger's save_dir to the same root: ``--trainer.default_root_dir`` alone moved the
    checkpoints but left the run folder, its metrics and the default export under the config's root."""
    cfg = _tiny_config(tmp_path)
    result = main(["--config", str(cfg), "--trainer.max_epochs", "1", "--test", "false",
                   "--trainer.default_root_dir", str(tmp_path / "elsewhere")])
    assert (tmp_path / "elsewhere" / "fit" / "version_0" / "metrics.csv").is_file()
    assert not (tmp_path / "runs").exists()
    assert all(Path(p).is_relative_to(tmp_path / "elsewhere") for p in result["export"].values())


@pytest.mark.slow  # two fits and eleven refusals: 6.5 s
def test_a_resume_with_another_optimizer_or_a_damaged_checkpoint_and_a_bad_seed_are_one_line(tmp_path, capsys):
    """Lightning restores the optimizer's state from the checkpoint, learning rate included, so a resume with another
    optimizer would record options it does not use: refused, naming them. A checkpoint whose weights fail their
    checksum is refused before training on them. A seed numpy cannot take is one line; ``true`` is a random one."""
    import zipfile

    cfg = _tiny_config(tmp_path)
    main(["--config", str(cfg), "--trainer.max_epochs", "1", "--test", "false", "--export", "false",
          "--seed_everything", "true"])
    run = tmp_path / "runs" / "fit" / "version_0"
    seed = yaml.safe_load((run / "config.yaml").read_text())["seed_everything"]
    assert type(seed) is int and 0 <= seed < 2**32  # recorded, so the run repeats (true was seed 0 before)
    last, saved = run / "checkpoints" / "last.ckpt", str(run / "config.yaml")
    capsys.readouterr()
    line = _one_line_error(capsys, ["--config", saved, "--ckpt_path", str(last), "--model.optimizer.init_args.lr",
                                    "0.5"])
    assert "model.optimizer differs from that run's" in line and "lr: 0.0001 -> 0.5" in line
    for option, value, said in (("--model.loss", "bce", "model.loss: 'mse' -> 'bce'"),
                                ("--data.batch_size", "3", "data.batch_size: 128 -> 3"),
                                ("--model.probe.dropout", "0.1", "model.probe.dropout: 0.3 -> 0.1")):
        line = _one_line_error(capsys, ["--config", saved, "--ckpt_path", str(last), option, value])
        assert f"options it trained with differ from that run's ({saved}): {said}; resume with" in line, line
    copied = tmp_path / "copied.ckpt"  # out of its run folder: nothing was compared
    copied.write_bytes(last.read_bytes())
    line = _one_line_error(capsys, ["--config", saved, "--ckpt_path", str(copied), "--data.batch_size", "3"])
    assert ("differ from those the checkpoint records (its run's config.yaml is not beside it): data.batch_size: "
            "128 -> 3; resume with" in line), line
    line = _one_line_error(capsys, ["--config", saved, "--ckpt_path", str(copied), "--model.probe.dropout", "0.1"])
    assert "model.probe.dropout: 0.3 -> 0.1; resume with" in line, line
    main(["--config", saved, "--ckpt_path", str(copied), "--trainer.max_epochs", "2", "--test", "false", "--export",
          "false"])  # the trainer's may change: one more epoch (and the options the copy records are the run's)
    damaged = tmp_path / "damaged.ckpt"
    with zipfile.ZipFile(last) as z:
        weights = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(last.read_bytes())
    name_len, extra_len = int.from_bytes(raw[weights.header_offset + 26:][:2], "little"), \
        int.from_bytes(raw[weights.header_offset + 28:][:2], "little")  # the local header's, not the directory's
    at = weights.header_offset + 30 + name_len + extra_len + 8
    raw[at:at + 16] = bytes(b ^ 0xFF for b in raw[at:at + 16])
    damaged.write_bytes(raw)
    line = _one_line_error(capsys, ["--config", saved, "--ckpt_path", str(damaged)])
    assert f"{weights.filename} fails its checksum" in line
    for bad in ("-5", "99999999999"):
        assert f"--seed_everything {bad}: {bad} is not in bounds" in _one_line_error(
            capsys, ["--config", str(cfg), "--seed_everything", bad])


@pytest.mark.slow  # over 8 s on 2 cores: in CI's slow set, out of the README's 5-minute command
def test_a_data_dir_that_is_a_file_is_named_as_such_without_lightning_lines(tmp_path, capsys):
    cfg = _tiny_config(tmp_path)
    line = _one_line_error(capsys, ["--config", str(cfg), "--data.data_dir", str(cfg)])
    assert f"data_dir {cfg} is a file, not a folder" in line
    # in a process of its own, where Lightning's log lines reach stderr: none before the refusal
    status, err, _ = refuse_in_a_fresh_process("probes.fit", ["--config", str(cfg), "--data.data_dir", str(cfg)])
    assert status == 2 and err == [line], err


def test_the_model_summary_counts_each_probes_sizes_and_flops():
    """The fit's model summary runs both probes on an example row: their in/out sizes and FLOPs, not zeros."""
    from lightning.pytorch.utilities.model_summary import ModelSummary

    from probes.config import ProbeConfig
    from probes.module import SemanticProbeModule

    spec = {r: {"hidden_size": h, "features": FeatureSpec()} for r, h in (("target", 8), ("draft", 6))}
    module = SemanticProbeModule(ProbeConfig(hidden_dims=[4]), ["target", "draft"], spec)
    out = module(**module.example_input_array)
    assert {r: tuple(q.shape) for r, q in out.items()} == {"target": (1,), "draft": (1,)}
    summary = ModelSummary(module, max_depth=2)
    widths = {r: module.probe_configs[r].input_size for r in ("target", "draft")}
    assert summary.total_flops > 0
    assert summary.in_sizes[summary.layer_names.index("probes.target")] == [1, widths["target"]]
    assert summary.in_sizes[summary.layer_names.index("probes.draft")] == [1, widths["draft"]]


def test_a_probe_field_the_data_fills_is_refused_not_ignored(tmp_path, capsys):
    """``model.probe.features`` (and the other fields the fit fills per role from the data) would be replaced by the
    data's; a value given there is refused in one line that says where to set it."""
    cfg = _tiny_config(tmp_path)
    line = _one_line_error(capsys, ["--config", str(cfg), "--model.probe.features.layer_ids", "[-2]"])
    assert "model.probe.features=" in line and "set data.feature_groups and data.build.layer_ids" in line
    line = _one_line_error(capsys, ["--config", str(cfg), "--model.probe.role", "draft"])
    assert "model.probe.role='draft': filled per role from the data; set model.roles" in line
    line = _one_line_error(capsys, ["--config", str(cfg), "--model.probe.features_dtype", "bfloat16"])  # no effect
    assert "model.probe.features_dtype='bfloat16': filled per role from the data; set by the label build, which " \
           "stores pooled hidden states in float16" in line
    assert not (tmp_path / "runs").exists()


def test_a_run_without_a_test_split_runs_no_test_and_says_so(tmp_path, capsys):
    # it ran a test on an empty loader and printed a results table with a header and no rows
    from safetensors.torch import load_file

    cfg = _tiny_config(tmp_path, test_fraction=0.0)
    config = yaml.safe_load(cfg.read_text())  # the "best" epoch is the first (ModelCheckpoint can watch "epoch")
    next(c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("ModelCheckpoint"))["init_args"].update(
        monitor="epoch", mode="min")
    cfg.write_text(yaml.safe_dump(config))
    result = main(["--config", str(cfg), "--trainer.max_epochs", "3", "--export_dir", str(tmp_path / "export")])
    assert Path(result["best_ckpt"]).name.startswith("epoch0")
    out = capsys.readouterr().out
    assert result["test"] == {} and "no test metrics: the run had no test split" in out
    # the best checkpoint's weights are exported (the test used to load them; without one, the last were)
    best = torch.load(result["best_ckpt"], map_location="cpu", weights_only=False)["state_dict"]
    exported = load_file(str(tmp_path / "export" / "target" / "model.safetensors"))
    assert all(torch.equal(v, best[f"probes.target.{k}"]) for k, v in exported.items() if f"probes.target.{k}" in best)
    assert any(f"probes.target.{k}" in best for k in exported)


def test_live_validation_plots_a_fit_that_validated_nothing_without_a_warning(tmp_path):
    """A fit without validation batches decodes at its training epochs' ends; its reliability plot, with nothing to
    show, warned from matplotlib about an empty legend."""
    import warnings
    from types import SimpleNamespace

    from callbacks.speculative_validation import SpeculativeValidation

    cb = SpeculativeValidation(plots_dir=str(tmp_path))
    cb.history = [{"epoch": 0, "speedup": 2.0, "accuracy": 0.9, "accuracy_delta": 0.1}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = cb.write_plots(SimpleNamespace(loggers=[], global_step=0), str(tmp_path))
    assert all(path.is_file() for path in paths.values()) and len(paths) == 3


def test_live_validation_runs_at_the_last_epoch_whatever_its_period():
    """``every_n_epochs=2`` with one epoch decoded never: its docstring promised the end of the fit too."""
    from types import SimpleNamespace

    from callbacks.speculative_validation import SpeculativeValidation

    cb = SpeculativeValidation(every_n_epochs=2)
    cb.decode = lambda module: {"speedup": 2.0}
    logged = []
    module = SimpleNamespace(probes={}, log=lambda name, value, **kw: logged.append((name, value)))
    for epoch, max_epochs, runs in ((0, 3, False), (1, 3, True), (2, 3, True), (0, 1, True), (0, None, False),
                                    (0, -1, False), (1, -1, True)):  # -1: no limit, so no last epoch
        for fast_dev_run in (0, 1):  # a check of the code decodes nothing
            trainer = SimpleNamespace(sanity_checking=False, current_epoch=epoch, max_epochs=max_epochs,
                                      fast_dev_run=fast_dev_run, is_global_zero=True,
                                      strategy=SimpleNamespace(broadcast=lambda x, src: x))
            logged.clear()
            cb.on_validation_epoch_end(trainer, module)
            assert (logged == [("spec/speedup", 2.0)]) == (runs and not fast_dev_run), (epoch, max_epochs)
            # a fit that validates nothing decoded nothing, without a word; nor did one whose validation split is
            # empty (Lightning skips its loop, with enable_validation still True)
            for validates, batches in ((True, [4]), (True, [0]), (False, [])):
                logged.clear()
                cb.on_train_epoch_end(SimpleNamespace(**vars(trainer), enable_validation=validates,
                                                      num_val_batches=batches, check_val_every_n_epoch=1), module)
                assert (logged == [("spec/speedup", 2.0)]) == (runs and not fast_dev_run and not any(batches))


def test_a_learning_rate_scheduler_is_stepped_recorded_on_the_card_and_checked_before_the_data(tmp_path, capsys,
                                                                                                 caplog):
    """The module took no scheduler: a fit's learning rate was constant, whatever the user's Lightning habits. A
    refused optimizer or scheduler is the only line (the Trainer's "GPU available" lines came before it)."""
    from functools import partial

    from lightning.pytorch.cli import ReduceLROnPlateau

    from probes.config import ProbeConfig
    from probes.module import SemanticProbeModule

    cfg = str(_tiny_config(tmp_path))
    result = main(["--config", cfg, "--test", "false", "--export_dir", str(tmp_path / "e"), "--model.lr_scheduler",
                   "torch.optim.lr_scheduler.StepLR", "--model.lr_scheduler.step_size", "1",
                   "--model.lr_scheduler.gamma", "0.5"])
    training = json.loads((tmp_path / "e" / "target" / "config.json").read_text())["training"]
    assert training["lr_scheduler"] == "torch.optim.lr_scheduler.StepLR" and training["epochs"] == 3
    # the exported weights are the best checkpoint's, whose epoch the card states beside the epochs run
    assert training["best_epoch"] == torch.load(result["best_ckpt"], weights_only=False)["epoch"] + 1
    card = (tmp_path / "e" / "target" / "README.md").read_text()
    assert "| lr_scheduler | `torch.optim.lr_scheduler.StepLR` |" in card
    checkpoint = torch.load(next((tmp_path / "runs").rglob("last.ckpt")), weights_only=False)
    assert checkpoint["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(1e-4 * 0.5 ** 3)
    caplog.clear()
    line = _one_line_error(capsys, ["--config", cfg, "--model.lr_scheduler", "torch.optim.lr_scheduler.LinearLR",
                                    "--model.lr_scheduler.start_factor", "5"])
    assert not [r for r in caplog.records if "GPU available" in r.getMessage()]  # logged before the refusal
    assert line.startswith("python -m probes.fit: error: --model.lr_scheduler: Starting multiplicative factor")
    spec = {r: {"hidden_size": 7, "features": FeatureSpec(), "reads": {"hidden_size": 7}} for r in ("target", "draft")}
    module = SemanticProbeModule(ProbeConfig(hidden_dims=[4]), ["target", "draft"], spec,
                                 lr_scheduler=partial(ReduceLROnPlateau, monitor="val/loss"))
    assert module.configure_optimizers()["lr_scheduler"]["monitor"] == "val/loss"  # Lightning's plateau names it
    with pytest.raises(ValueError, match="lr_scheduler=3: expected a callable that takes the optimizer"):
        SemanticProbeModule(ProbeConfig(hidden_dims=[4]), ["target", "draft"], spec, lr_scheduler=3)


def test_a_resume_with_fewer_epochs_than_its_checkpoint_is_one_line_and_leaves_no_run(tmp_path, capsys):
    """Lightning refuses a checkpoint past --trainer.max_epochs (MisconfigurationException): that was a traceback, exit
    1, and an empty version_1 folder, where a --ckpt_path that cannot resume ends in one line."""
    cfg = _tiny_config(tmp_path)  # 3 epochs
    main(["--config", str(cfg), "--test", "false", "--export", "false"])
    run = tmp_path / "runs" / "fit" / "version_0"
    capsys.readouterr()
    for epochs in ("1", "3"):  # at its max_epochs Lightning trained nothing, then the run tested and exported again
        line = _one_line_error(capsys, ["--config", str(run / "config.yaml"), "--ckpt_path",
                                        str(run / "checkpoints" / "last.ckpt"), "--trainer.max_epochs", epochs])
        assert f"its run trained 3 epochs, and --trainer.max_epochs {epochs} allows no more" in line
        assert not (tmp_path / "runs" / "fit" / "version_1").exists()


class InterruptTest(L.Callback):
    """Ctrl-C while the best checkpoint is tested, after training."""

    def on_test_start(self, trainer, pl_module):
        raise KeyboardInterrupt


def test_ctrl_c_while_the_best_checkpoint_is_tested_says_what_was_kept(tmp_path, capsys):
    """The test phase ran outside the fit's Ctrl-C handling: exit 1 with Lightning's line alone, where training's
    Ctrl-C exits 130 naming last.ckpt and the command that resumes."""
    handler = signal.getsignal(signal.SIGINT)
    interrupt = '[{"class_path": "tests.probes.test_fit.InterruptTest"}]'
    try:
        with pytest.raises(SystemExit) as e:
            main(["--config", str(_tiny_config(tmp_path)), "--trainer.max_epochs", "1", "--trainer.callbacks+",
                  interrupt])
    finally:
        signal.signal(signal.SIGINT, handler)
    assert e.value.code == 130 and "python -m probes.fit: interrupted" in capsys.readouterr().err


@pytest.mark.parametrize("key, suggestion", [("export_dri", "--export_dir"), ("seed_everythin", "--seed_everything")])
def test_a_mistyped_top_level_key_of_a_config_file_is_named_with_the_closest_option(tmp_path, capsys, key,
                                                                                    suggestion):
    """A nested key gets its file named and the closest option; a top-level one got only jsonargparse's "Option
    'export_dri' is not accepted"."""
    typo = tmp_path / "typo.yaml"
    typo.write_text(f"{key}: 1\n")
    line = _one_line_error(capsys, ["--config", str(_tiny_config(tmp_path)), "--config", str(typo)])
    assert f"did you mean {suggestion}?" in line and str(typo) in line, line


class _TinyModule(L.LightningModule):
    """A module that trains and validates in no time, for when the callback decodes."""

    def __init__(self):
        super().__init__()
        self.layer, self.probes = torch.nn.Linear(2, 1), {}  # none to check for divergence

    def training_step(self, batch, i):
        return self.layer(batch[0]).mean()

    def validation_step(self, batch, i):
        self.log("val/x", self.layer(batch[0]).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), 0.1)

    def _loader(self):
        from torch.utils.data import DataLoader, TensorDataset

        return DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2)

    train_dataloader = val_dataloader = _loader


@pytest.mark.parametrize("max_epochs, every", [(2, 3), (3, 2)])
def test_live_validation_decodes_at_the_last_epoch_whatever_check_val_every_n_epoch(tmp_path, max_epochs, every):
    """A check_val_every_n_epoch that does not divide max_epochs skips the last epoch's validation: the callback
    decoded nothing at it (with (2, 3), nothing at all, without a word), where it promises the last epoch."""
    from callbacks.speculative_validation import SpeculativeValidation

    cb = SpeculativeValidation(max_problems=1)
    cb.setup = lambda *a, **k: None  # no models: only when it decodes is under test
    cb.decode = lambda module: {"speedup": 1.0, "accuracy": 1.0, "accuracy_delta": 0.0}
    trainer = L.Trainer(max_epochs=max_epochs, check_val_every_n_epoch=every, logger=False, callbacks=[cb],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    trainer.fit(_TinyModule())
    assert [h["epoch"] for h in cb.history] == sorted({e for e in range(max_epochs) if (e + 1) % every == 0} |
                                                      {max_epochs - 1})
