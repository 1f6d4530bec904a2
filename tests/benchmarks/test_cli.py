"""The benchmarks' command lines refuse bad input as the package's other CLIs do."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # 5.5 s on 2 cores (fresh processes): in CI's slow set, out of the README's 5-minute command
def test_a_bad_value_is_one_line_naming_the_module():
    out = subprocess.run([sys.executable, "-m", "benchmarks.decode", "--problems", "abc"], capture_output=True,
                         text=True, cwd=REPO_ROOT, timeout=300)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == [
        "python -m benchmarks.decode: error: unrecognized arguments: --problems abc; did you mean --n-problems? "
        "(see `python -m benchmarks.decode --help`)"]


@pytest.mark.parametrize("name", ["compile", "decode", "evaluate", "first_step", "labels", "probe_cost", "real",
                                  "rewrites", "served", "train", "world"])
def test_every_benchmark_refuses_in_one_line(name, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as e:
        module.main(["--quick", "--no-such-option", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    prog = f"python -m benchmarks.{name}"
    assert len(err.splitlines()) == 1, err  # not the page of usage under the name `decode.py`
    assert err.startswith(f"{prog}: error: ") and err.endswith(f" (see `{prog} --help`)\n"), err


def test_a_damaged_manifest_is_refused_before_the_real_pair_loads(tmp_path, capsys):
    """It ended in a traceback (as did probes for another pair, after the models loaded)."""
    from benchmarks import real

    (tmp_path / "manifest.json").write_text("{bad")
    with pytest.raises(SystemExit) as e:
        real.main(["--probes", str(REPO_ROOT / "checkpoints" / "arithmetic" / "probes"), "--data-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1 and f"--data-dir {tmp_path}: " in err
    assert "manifest.json is not valid JSON" in err


@pytest.mark.parametrize("name, args, said", [
    # each ran: a negative count wrote NaN figures over the committed results with status 0, a count of 0 ran the
    # whole default benchmark, a folder --out failed after the run, the rest ended in tracebacks
    ("first_step", ["--n-problems", "-5"], "argument --n-problems: -5: expected an integer >= 1"),
    ("decode", ["--n-problems", "0"], "argument --n-problems: 0: expected an integer >= 1"),
    ("decode", ["--threads", "0"], "argument --threads: 0: expected an integer >= 1"),
    ("labels", ["--threads", "x"], "argument --threads: 'x': expected an integer >= 1"),  # read OMP_NUM_THREADS: int()
    ("rewrites", ["--out", "/"], "argument --out: '/': is a folder; expected a JSON file's path"),
    # the JSON was written over the table, or the plot over the JSON, and the run ended with status 0
    ("evaluate", ["--out", "e.md"], "argument --out: 'e.md': expected a path ending in .json (the .md and .png go"),
    ("decode", ["--temperature", "0.7"], "--temperature 0.7: the target probe's labels were sampled at "
                                         "temperature=0.6; leave --temperature unset"),  # a traceback after loading
    ("decode", ["--out", f"{__file__}/x.json"], f"argument --out: its folder {__file__}: is a file"),
    ("decode", ["--only-batch-scaling", "--no-batch-scaling"], "--only-batch-scaling with --no-batch-scaling"),
    ("decode", ["--target-probe", "/no/such/probe"], "--target-probe /no/such/probe: no exported probe there"),
    ("decode", ["--world", "/no/such/world"], "--world /no/such/world: no such folder"),
    ("decode", ["--tau", "2"], "tau=2.0: expected a number with 0 <= tau <= 1"),
    ("decode", ["--random-sweep", "0.5", "1.5"], "--random-sweep 1.5: RandomPolicy(rate=1.5)"),
    ("decode", ["--temperature", "-1"], "temperature=-1.0: expected a finite number >= 0"),
    ("served", ["--ports", "70000", "70001"], "argument --ports: 70000: expected a port from 1 to 65535"),
    ("served", ["--ports", "18861", "18861"], "--ports 18861 18861: the target's and the draft's servers need two"),
    ("endpoint", ["--log_dir", __file__], f"--log_dir {__file__}: is a file"),
    ("real", ["--probes", "/no/such", "--data-dir", "/no/such"], "--probes /no/such: no exported probe in target/"),
    ("served", ["--engine-probes", "/no/such"], "--engine-probes /no/such: no exported probe in target/ or draft/"),
    ("world", ["--root", "/no/such"], "--root /no/such: no such folder"),  # each a traceback
    ("report", ["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_values_are_refused_before_the_run_in_one_line(name, args, said, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as e:
        module.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"python -m benchmarks.{name}: error: ") and said in err, err


def test_the_served_benchmark_starts_its_servers_on_free_ports_by_default():
    """Two runs at once must not share servers: on fixed ports the second run's client talked to the first run's
    servers (its own could not bind), and the first's server log counted both runs' requests."""
    import socket

    from benchmarks import harness, served

    assert served.arguments().parse_args([]).ports is None
    assert served.arguments().parse_args(["--ports", "9001", "9002"]).ports == [9001, 9002]
    ports = harness.free_ports(2)
    assert len(set(ports)) == 2
    for port in ports:  # each is free now
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_the_world_benchmark_samples_through_the_package_generate(tiny_pair):
    """``benchmarks.world`` samples traces with :func:`generation.sampling.generate` at its own temperature and top-p:
    seeded, the same twice, and exactly ``new_tokens`` long without EOS (its decode-cost timing relies on it). The
    call once passed ``temperature=``/``top_p=`` that ``generate`` no longer takes, and the benchmark failed."""
    from benchmarks import world
    from arithmetic_world.task import generate_problems

    model, _, tok = tiny_pair
    problems = generate_problems(2, seed=3)
    assert world.solve(model, tok, problems, seed=5) == world.solve(model, tok, problems, seed=5)
    assert world._time_generate(model, world.prompt_ids(tok, problems[0]), 7, seed=1) > 0


@pytest.mark.slow  # 15-60 s: the embedded world's models sampled, timed and judged
def test_the_world_benchmark_quick_run_writes_its_figures(tmp_path):
    """``python -m benchmarks.world --quick`` runs to the end (no test ran it, and it had stopped running) and writes
    the figures its goals read."""
    import json

    out = tmp_path / "world-quick.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.world", "--quick", "--out", str(out)], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["quick"] and got["n_problems"] == 50 and 0 <= got["target"]["accuracy"] <= 1
    assert set(got["goals"]) == {"target_accuracy >= 0.95", "draft_accuracy in [0.40, 0.80]", "cost_ratio <= 0.2",
                                 "judge_accuracy >= 0.95"}


@pytest.mark.parametrize("name", ["compile", "decode", "endpoint", "first_step", "labels", "probe_cost", "real",
                                  "rewrites", "served", "threads", "train", "world"])
def test_every_benchmark_writes_where_out_says(name, monkeypatch, tmp_path):
    """Every benchmark takes ``--out`` from the harness, so a quick run (a test's) can write outside the repository's
    results; without it the figures go to ``benchmarks/results/<name>[-quick].json``."""
    import argparse

    from benchmarks import harness

    seen = {}
    real_parse = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        seen["args"] = real_parse(self, args, namespace)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    module = importlib.import_module(f"benchmarks.{name}")
    required = {"real": ["--probes", "p", "--data-dir", "d"]}.get(name, [])
    with pytest.raises(SystemExit):
        module.main(["--quick", "--out", str(tmp_path / "x.json"), *required])
    assert seen["args"].out == tmp_path / "x.json"
    assert harness.results_path(name, True, seen["args"].out) == tmp_path / "x.json"


@pytest.mark.slow  # train 40 s, compile 60 s on 2 cores
@pytest.mark.parametrize("name", ["train", "compile"])
def test_the_train_and_compile_benchmarks_quick_runs_write_their_figures(name, tmp_path):
    """``python -m benchmarks.train --quick`` and ``benchmarks.compile --quick`` run to the end (no test ran them)
    and write positive timings where ``--out`` says, leaving the committed results alone."""
    import json

    committed = REPO_ROOT / "benchmarks" / "results" / f"{name}-quick.json"
    before = committed.read_bytes() if committed.is_file() else None
    out = tmp_path / f"{name}-quick.json"
    run = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--quick", "--out", str(out)], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(out.read_text())
    if name == "train":
        assert set(got["samples_per_s"]) == {"384", "5120"}
        assert all(v > 0 for row in got["samples_per_s"].values() for v in row.values())
    else:
        assert got["steps"] == 20 and set(got["models"]) == {"target", "draft"}
        assert all(v > 0 for row in got["models"].values() for v in row.values())
    assert (committed.read_bytes() if committed.is_file() else None) == before
