"""DDP with 2 CPU processes on real shards: the Trainer strategy works unchanged and ranks see disjoint data."""

import json

import lightning as L
import pytest

from datamodules.datamodule import SemanticProbeDataModule
from probes.config import ProbeConfig
from probes.module import SemanticProbeModule
from tests.conftest import WIDTH, make_dataset  # real shard files, ids in feature 0


class DestroyProcessGroup(L.Callback):
    """Joins gloo's threads before a spawned rank exits; left to interpreter exit, a rank sometimes aborts
    with "terminate called without an active exception" after fit has finished."""

    def teardown(self, trainer, pl_module, stage):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


class RecordingModule(SemanticProbeModule):
    """Writes the sample ids (feature 0 of the test shards) each rank trained on to ``out/rank<r>.json``."""

    def __init__(self, out: str, **kw):
        super().__init__(**kw)
        self.out, self.seen = out, []

    def training_step(self, batch, batch_idx):
        for role, part in batch.items():  # a sample is read by the target and by the draft: key by role
            self.seen += [f"{role}:{i}" for i in part["features"][:, 0].long().tolist()]
        return super().training_step(batch, batch_idx)

    def on_train_epoch_end(self):
        with open(f"{self.out}/rank{self.global_rank}.json", "w") as f:
            json.dump(self.seen, f)


@pytest.mark.slow
def test_ddp_two_cpu_processes_see_disjoint_data(tmp_path):
    data_dir = make_dataset(tmp_path / "data", n_shards=4, prefixes_per_shard=6, n=3)
    dm = SemanticProbeDataModule(str(data_dir), build=None, batch_size=8, shuffle_buffer=16, val_fraction=0.0,
                                 test_fraction=0.0)
    module = RecordingModule(str(tmp_path), probe=ProbeConfig(hidden_dims=[8]), roles=["target", "draft"],
                             input_spec=dm.input_spec)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
                        callbacks=[DestroyProcessGroup()])
    trainer.fit(module, datamodule=dm)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert seen[0] and seen[1]
    assert not set(seen[0]) & set(seen[1]), "a row reached both ranks"
    assert len(seen[0]) == len(set(seen[0])) and len(seen[1]) == len(set(seen[1]))
    total = 4 * 6 * (2 * 3 + 3)  # shards x prefixes x (target reads 2n + draft reads n)
    assert len(seen[0]) == len(seen[1]) and len(seen[0]) + len(seen[1]) >= total - 1  # at most one left over
    assert {s.split(":")[0] for s in seen[0] + seen[1]} == set(WIDTH)


class SpecRecorder(L.Callback):
    """Writes the spec/ metrics every rank sees after validation to ``out/spec<r>.json``."""

    def __init__(self, out: str):
        self.out = out

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            seen = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("spec/")}
            with open(f"{self.out}/spec{trainer.global_rank}.json", "w") as f:
                json.dump(seen, f)


@pytest.mark.slow
def test_speculative_validation_runs_once_and_shares_its_figures_under_ddp(tmp_path):
    from callbacks.speculative_validation import SpeculativeValidation
    from datamodules.labels.config import BuildConfig, SamplingConfig
    from datamodules.labels.build import build

    build(BuildConfig(n_problems=8, sampling=SamplingConfig(n_samples=2), shard_size=4), tmp_path / "data")
    dm = SemanticProbeDataModule(str(tmp_path / "data"), build=None, batch_size=32, val_fraction=0.25,
                                 test_fraction=0.0)
    module = SemanticProbeModule(probe=ProbeConfig(hidden_dims=[8]), roles=["target", "draft"],
                                 input_spec=dm.input_spec)
    spec = SpeculativeValidation(max_problems=2, max_seconds=30, max_new_tokens=32, plots_dir=str(tmp_path / "plots"))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[spec, SpecRecorder(str(tmp_path)), DestroyProcessGroup()],
                        default_root_dir=tmp_path)
    trainer.fit(module, datamodule=dm)
    ranks = [json.loads((tmp_path / f"spec{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] and "spec/speedup" in ranks[0] and ranks[0]["spec/problems"] == 2



def _tiny_fit_config(tmp_path, name: str = "tiny", long: bool = False) -> str:
    """The default config, cut to seconds: a 12-problem build (into an empty folder), a 16-wide MLP, 2 epochs, a
    2-problem live validation, batches of 2 rows (so some batch lacks a role on one rank). ``long``: 400 epochs
    without early stopping (a run to interrupt)."""
    import yaml

    from generation.paths import DEFAULT_CONFIG

    cfg = yaml.safe_load(DEFAULT_CONFIG.read_text())
    cfg["data"].update(data_dir=str(tmp_path / "data"), batch_size=2, val_fraction=0.25, test_fraction=0.25,
                       build={"n_problems": 12, "shard_size": 4, "sampling": {"n_samples": 2}})
    cfg["model"]["probe"]["hidden_dims"] = [16]
    cfg["trainer"].update(accelerator="cpu", max_epochs=400 if long else 2, enable_progress_bar=False,
                          default_root_dir=str(tmp_path / "runs"))
    cfg["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "runs")
    callbacks = [c for c in cfg["trainer"]["callbacks"] if not (long and "EarlyStopping" in c["class_path"])]
    for c in callbacks:
        if "SpeculativeValidation" in c["class_path"]:
            c["init_args"].update(max_problems=2, max_seconds=10, max_new_tokens=32, every_n_epochs=1)
    cfg["trainer"]["callbacks"] = callbacks
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.slow  # two processes, a label build and a live validation, then a run interrupted: about 2 minutes
def test_the_fit_command_under_ddp_builds_its_labels_trains_plots_exports_and_resumes_after_ctrl_c(tmp_path):
    """``python -m probes.fit --trainer.devices 2 --trainer.strategy ddp`` as a user runs it: it hung in the label
    build (prepare_data's one process built half the shards and waited for the other rank), then after training in
    the live validation's plots and the default export (rank 0 alone asked trainer.log_dir, a broadcast), and at a
    batch holding no row of a role on one rank (DDP waited for that probe's gradients); Ctrl-C printed 170 lines of
    traceback and exit status 1, not the resume line and 130."""
    import os
    import signal
    import subprocess
    import sys
    import time

    ddp = ["--trainer.devices", "2", "--trainer.strategy", "ddp"]
    cmd = [sys.executable, "-m", "probes.fit", "--config", _tiny_fit_config(tmp_path), *ddp]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    run_dir = tmp_path / "runs" / "fit" / "version_0"
    assert {"config.json", "model.safetensors"} <= {p.name for p in (run_dir / "export" / "target").iterdir()}
    assert (run_dir / "spec" / "history.png").is_file() and run.stdout.count("| probe | mse |") == 1
    # the exported test loss is the MSE loss over both ranks' rows, as the mse metric is (it was rank 0's alone)
    for role in ("target", "draft"):
        tested = json.loads((run_dir / "export" / role / "config.json").read_text())["test_metrics"]
        assert tested["loss"] == pytest.approx(tested["mse"], rel=1e-5), (role, tested)
    longer = [sys.executable, "-m", "probes.fit", "--config", _tiny_fit_config(tmp_path, "long", long=True), *ddp,
              "--export", "false"]
    proc = subprocess.Popen(longer, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while not list((tmp_path / "runs" / "fit" / "version_1").rglob("last.ckpt")) and time.monotonic() < deadline:
        time.sleep(1)
    time.sleep(2)
    os.killpg(os.getpgid(proc.pid), signal.SIGINT)  # Ctrl-C reaches every process of the terminal's group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted; kept" in err and "Resume with:" in err and "Traceback" not in err, err[-3000:]
