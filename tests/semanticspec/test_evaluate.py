"""``python -m semanticspec.evaluate``: refusals before any decoding, a small evaluation of the shipped world
(resume, the sweep's reuse, the same texts as the decode benchmark's loop), and the picked threshold as the decoders'
and the endpoint's default."""

import json
import math
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from semanticspec import evaluate as E

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "arithmetic.yaml")
SHIPPED = ROOT / "checkpoints" / "arithmetic" / "probes"
TIMING = ("wall_s", "speedup", "tokens_per_s", "seconds", "_s", "probe_overhead")


def refused(capsys, argv: list[str]) -> str:
    """The one line ``main(argv)`` exits 2 with."""
    with pytest.raises(SystemExit) as e:
        E.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def no_decoding(monkeypatch):
    """Fail the test if anything is decoded."""
    monkeypatch.setattr(E, "decode_one", lambda *a, **k: pytest.fail("decoded before refusing"))


def copy_probes(tmp_path: Path, target: str = "target", draft: str = "draft") -> Path:
    out = tmp_path / "probes"
    for role, src in (("target", target), ("draft", draft)):
        shutil.copytree(SHIPPED / src, out / role)
    return out


# --------------------------------------------------------------------------- bad input, refused before decoding


def test_a_threshold_grid_outside_0_1_is_refused(capsys, monkeypatch):
    no_decoding(monkeypatch)
    err = refused(capsys, ["--config", CONFIG, "--probes", str(SHIPPED), "--thresholds", "[0.3, 1.5]"])
    assert "--thresholds: 1.5 is outside [0, 1]" in err


def test_a_split_overlapping_the_label_builds_problems_is_refused(capsys, monkeypatch):
    no_decoding(monkeypatch)  # the build of configs/arithmetic.yaml generates 200 problems from task_seed 1
    err = refused(capsys, ["--config", CONFIG, "--probes", str(SHIPPED), "--seed", "1", "--n_problems", "3"])
    assert "--seed=1" in err and "3 of the 3 problems are among the label build's" in err
    err = refused(capsys, ["--config", CONFIG, "--probes", str(SHIPPED), "--seed", "-1", "--n_problems", "3"])
    assert "--seed=-1: expected an integer >= 0" in err  # was the same overlap: random reads -1 as 1


def test_a_task_with_no_answers_to_check_is_refused(capsys, monkeypatch, tmp_path):
    no_decoding(monkeypatch)
    path = tmp_path / "open.jsonl"
    path.write_text("".join(json.dumps({"problem": f"Say {i}.", "answer": None}) + "\n" for i in range(3)))
    err = refused(capsys, ["--config", CONFIG, "--probes", str(SHIPPED), "--n_problems", "3",
                           "--task", "datamodules.tasks.base.Task", "--task.path", str(path)])
    assert "problem 0 ('Say 0.') has no answer to check" in err


def test_probes_for_another_role_are_refused(capsys, monkeypatch, tmp_path):
    no_decoding(monkeypatch)
    swapped = copy_probes(tmp_path, target="draft", draft="target")
    err = refused(capsys, ["--config", CONFIG, "--probes", str(swapped)])
    assert "target was exported with role 'draft'" in err and "used as the target probe" in err


def test_probes_for_another_model_are_refused(capsys, monkeypatch, tmp_path):
    """From the models' configs and tokenizers, before their weights load."""
    no_decoding(monkeypatch)
    monkeypatch.setattr("datamodules.labels.shard.load_model", lambda *a: pytest.fail("weights loaded"))
    other = copy_probes(tmp_path, target="draft")  # the draft's probe, relabelled as a target probe
    cfg = json.loads((other / "target" / "config.json").read_text())
    (other / "target" / "config.json").write_text(json.dumps({**cfg, "role": "target"}))
    err = refused(capsys, ["--config", CONFIG, "--probes", str(other), "--n_problems", "2"])
    assert "hidden_size" in err and "target" in err


def test_a_device_torch_cannot_use_is_refused_before_the_weights_load(capsys, monkeypatch):
    no_decoding(monkeypatch)
    monkeypatch.setattr("datamodules.labels.shard.load_model", lambda *a: pytest.fail("weights loaded"))
    err = refused(capsys, ["--config", CONFIG, "--probes", str(SHIPPED), "--n_problems", "2", "--target_device",
                           "bogus"])
    assert "--target_device 'bogus' is not a torch device" in err
    if not torch.cuda.is_available():
        err = refused(capsys, ["--config", CONFIG, "--probes", str(SHIPPED), "--n_problems", "2", "--draft_device",
                               "cuda:0"])
        assert "--draft_device 'cuda:0': torch sees no CUDA device here" in err


def test_an_unreachable_server_is_refused(capsys, monkeypatch):
    no_decoding(monkeypatch)
    err = refused(capsys, ["--config", CONFIG, "--probes", str(ROOT / "checkpoints/arithmetic/probes-topk"),
                           "--target_url", "http://127.0.0.1:9/v1", "--draft_url", "http://127.0.0.1:9/v1"])
    assert "127.0.0.1:9" in err


def test_probes_the_servers_cannot_serve_are_refused_before_decoding(capsys, monkeypatch, tmp_path):
    # hidden-state probes through llama.cpp servers: refused in one line, not target_only decoded first
    from tests.fake_engines import FakeLlamaCpp

    no_decoding(monkeypatch)
    target, draft = FakeLlamaCpp("target"), FakeLlamaCpp("draft")
    try:
        err = refused(capsys, ["--config", CONFIG, "--probes", str(SHIPPED), "--target_url", target.root,
                               "--draft_url", draft.root, "--n_problems", "2", "--write_threshold", "false",
                               "--out_dir", str(tmp_path / "evaluation")])
    finally:
        target.close(), draft.close()
    assert "cannot give hidden" in err and target.root in err


@pytest.mark.parametrize("text, says", [
    ("a: [", "not a readable YAML file"), ("- 1\n", "expected a `python -m probes.fit` config"),
    ("foo: 1\n", "expected a `python -m probes.fit` config"), ("data: 5\n", "expected a `python -m probes.fit` config"),
    ("data:\n  build:\n    n_problems: abc\n", "its data.build section is refused"),
])
def test_a_config_that_is_no_fit_config_is_refused_naming_it(capsys, monkeypatch, tmp_path, text, says):
    # each was a traceback (exit 1), ran on defaults, or blamed `python -m datamodules.labels.build`
    no_decoding(monkeypatch)
    path = tmp_path / "c.yaml"
    path.write_text(text)
    err = refused(capsys, ["--config", str(path), "--probes", str(SHIPPED)])
    assert f"--config {path}: {says}" in err and "labels.build" not in err


def test_without_config_the_packages_config_is_read_from_any_folder_and_a_missing_one_is_named(capsys, monkeypatch,
                                                                                                tmp_path):
    """No --config: the package's configs/arithmetic.yaml (as probes.fit reads), not one relative to where the command
    runs; a --config that does not exist is named as missing, a run folder without config.yaml as holding none."""
    no_decoding(monkeypatch)
    monkeypatch.chdir(tmp_path)
    err = refused(capsys, ["--probes", str(tmp_path / "nowhere")])
    assert err.startswith("python -m semanticspec.evaluate: error: --probes ") and "--config" not in err, err
    assert "--config missing.yaml: no such file or folder" in refused(capsys, ["--config", "missing.yaml"])
    (tmp_path / "run").mkdir()
    assert f"--config {tmp_path / 'run'}: holds no config.yaml" in refused(capsys, ["--config", str(tmp_path / "run")])


def test_a_fit_on_labels_built_on_their_own_is_evaluated_on_the_build_they_record(tmp_path):
    """A fit with ``data.build: null`` (labels built first with ``python -m datamodules.labels.build``, as the README
    shows) was evaluated on the default build: the arithmetic world's models and generated problems, not the file and
    models the labels came from. Its manifest's build is read now, and a missing manifest is named."""
    from datamodules.labels.config import BuildConfig, config_record
    from datamodules.tasks.base import Task

    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps({"problem": f"{k} + 1?", "answer": k + 1}) + "\n" for k in range(6)))
    data = tmp_path / "data"
    data.mkdir()
    recorded = config_record(BuildConfig(task=Task(str(problems)), n_problems=3, target=str(ROOT / "checkpoints" /
                                                                                          "arithmetic" / "draft")))
    (data / "manifest.json").write_text(json.dumps({"format_version": 3, "shards": [], "config": recorded}))
    fit = tmp_path / "fit.yaml"
    fit.write_text(f"data:\n  data_dir: {data}\n  build: null\n")
    build = E.read_fit(str(fit)).build
    assert Path(build.resolved_task().path) == problems and build.n_problems == 3 and build.target.endswith("draft")
    (data / "manifest.json").write_text(json.dumps({"format_version": 3, "shards": []}))  # another build's
    with pytest.raises(ValueError, match=rf"{data} holds a manifest.json that records no build config; run from"):
        E.read_fit(str(fit))
    (data / "manifest.json").unlink()
    with pytest.raises(ValueError, match=rf"--config {fit}: its data.build is null .* but {data} holds no "
                                         r"manifest.json; run from"):
        E.read_fit(str(fit))


def test_a_run_that_exported_nothing_names_where_its_exports_were_looked_for(capsys, monkeypatch, tmp_path):
    no_decoding(monkeypatch)  # it named "<log dir>/version_N/export"
    fit = tmp_path / "fit.yaml"
    fit.write_text(json.dumps({"trainer": {"logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                                                      "init_args": {"save_dir": str(tmp_path), "name": "fit"}}}}))
    err = refused(capsys, ["--config", str(fit)])
    assert f"has exported no probes yet (looked in {tmp_path / 'fit' / 'version_*' / 'export'})" in err


def test_a_task_that_refuses_its_arguments_and_an_out_dir_that_is_a_file_are_refused(capsys, monkeypatch, tmp_path):
    no_decoding(monkeypatch)
    err = refused(capsys, ["--config", CONFIG, "--probes", str(SHIPPED), "--task",
                           "datamodules.tasks.choice.MultipleChoiceTask", "--task.letters", "abc"])
    assert "--task: letters='abc': expected upper-case letters" in err  # it was a 48-line double traceback
    # --task.path alone: jsonargparse made the base Task of it, which scored every answer wrong without a word
    err = refused(capsys, ["--config", CONFIG, "--probes", str(SHIPPED), "--task.path", str(tmp_path / "t.jsonl")])
    assert "--task.* given without --task: name the task's class too" in err
    err = refused(capsys, ["--config", CONFIG, "--probes", str(SHIPPED), "--task.min_ops=3"])  # a union's message
    assert "--task.* given without --task: name the task's class too" in err
    with pytest.raises(SystemExit) as e:  # --task.help names its class: it was refused as a --task.* option
        E.main(["--task.help", "arithmetic_world.task.ArithmeticTask"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: python -m semanticspec.evaluate ") and "--task.min_ops" in out
    (tmp_path / "afile").write_text("")
    err = refused(capsys, ["--config", CONFIG, "--probes", str(SHIPPED), "--out_dir", str(tmp_path / "afile")])
    assert f"--out_dir {tmp_path / 'afile'}: is a file" in err
    # refused before the models load (a bare "[Errno 2]" after them), or the default taken silently
    for out, says in [("/proc/x", "--out_dir /proc/x: no folder can be made in /proc"), ("", "--out_dir '': expected")]:
        assert says in refused(capsys, ["--config", CONFIG, "--probes", str(SHIPPED), "--out_dir", out])


def _fit_with_export_dir(tmp_path: Path) -> dict:
    """The package's fit config, its runs under ``tmp_path/runs``, exporting to ``tmp_path/exported``."""
    import yaml

    cfg = yaml.safe_load(Path(CONFIG).read_text())
    cfg["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "runs")
    cfg["export_dir"] = str(tmp_path / "exported")
    shutil.copytree(SHIPPED, tmp_path / "exported")
    return cfg


def test_a_fit_that_exported_to_its_export_dir_is_evaluated_from_there(tmp_path):
    """A fit with --export_dir writes its probes there, not into its run folder: the evaluation once refused its run
    folder (no export yet) and, given its YAML, evaluated an older run's export and wrote the pick beside it."""
    import yaml

    cfg = _fit_with_export_dir(tmp_path)
    run = tmp_path / "runs" / "fit" / "version_1"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    shutil.copytree(SHIPPED, tmp_path / "runs" / "fit" / "version_0" / "export")  # an older run's
    fit_yaml = tmp_path / "fit.yaml"
    fit_yaml.write_text(yaml.safe_dump(cfg))
    for config in (run, fit_yaml):
        assert E.probe_dir(E.EvaluateOptions(config=str(config)), E.read_fit(str(config))) == tmp_path / "exported"


def test_probes_whose_folder_cannot_take_the_pick_are_refused_before_decoding(capsys, monkeypatch, tmp_path):
    """The pick is written beside the probes: a folder that cannot take it was found after every decode (a
    PermissionError traceback, exit 1)."""
    import subprocess

    no_decoding(monkeypatch)
    probes = tmp_path / "probes"
    shutil.copytree(SHIPPED, probes)
    if subprocess.run(["chattr", "+i", str(probes)], capture_output=True).returncode:
        pytest.skip("chattr +i (an immutable folder, which root cannot write either) is not available here")
    try:
        err = refused(capsys, ["--probes", str(probes), "--out_dir", str(tmp_path / "out")])
    finally:
        subprocess.run(["chattr", "-i", str(probes)])
    assert f"--probes {probes}: no folder can be made" in err and "--write_threshold false" in err


def test_records_whose_header_holds_a_tuple_resume(tmp_path):
    """A task's arguments may hold a tuple, which JSON reads back as a list: every resume was refused as another
    run's records."""
    header = {"task": {"class_path": "my.Task", "init_args": {"delimiters": ("\n\n", ". ")}}, "tau": 0.5}
    E.Records(tmp_path / "records.jsonl", header).close()
    E.Records(tmp_path / "records.jsonl", header).close()


def test_records_with_a_damaged_header_or_line_are_refused_not_erased(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps({"note": "header lost"}) + "\n" + json.dumps({"problem": 0}) + "\n")
    with pytest.raises(ValueError, match=r"records\.jsonl:1 is not the records' header"):
        E.Records(path, {"seed": 1})
    assert len(path.read_text().splitlines()) == 2  # it was erased, and every decode redone
    path.write_text(json.dumps({"header": {"seed": 1}}) + "\n{bad\n" + json.dumps({"problem": 0}) + "\n")
    with pytest.raises(ValueError, match=r"records\.jsonl:2: not a JSON record"):
        E.Records(path, {"seed": 1})
    # JSON that is no record: each was a traceback (KeyError, TypeError)
    path.write_text(json.dumps({"header": {"seed": 1}}) + "\n\n{}\n")
    with pytest.raises(ValueError, match=r"records\.jsonl:3: not a decode's record"):
        E.Records(path, {"seed": 1})
    path.write_text(json.dumps({"header": None}) + "\n")
    with pytest.raises(ValueError, match=r"records\.jsonl:1 is not the records' header"):
        E.Records(path, {"seed": 1})


def test_a_second_evaluation_into_the_same_records_is_refused_while_the_first_runs(tmp_path):
    """Two evaluations in one --out_dir each decoded everything and appended every decode twice."""
    path = tmp_path / "records.jsonl"
    first = E.Records(path, {"seed": 1})
    with pytest.raises(ValueError, match=rf"another evaluation is writing {path} \(it holds .*\.records\.jsonl\.lock"
                                         r"\); let it finish, or give this one another --out_dir"):
        E.Records(path, {"seed": 1})
    first.close()
    E.Records(path, {"seed": 1}).close()  # once it ended


def test_an_evaluation_that_evaluated_nothing_fails_and_writes_strict_json(capsys, monkeypatch, tmp_path):
    # every decode failing (a device that cannot run, prompts past the context) ended with exit 0 and a NaN pick
    def fails(*a, **k):
        raise RuntimeError("the model cannot run here")

    monkeypatch.setattr(E, "decode_one", fails)
    probes = copy_probes(tmp_path)
    with pytest.raises(SystemExit) as e:
        E.main([*ARGS, "--probes", str(probes), "--out_dir", str(tmp_path / "out")])
    assert e.value.code == 1
    out, err = capsys.readouterr()
    assert "no problem was evaluated" in err and "RuntimeError: the model cannot run here" in err
    text = (tmp_path / "out" / "evaluation.json").read_text()
    report = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in evaluation.json"))
    assert report["pick"]["tau"] is None and "no problem was evaluated" in report["pick"]["why"]  # not a NaN pick
    assert "(pick)" not in out and "Pick: tau" not in out, out
    assert not (probes / "threshold.json").exists()


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_ctrl_c_before_decoding_exits_130_naming_the_resume_command(capsys, monkeypatch, stop):
    import signal

    def interrupted(*a, **k):
        if stop == "sigterm":  # a scheduler's stop: it ended the process without a word
            os.kill(os.getpid(), signal.SIGTERM)
        raise KeyboardInterrupt

    def found(*_):
        raise AssertionError("the evaluation left SIGTERM to the handler it found")

    monkeypatch.setattr(E, "make_setup", interrupted)  # while the models load: it was a traceback
    before = signal.signal(signal.SIGTERM, found)
    try:
        with pytest.raises(SystemExit) as e:
            E.main(["--config", CONFIG, "--probes", str(SHIPPED), "--n_problems", "2", "--thresholds", "[0.4, 0.6]"])
        assert signal.getsignal(signal.SIGTERM) is found
    finally:
        signal.signal(signal.SIGTERM, before)
    assert e.value.code == 130  # the command as a shell reads it back (it was joined with spaces: not pasteable)
    assert capsys.readouterr().err.strip() == (f"{E.PROG}: interrupted; resume with: {E.PROG} --config {CONFIG} "
                                               f"--probes {SHIPPED} --n_problems 2 --thresholds '[0.4, 0.6]'")


def test_inside_another_command_it_prints_nothing_and_leaves_ctrl_c_to_it(capsys, monkeypatch):
    """``benchmarks.evaluate`` printed the table twice, the first time naming files in a folder it then deleted, and
    on Ctrl-C a resume command for that folder."""
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(E, "make_setup", interrupted)
    with pytest.raises(KeyboardInterrupt):
        E.main(["--config", CONFIG, "--probes", str(SHIPPED), "--n_problems", "2"], echo=False)
    assert capsys.readouterr().err == ""


def test_the_threshold_file_is_strict_json(tmp_path):
    """A pick on one problem has no paired interval; threshold.json held a bare NaN, which strict readers refuse."""
    from generation.paths import strict_json

    probes = copy_probes(tmp_path)
    pick = {"tau": 0.5, "max_accuracy_drop": 0.01, "accuracy": 1.0, "accuracy_delta_ci95": [math.nan, math.nan],
            "speedup": math.inf}
    path = E.write_threshold(probes, {"pick": pick, "n_evaluated": 1, "seed": 0}, "cmd")

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    figures = json.loads(path.read_text(), parse_constant=refuse)["figures"]
    assert figures["accuracy_delta_ci95"] == [None, None] and figures["speedup"] is None
    assert strict_json({"a": (1.5, -math.inf)}) == '{\n  "a": [\n    1.5,\n    null\n  ]\n}\n'


# --------------------------------------------------------------------------- an evaluation of the shipped world

ARGS = ["--config", CONFIG, "--n_problems", "2", "--thresholds", "[0.05, 0.5, 0.95]", "--token_sd", "false",
        "--progress", "false", "--task", "arithmetic_world.task.ArithmeticTask", "--task.min_ops", "4",
        "--task.max_ops", "4"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evaluate")
    probes = copy_probes(tmp)
    out = tmp / "out"
    report = E.main([*ARGS, "--probes", str(probes), "--out_dir", str(out)])
    return SimpleNamespace(report=report, probes=probes, out=out, tmp=tmp)


def without_timings(x):
    if isinstance(x, dict):
        return {k: without_timings(v) for k, v in x.items() if not any(t in k for t in TIMING)}
    if isinstance(x, list):
        return [without_timings(v) for v in x]
    return x


def test_the_evaluation_writes_its_figures_and_the_pick(run):
    r = run.report
    assert r["n_evaluated"] == 2 and not r["failed"]
    assert set(r["methods"]) == {"target_only", "semanticspec"}
    s = r["methods"]["semanticspec"]
    lo, hi = s["accuracy_ci95"]
    assert lo <= s["accuracy"] <= hi and 0 < s["step_acceptance"] <= 1 and s["target_passes_per_100_tokens"] < 100
    assert sum(s["decisions"].values()) >= s["draft_steps_proposed"] - s["decisions"]["after_error"] > 0
    assert [row["threshold"] for row in r["sweep"]] == [0.05, 0.5, 0.95]
    for name in ("evaluation.json", "evaluation.md", "evaluation.png", "records.jsonl"):
        assert (run.out / name).stat().st_size > 0
    stored = json.loads((run.probes / "threshold.json").read_text())
    assert stored["tau"] == r["pick"]["tau"] and stored["format_version"] == 1 and stored["rule"] == E.RULE
    floor = r["methods"]["target_only"]["accuracy"] - 0.01
    pick = next(row for row in r["sweep"] if row["threshold"] == r["pick"]["tau"])
    assert pick["accuracy"] >= floor - 1e-12
    assert all(row["speedup"] <= pick["speedup"] for row in r["sweep"] if row["accuracy"] >= floor - 1e-12)


def test_a_killed_evaluation_resumes_to_the_same_report(run, tmp_path):
    lines = (run.out / "records.jsonl").read_text().splitlines(keepends=True)
    assert len(lines) == 1 + 2 * 4  # header; per problem target-only, SemanticSpec at 0.5 and at the 2 other thresholds
    out = tmp_path / "out"
    out.mkdir()
    (out / "records.jsonl").write_text("".join(lines[:6]) + lines[6][:25])  # killed while writing line 7
    resumed = E.main([*ARGS, "--probes", str(run.probes), "--out_dir", str(out), "--write_threshold", "false"])
    # the first run wrote its pick beside the probes; the resumed run keeps the threshold its records were decoded at
    assert (run.probes / "threshold.json").is_file() and resumed["tau"] == run.report["tau"] == 0.5
    assert len((out / "records.jsonl").read_text().splitlines()) == len(lines)
    # the pick is the fastest threshold: it follows the timings, which a resumed run measures anew
    assert without_timings({**resumed, "pick": None}) == without_timings({**run.report, "pick": None,
                                                                          "threshold_file": None})
    again = E.main([*ARGS, "--probes", str(run.probes), "--out_dir", str(out), "--write_threshold", "false"])
    assert again == resumed  # a finished evaluation is not redone: the same records, the same figures
    # the header names the models by their fingerprints, not their paths: a moved checkout resumes
    assert str(ROOT) not in json.dumps(resumed["settings"]) and resumed["settings"]["where"]["target"]["num_layers"]


def test_records_timed_at_another_thread_count_are_refused(run, capsys):
    """The speedups come from the records' timings, which the thread count sets: a rerun at another ``--threads``
    is refused before it mixes them, naming both counts."""
    had, n = run.report["settings"]["threads"], torch.get_num_threads()
    try:
        err = refused(capsys, [*ARGS, "--probes", str(run.probes), "--out_dir", str(run.out), "--threads",
                               str(had + 1), "--write_threshold", "false"])
    finally:
        torch.set_num_threads(n)
    assert f"records decodes with threads={had}, this run has {had + 1}" in err


def test_a_pick_made_on_more_problems_is_kept(run, tmp_path, capsys):
    """A quick evaluation does not replace the threshold a longer one picked for the same target probe; a pick for
    other weights is replaced."""
    probes, out = tmp_path / "probes", tmp_path / "out"
    shutil.copytree(run.probes, probes)
    shutil.copytree(run.out, out)
    stored = json.loads((probes / "threshold.json").read_text())
    careful = {**stored, "tau": 0.7, "n_problems": 40}
    (probes / "threshold.json").write_text(json.dumps(careful))
    argv = [*ARGS, "--probes", str(probes), "--out_dir", str(out)]
    report = E.main(argv, echo=False)  # every decode is recorded: nothing is decoded again
    assert json.loads((probes / "threshold.json").read_text()) == careful and report["threshold_file"] is None
    said = capsys.readouterr()
    assert said.out == ""  # echo=False: no table, no "wrote" line
    assert f"kept {probes / 'threshold.json'}: its pick (tau 0.7) was made on 40 problems, this run evaluated 2" \
        in said.err
    (probes / "threshold.json").write_text(json.dumps({**careful, "target_probe_sha256": "0" * 64}))
    with pytest.warns(UserWarning, match="written for other probe weights"):
        assert E.main(argv)["threshold_file"] == str(probes / "threshold.json")
    assert json.loads((probes / "threshold.json").read_text())["n_problems"] == 2


def test_a_reused_decode_is_the_decode_at_its_threshold(run):
    """The sweep reuses a decode where no probe-judged step's q lies between the two thresholds; decoding again at
    that threshold gives the same text and decisions."""
    from arithmetic_world.models import load_world
    from arithmetic_world.task import ArithmeticTask
    from semanticspec.decoder import SemanticSpecDecoder
    from semanticspec.policies import ProbePolicy

    rows = list(E.iter_records(run.out / "records.jsonl"))
    reused = [r for r in rows if "reused_from" in r]
    redone = [r for r in rows if r["method"] == "semanticspec" and r["threshold"] != 0.5 and "reused_from" not in r]
    assert reused and redone  # 0.05 and 0.95 each took one path on some problem
    world = load_world()
    settings = run.report["settings"]
    for row in reused[:1] + redone[:1]:
        dec = SemanticSpecDecoder(world.target, world.draft, world.tokenizer, None, run.probes / "target",
                                  run.probes / "draft", policy=ProbePolicy(tau=row["threshold"], top_k=1),
                                  task=SimpleNamespace(answer_marker="Answer:"))
        p = ArithmeticTask(min_ops=4, max_ops=4).problems(2, 30_000)[row["problem"]]
        got = dec.generate([p["problem"] + "\n\n"], seed=row["seed"], max_new_tokens=96,
                           temperature=settings["temperature"], top_p=settings["top_p"])[0]
        want = E.result_of(row["result"])
        assert got.text == want.text
        assert [s.decision for s in got.steps] == [s.decision for s in want.steps]


def test_the_evaluation_decodes_as_the_decode_benchmark(run):
    """The same problems and seeds give the same target-only and SemanticSpec texts as ``benchmarks.decode``'s
    settings (its shipped-window row) through the core."""
    from benchmarks.decode import ADAPTIVE, build_plan, parse_args
    from arithmetic_world import models, task

    args = parse_args(["--quick", "--n-problems", "2", "--no-batch-scaling"])
    plan = build_plan(args, models.load_world())
    gen = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p, "lookahead": 1}
    arms = {"target_only": E.Arm(plan.dec, {**gen, "method": "target_only"}),
            "semanticspec": E.Arm(plan.dec, {**gen, "lookahead": ADAPTIVE[0], "window_min_logprob": ADAPTIVE[1]})}
    problems = task.generate_problems(2, args.seed, task.TaskConfig(min_ops=4, max_ops=4))
    prompts = [p.problem + task.STEP_DELIMITER for p in problems]
    bench = E.interleaved(arms, problems, prompts, args.seed)
    rows = {(r["problem"], r["method"], r["threshold"]): r for r in E.iter_records(run.out / "records.jsonl")}
    for k in range(2):
        for name, tau in (("target_only", None), ("semanticspec", 0.5)):
            ours = E.result_of(rows[(k, name, tau)]["result"])
            assert ours.text == bench[name][k].text
            assert [s.decision for s in ours.steps] == [s.decision for s in bench[name][k].steps]


def test_a_problem_that_fails_is_recorded_and_the_run_goes_on(tmp_path):
    from semanticspec.results import DecodeResult, DecodeStats

    class Flaky:
        def generate(self, prompts, seed, **kw):
            if prompts[0] == "bad":
                raise RuntimeError("server went away")
            return [DecodeResult(text="Answer: 1", stats=DecodeStats(wall_s=1.0, output_tokens=3), stop_reason="eos")]

    task = SimpleNamespace(check=lambda text, answer: text.endswith(str(answer)))
    problems = [{"problem": p, "answer": 1} for p in ("a", "bad", "c")]
    arms = {"target_only": E.Arm(Flaky()), "semanticspec": E.Arm(Flaky())}
    setup = E.Setup(arms, problems, [p["problem"] for p in problems], task, 0.5, lambda t: E.Arm(Flaky()), 0, {})
    report = E.Evaluation(setup, tmp_path, [0.5], 0.01, progress=False).run()
    assert report["n_evaluated"] == 2
    assert {(f["problem"], f["reason"]) for f in report["failed"]} == {(1, "RuntimeError: server went away")}
    assert report["methods"]["semanticspec"]["accuracy"] == 1.0
    # the server is back: a rerun decodes the failed problem again
    problems[1]["problem"] = "b"
    setup.prompts[1] = "b"
    again = E.Evaluation(setup, tmp_path, [0.5], 0.01, progress=False).run()
    assert again["n_evaluated"] == 3 and not again["failed"]


def test_wilson_interval_and_pick_rule():
    assert all(math.isnan(x) for x in E.wilson(0, 0))
    lo, hi = E.wilson(39, 40)
    assert 0.86 < lo < 0.88 and 0.99 < hi < 1.0
    base = {"accuracy_ci95": [0, 1], "accuracy_delta": 0, "accuracy_delta_ci95": [0, 0], "step_acceptance": 0.5}
    curve = [{**base, "threshold": t, "accuracy": a, "speedup": s} for t, a, s in
             ((0.3, 0.90, 3.0), (0.5, 0.97, 2.5), (0.7, 0.975, 2.0))]
    assert E.pick(curve, {"accuracy": 0.975, "accuracy_ci95": [0.9, 1]}, 0.01)["tau"] == 0.5
    assert E.pick(curve, {"accuracy": 0.975, "accuracy_ci95": [0.9, 1]}, 0.1)["tau"] == 0.3
    assert E.pick(curve, {"accuracy": 1.0, "accuracy_ci95": [0.9, 1]}, 0.0)["tau"] is None



def test_the_paired_accuracy_difference_and_its_interval_stay_within_minus_one_and_one():
    """Three wrong of four against a reference right on all: the normal interval reached -1.071."""
    got = E.paired_delta([False, False, False, True], [True] * 4)
    assert got["accuracy_delta"] == -0.75 and got["accuracy_delta_ci95"][0] == -1.0
    assert -0.75 < got["accuracy_delta_ci95"][1] < 0.1
    assert all(math.isnan(x) for x in E.paired_delta([], [])["accuracy_delta_ci95"])


def test_the_paired_interval_is_agresti_and_mins_and_keeps_a_width_when_every_difference_is_the_same():
    """The normal interval of the per-problem differences was +0.000 [+0.000, +0.000] for two methods right (or
    wrong) on the same problems, on 8 problems as on 8,000. Agresti and Min's adjusted Wald interval adds half a
    problem to each cell: 2 right here only and 1 in the reference only of 40 is centred at 1/42 with a half-width of
    1.96 * sqrt(2 + 1 + 1 - 1/42) / 42 (their R function ``diffpropci``)."""
    same = E.paired_delta([True, False] * 4, [True, False] * 4)
    assert same["accuracy_delta"] == 0 and math.isclose(same["accuracy_delta_ci95"][1], E.Z95 / 10)
    assert math.isclose(same["accuracy_delta_ci95"][0], -E.Z95 / 10)
    right, ref = [True, True, False] + [True] * 37, [False, False, True] + [True] * 37
    got = E.paired_delta(right, ref)
    half = E.Z95 * math.sqrt(4 - 1 / 42) / 42
    assert got["accuracy_delta"] == 1 / 40 and math.isclose(got["accuracy_delta_ci95"][0], 1 / 42 - half)
    assert math.isclose(got["accuracy_delta_ci95"][1], 1 / 42 + half)
    flipped = E.paired_delta(ref, right)["accuracy_delta_ci95"]
    assert math.isclose(flipped[0], -got["accuracy_delta_ci95"][1])


# --------------------------------------------------------------------------- threshold.json as the default tau


@pytest.fixture()
def picked(tmp_path):
    """A copy of the shipped probes with a picked threshold of 0.37 beside them."""
    probes = copy_probes(tmp_path)
    report = {"pick": {"tau": 0.37, "max_accuracy_drop": 0.01}, "n_evaluated": 1, "seed": 0}
    E.write_threshold(probes, report, "test")
    return probes


def test_the_decoders_use_the_picked_threshold_and_explicit_policies_win(picked):
    from arithmetic_world.models import load_world
    from semanticspec.decoder import SemanticSpecDecoder
    from semanticspec.policies import ProbePolicy
    from semanticspec.served import ServedDecoder

    w = load_world()
    t, d = picked / "target", picked / "draft"
    assert SemanticSpecDecoder(w.target, w.draft, w.tokenizer, None, t, d).policy.tau == 0.37
    explicit = SemanticSpecDecoder(w.target, w.draft, w.tokenizer, None, t, d, policy=ProbePolicy(tau=0.5, top_k=1))
    assert explicit.policy.tau == 0.5
    assert SemanticSpecDecoder(w.target, w.draft, w.tokenizer, None, SHIPPED / "target", d).policy.tau == 0.5
    engines = [SimpleNamespace(model=None, url=f"http://x/{r}") for r in ("target", "draft")]
    topk = ROOT / "checkpoints" / "arithmetic" / "probes-topk"
    served_dir = picked.parent / "served"
    shutil.copytree(topk, served_dir)
    E.write_threshold(served_dir, {"pick": {"tau": 0.42, "max_accuracy_drop": 0.01}, "n_evaluated": 1, "seed": 0},
                      "test")
    assert ServedDecoder(*engines, served_dir / "target", served_dir / "draft").policy.tau == 0.42
    assert ServedDecoder(*engines, served_dir / "target", served_dir / "draft", ProbePolicy(tau=0.6)).policy.tau == 0.6


def test_a_threshold_file_for_other_weights_is_ignored(picked):
    from semanticspec.policies import stored_tau

    assert stored_tau(picked / "target") == 0.37
    data = json.loads((picked / "threshold.json").read_text())
    for edit, says in (({"target_probe_sha256": "0" * 64}, "it was written for other probe weights"),
                       ({"tau": True}, "tau=True is no threshold in"), ({"tau": "0.4"}, "tau='0.4' is no threshold"),
                       ({"tau": 1.5}, "tau=1.5 is no threshold"), ({"format_version": 1.9}, "format_version=1.9: ")):
        (picked / "threshold.json").write_text(json.dumps({**data, **edit}))  # a bool or a string was read as a tau
        with pytest.warns(UserWarning, match=rf"threshold.json: {re.escape(says)}.*deciding at the default tau"):
            assert stored_tau(picked / "target") is None


def test_the_picked_threshold_is_found_however_the_probes_path_is_spelled(picked, monkeypatch):
    # "~/..." loaded the probe (load_probe expands it) but looked for the pick in a folder named "~"; "." (from
    # inside the probe's folder) looked inside it: both decided at 0.5 without a word
    from semanticspec.policies import stored_tau

    monkeypatch.setenv("HOME", str(picked.parent))
    assert stored_tau(f"~/{picked.name}/target") == 0.37
    monkeypatch.chdir(picked / "target")
    assert stored_tau(".") == 0.37 and stored_tau("./") == 0.37


def test_the_endpoint_uses_the_picked_threshold_unless_given_one(picked):
    pytest.importorskip("fastapi")
    from semanticspec.serve.cli import ServeOptions, build

    for given, want in ((None, 0.37), (0.5, 0.5)):
        app = build(ServeOptions(target_probe=str(picked / "target"), draft_probe=str(picked / "draft"),
                                 threshold=given))
        try:
            assert app.state.scheduler.dec.policy.tau == want
        finally:
            app.state.scheduler.stop(0)


def test_thresholds_that_decided_alike_share_one_label_on_the_plot():
    # four thresholds at one point were written over each other, the last one off the figure's edge
    from semanticspec.evaluation_report import _labels

    sweep = [{"threshold": t, "speedup": s, "accuracy": a}
             for t, s, a in ((0.3, 2.97, 0.925), (0.4, 2.99, 0.925), (0.5, 3.0, 0.925), (0.7, 2.9, 0.95))]
    assert _labels(sweep, near=0.06) == {(2.97, 0.925): ["0.3", "0.4", "0.5"], (2.9, 0.95): ["0.7"]}
    assert len(_labels(sweep, near=0.001)) == 4  # apart, each keeps its own
