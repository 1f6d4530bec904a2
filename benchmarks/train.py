"""Training throughput end to end (shards -> loader -> step) on this CPU, and whether the loader bounds it.

    python -m benchmarks.train [--quick]

For 384-wide and 5120-wide (the paper's 32B targets) features it measures, in one process each:
- ``loader``: rows/s streaming the shards through ``SemanticProbeDataModule`` alone;
- ``step``: rows/s of ``SemanticProbeModule`` training steps on batches already in memory;
- ``end_to_end``: rows/s of ``Trainer.fit`` reading the shards;
and peak RSS. The loader is the bottleneck when it is slower than the step alone.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from benchmarks import harness
from benchmarks import report as tables
from benchmarks.labels import write_synthetic

_WORKER = r"""
import json, sys, time
import torch, lightning as L
from torch.utils.data import DataLoader
from datamodules.datamodule import SemanticProbeDataModule
from probes.config import ProbeConfig
from probes.module import SemanticProbeModule

torch.set_num_threads(int(sys.argv[3]))
data_dir, batch_size = sys.argv[1], int(sys.argv[2])
dm = SemanticProbeDataModule(data_dir, build=None, roles=["target"], batch_size=batch_size, shuffle_buffer=16384,
                             val_fraction=0.0, test_fraction=0.0)
dm.setup()

def loader_rate():
    t0, n, batches = time.perf_counter(), 0, []
    for b in dm.train_dataloader():
        n += len(b["target"]["label"])
        if len(batches) < 40:
            batches.append(b)
    return n / (time.perf_counter() - t0), n, batches

class EpochTimer(L.Callback):
    # times the training epoch only, not Trainer start-up
    def on_train_epoch_start(self, trainer, module):
        self.t0 = time.perf_counter()
    def on_train_epoch_end(self, trainer, module):
        self.seconds = time.perf_counter() - self.t0

def fit_rate(loader, n_rows):
    module = SemanticProbeModule(ProbeConfig(), ["target"], dm.input_spec)
    timer = EpochTimer()
    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer])
    trainer.fit(module, train_dataloaders=loader)
    return n_rows / timer.seconds

loader_per_s, rows, batches = loader_rate()
in_memory = DataLoader(batches, batch_size=None)
step_per_s = fit_rate(in_memory, sum(len(b["target"]["label"]) for b in batches))
e2e_per_s = fit_rate(dm.train_dataloader(), rows)
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024
print(json.dumps({"rows": rows, "loader": loader_per_s, "step": step_per_s, "end_to_end": e2e_per_s,
                  "peak_rss_mb": hwm}))
"""


def measure(width: int, rows: int, batch_size: int = 128, threads: int = 1) -> dict:
    """Write ``rows`` synthetic rows of ``width`` features and time loader, step and fit in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="train-bench-") as tmp:
        write_synthetic(Path(tmp), rows, width=width, rows_per_shard=max(1024, min(8192, 40_000_000 // (2 * width))))
        res = harness.child_json(_WORKER, [tmp, str(batch_size), str(threads)], threads, "train benchmark worker")
    res["loader_bound"] = res["loader"] < res["step"]
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__, quick="fewer rows (under 3 minutes on 2 cores)", threads=1,
                        threads_help="torch CPU threads (more than the idle cores makes OpenMP spin: 2 threads on a "
                        "busy 2-core machine ran 20x slower)", name="train")
    args = ap.parse_args(argv)
    rows = {384: 20_000, 5120: 6_000} if args.quick else {384: 100_000, 5120: 30_000}
    t0 = time.time()
    by_width = {str(width): measure(width, n, threads=args.threads) for width, n in rows.items()}
    res = {
        "samples_per_s": {w: {k: r[k] for k in ("loader", "step", "end_to_end")} for w, r in by_width.items()},
        "loader_bound": any(r["loader_bound"] for r in by_width.values()),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in by_width.values()),
        "by_width": by_width,
        "probe": "paper MLP d->2048->512->256->1, batch 128, Adam",
        "threads": args.threads,
        "seconds": round(time.time() - t0, 1),
        "date": time.strftime("%Y-%m-%d"),
    }
    bound = (f"loader bound: {res['loader_bound']}  (the loader is the bottleneck when it streams fewer rows/s than "
             f"the step alone trains); peak RSS {res['peak_rss_mb']:.0f} MB")
    harness.write(res, harness.results_path("train", args.quick, args.out), tables.train(res) + "\n\n" + bound)
    return res


if __name__ == "__main__":
    main()
