"""The thread policy (generation/threads.py) and its ``--threads`` option on the fit and the build."""

import os
import sys
from pathlib import Path

import pytest
import torch

from generation import threads as T

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_the_default_is_one_thread_per_core_on_a_host_alone():
    assert T.DEFAULT_THREADS is None  # measured: two passive threads on 2 cores (docs/benchmarks.md "Threads")
    assert T.resolve_threads(None, cpu_count=2, env={}) == (2, "default: 2 cores")
    assert T.resolve_threads(None, cpu_count=64, env={})[0] == 64


def test_an_explicit_value_wins_over_the_environment_and_the_default():
    assert T.resolve_threads(3, cpu_count=2, env={"OMP_NUM_THREADS": "1"}) == (3, "--threads")
    assert T.resolve_threads(None, cpu_count=2, env={"OMP_NUM_THREADS": "2"}) == (2, "OMP_NUM_THREADS")


def test_ranks_on_one_host_divide_its_cores(monkeypatch):
    monkeypatch.setattr(T, "DEFAULT_THREADS", 8)
    assert T.resolve_threads(None, ranks=1, cpu_count=8, env={})[0] == 8
    assert T.resolve_threads(None, ranks=4, cpu_count=8, env={})[0] == 2
    assert T.resolve_threads(None, ranks=3, cpu_count=8, env={})[0] == 2
    assert T.resolve_threads(None, ranks=16, cpu_count=8, env={})[0] == 1  # never below one


def test_ranks_come_from_torchrun_or_from_the_processes_the_fit_launches():
    assert T.local_ranks({"LOCAL_WORLD_SIZE": "4"}, launched=2) == 4  # torchrun's count wins
    assert T.local_ranks({}, launched=2) == 2
    assert T.local_ranks({}) == 1
    devices = (1, 4, -1, "auto", "3", "0,1", [0, 1, 2], None)
    assert [T.launched_processes(d) for d in devices] == [1, 4, 1, 1, 3, 2, 3, 1]


@pytest.mark.parametrize("bad", [0, -2, "abc", "0", 1.5, True, ""])
def test_bad_values_are_refused_naming_them(bad):
    with pytest.raises(ValueError, match=f"--threads {bad!r}: expected a whole number of threads >= 1"):
        T.check_threads(bad)


def test_a_bad_environment_value_is_refused_naming_the_variable():
    with pytest.raises(ValueError, match="OMP_NUM_THREADS '-1'"):
        T.resolve_threads(None, env={"OMP_NUM_THREADS": "-1"})
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE 'x'"):
        T.local_ranks({"LOCAL_WORLD_SIZE": "x"})


def test_apply_sets_torch_and_says_what_it_chose(keep_threads):
    said = []
    assert T.apply_threads(2, log=said.append, env={}) == 2
    assert torch.get_num_threads() == 2
    assert said == ["torch threads: 2 per process (--threads; set with --threads N), idle threads: libgomp's "
                    "default spin"]
    T.apply_threads(None, log=said.append, env={"LOCAL_RANK": "1"})  # other local ranks stay quiet
    assert torch.get_num_threads() == T.resolve_threads(None, env={})[0] and len(said) == 1
    T.apply_threads(1, log=said.append, env={"GOMP_SPINCOUNT": "3000"})
    assert said[-1].endswith("idle threads: GOMP_SPINCOUNT=3000")


def test_the_wait_policy_is_set_before_torch_loads_and_never_over_a_users_choice(monkeypatch):
    env = {}
    assert T.set_wait_policy(env) is False and env == {}  # torch is loaded in this process: too late, skipped
    monkeypatch.delitem(sys.modules, "torch")  # as a command's main() sees it, before its first torch import
    assert T.set_wait_policy(env) is True and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    for users in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "100"}):
        env = dict(users)
        assert T.set_wait_policy(env) is False and env == users


def test_the_commands_set_the_wait_policy_before_torch_loads():
    """In a fresh process, the fit's and the build's main() leave OMP_WAIT_POLICY=PASSIVE in the environment libgomp
    reads when torch loads (here: --help, which loads no torch); a variable the user set stands."""
    import subprocess

    code = ("import importlib, os, sys\nsys.path[0] = os.getcwd()\n"
            "main = importlib.import_module(sys.argv[1]).main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('POLICY', os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)\n")
    for module in ("probes.fit", "datamodules.labels.build"):
        for env, want in (({}, "PASSIVE"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE")):
            clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
            out = subprocess.run([sys.executable, "-c", code, module], capture_output=True, text=True, cwd=ROOT,
                                 env={**clean, **env}, timeout=300).stdout
            assert out.strip().splitlines()[-1] == f"POLICY {want} False", (module, env, out[-300:])


def _one_line_refusal(capsys, main, args) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("value", ["0", "-1", "abc", "1.5"])
def test_the_build_cli_refuses_a_bad_thread_count_in_one_line(capsys, tmp_path, value):
    from datamodules.labels.build import main

    err = _one_line_refusal(capsys, main, ["--data_dir", str(tmp_path / "d"), "--threads", value])
    assert "threads" in err and value in err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("value", ["0", "-1", "abc"])
def test_the_fit_cli_refuses_a_bad_thread_count_in_one_line(capsys, tmp_path, value):
    from probes.fit import main

    err = _one_line_refusal(capsys, main, ["--threads", value, "--trainer.default_root_dir", str(tmp_path)])
    assert "threads" in err and value in err


def test_the_fit_cli_sets_the_thread_count_before_building_anything(capsys, tmp_path, keep_threads):
    from probes.fit import main

    # --trainer.max_epochs 0 is refused after the thread count is applied and before any class is built
    with pytest.raises(SystemExit):
        main(["--threads", "2", "--trainer.max_epochs", "0", "--trainer.default_root_dir", str(tmp_path)])
    assert torch.get_num_threads() == 2
    assert "torch threads: 2 per process (--threads" in capsys.readouterr().out


def test_help_documents_the_option(capsys):
    from datamodules.labels.build import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--threads" in capsys.readouterr().out
