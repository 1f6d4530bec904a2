"""`python -m arithmetic_world.serve`: the one command that starts the world's two servers.

The servers themselves run in the slow README test (tests/test_readme.py::test_readme_serving_section_runs) and in
tests/arithmetic_world/test_served_world.py; these check the command's refusals, which need no llama.cpp, and
(slow) that SIGINT stops it however it was started.
"""

import subprocess

import pytest

from arithmetic_world import serve
from tests.conftest import answers, start_serving


def _refused(capsys, argv):
    with pytest.raises(SystemExit) as e:
        serve.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("argv, message", [
    (["--target_port", "8852"], "--target_port and --draft_port are both 8852: give each server its own port"),
    (["--draft_port", "0"], "--draft_port 0: expected a port from 1 to 65535"),
    (["--threads", "0"], "--threads 0: expected an integer >= 1"),
    (["--target_prot", "1"], "unrecognized arguments: --target_prot 1; did you mean --target_port?"),
])
def test_bad_values_are_refused_in_one_line(capsys, argv, message):
    prog = "python -m arithmetic_world.serve"
    assert _refused(capsys, argv) == f"{prog}: error: {message} (see `{prog} --help`)"


def test_a_missing_server_install_says_how_to_install_it(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(serve, "server_available", lambda: False)
    line = _refused(capsys, ["--log_dir", str(tmp_path / "logs")])
    assert 'pip install -e ".[server]"' in line and "README 'Serving'" in line
    assert not (tmp_path / "logs").exists()  # refused before anything is written


def test_defaults_are_the_ports_the_served_config_builds_against():
    from pathlib import Path

    served = (Path(__file__).resolve().parents[2] / "configs" / "served.yaml").read_text()
    assert all(f"127.0.0.1:{port}" in served for port in serve.PORTS.values())
    assert serve.PORTS == {"target": 8851, "draft": 8852}


def test_a_world_folder_without_models_is_refused_naming_it(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(serve, "server_available", lambda: True)
    pytest.importorskip("gguf")  # the dev extra installs it
    line = _refused(capsys, ["--root", str(tmp_path / "world"), "--log_dir", str(tmp_path / "logs")])
    assert "cannot serve the world's models" in line and str(tmp_path / "world") in line


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["SIGINT", "SIGHUP"])
def test_sigint_stops_both_servers_even_when_started_with_sigint_ignored(tmp_path, stop):
    """A script's `cmd &` starts the command with SIGINT ignored, and Python then installs no KeyboardInterrupt
    handler: the command restores it, so SIGINT (Ctrl-C) still stops both servers and the command exits. SIGHUP (the
    terminal closed) ended the command and left both servers, in their own sessions, holding the ports."""
    import signal

    if not serve.server_available():
        pytest.skip("llama-cpp-python[server] not installed; see README 'Serving'")
    ports = {"target": 8861, "draft": 8862}
    assert not any(answers(p) for p in ports.values())
    proc = start_serving(["--log_dir", str(tmp_path), "--target_port", str(ports["target"]), "--draft_port",
                          str(ports["draft"])], ports.values(),
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        proc.send_signal(getattr(signal, stop))
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and (stop == "SIGHUP" or "stopping both servers" in out), out
        assert not any(answers(p) for p in ports.values())
    finally:
        if proc.poll() is None:  # SIGTERM stops both servers too
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_a_log_dir_that_is_a_file_is_refused_naming_it(capsys, monkeypatch, tmp_path):
    """It ended in a FileExistsError traceback (the folder was made outside the refusals)."""
    monkeypatch.setattr(serve, "server_available", lambda: True)
    pytest.importorskip("gguf")
    (tmp_path / "afile").write_text("")
    line = _refused(capsys, ["--log_dir", str(tmp_path / "afile")])
    assert f"--log_dir {tmp_path / 'afile'}: cannot hold the servers' logs" in line


def test_a_port_another_program_holds_is_refused_naming_the_option(capsys, monkeypatch, tmp_path):
    """It was "llama.cpp server exited with code 3 before it was ready" (the reason only in the server's log)."""
    import socket

    monkeypatch.setattr(serve, "server_available", lambda: True)
    pytest.importorskip("gguf")
    with socket.socket() as held:  # bound, not listening: nothing answers /v1/models there, at once
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        line = _refused(capsys, ["--log_dir", str(tmp_path), "--target_port", str(port)])  # no server starts
    assert f"the target server (--target_port {port}): port {port} on 127.0.0.1 is taken" in line


def test_a_held_draft_port_is_refused_before_the_target_server_starts(capsys, monkeypatch, tmp_path):
    """The target's server started and loaded its model (seconds) before the draft's port was found taken."""
    import socket

    monkeypatch.setattr(serve, "server_available", lambda: True)
    pytest.importorskip("gguf")
    started = []
    monkeypatch.setattr(serve.LlamaServer, "start", lambda self: started.append(self.alias))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        line = _refused(capsys, ["--log_dir", str(tmp_path), "--draft_port", str(port)])
    assert f"the draft server (--draft_port {port}): port {port} on 127.0.0.1 is taken" in line and started == []


def test_a_start_refused_for_a_taken_port_leaves_no_log_folder(capsys, tmp_path):
    """The log folder was made before the ports were checked."""
    import socket

    if not serve.server_available():
        pytest.skip("llama-cpp-python[server] is not installed")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        line = _refused(capsys, ["--log_dir", str(tmp_path / "logs"), "--target_port", str(port),
                                 "--draft_port", str(port + 1 if port < 65535 else port - 1)])
    assert "is taken" in line and not (tmp_path / "logs").exists()


def test_ctrl_c_while_the_gguf_files_are_written_is_one_line(capsys, monkeypatch, tmp_path):
    """Ctrl-C in the first seconds (the world's GGUF files written on first use) was a traceback."""
    monkeypatch.setattr(serve, "server_available", lambda: True)
    pytest.importorskip("gguf")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(serve, "world_server", interrupted)
    with pytest.raises(SystemExit) as e:
        serve.main(["--log_dir", str(tmp_path / "logs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 130 and err == [f"{serve.PROG}: stopped before the servers started; nothing was served"]
    assert not (tmp_path / "logs").exists()
