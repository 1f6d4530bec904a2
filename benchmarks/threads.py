"""The label build and the fit alone and beside a competing torch process, at the default and at 1 and 2 threads.

    python -m benchmarks.threads [--quick]

Each job runs as its own command (``python -m datamodules.labels.build`` and ``python -m probes.fit``, timed
from the start of their ``main()`` to its end, imports aside) with no thread option or variable (``default``: what
:mod:`generation.threads` chooses inside the command; on 2 cores two threads whose idle wait the command sets
passive before torch loads, so it should match ``2-passive``, the report's ``default_setting``), with ``--threads
1``, and with ``--threads 2`` three ways set by the parent: spinning as libgomp does by default
(``GOMP_SPINCOUNT=300000``, what the CLIs once ran with), passive (``OMP_WAIT_POLICY=PASSIVE``, no spin)
and with a short spin (``GOMP_SPINCOUNT=3000``); each once alone and once beside a competing process: a loop of
float32 matmuls on 2 torch threads (another job on a shared machine). The configurations are interleaved, the order
reversed every other pass, and each figure is the median over passes:

- ``build``: the embedded world's label build into an empty folder (48 problems, shards of 16 prefixes, as in
  the threads figures of docs/benchmarks.md; ``--quick``: 4 problems);
- ``fit``: ``python -m probes.fit`` on shards built once before the timing starts (``--data.build null``):
  4 epochs of training with live speculative validation after each on 8 held-out problems (no time budget, so
  every configuration does the same work; ``--quick``: 1 epoch, 4 problems), no checkpoints, test or export.

A full run takes about 30 minutes on a quiet 2-core machine (two passes; ``--quick``: a few minutes).

Figures per job and thread setting (``default``, ``1``, ``2-libgomp``, ``2-passive``, ``2-spin3000``): ``alone_s``,
``beside_s``, ``slowdown`` (beside / alone) and ``alone_over_torch_default`` (alone / alone at torch's own default,
one thread per core spinning as libgomp does, which is what the CLIs used before the thread policy: the
``2-libgomp`` row on 2 cores). The machine's ``cpu_count`` and load (``uptime_load``, before and after) come with
them: on a loaded machine the figures are rough.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness
from benchmarks import report as tables
from generation.threads import available_cores, resolve_threads

# Times a CLI's main() in its own process (imports aside) and prints the seconds as the last line. The folder it
# runs in goes first on sys.path by its absolute name, as `python -m` puts it: `-c` puts "", which stops naming the
# repository once jsonargparse changes into a --config file's folder to read it (class paths such as
# callbacks.speculative_validation would then not import).
_TIMED = (
    "import importlib, os, sys, time\n"
    "sys.path[0] = os.getcwd()\n"
    "main = importlib.import_module(sys.argv[1]).main\n"
    "t0 = time.perf_counter()\n"
    "main(sys.argv[2:])\n"
    "print(f'\\nSECONDS {time.perf_counter() - t0:.3f}')\n"
)

# The competing job: float32 matmuls on 2 threads until killed; writes its ready file after the first one.
_COMPETITOR = (
    "import sys, pathlib, torch\n"
    "torch.set_num_threads(2)\n"
    "a = torch.randn(int(sys.argv[2]), int(sys.argv[2]))\n"
    "b = a @ a\n"
    "pathlib.Path(sys.argv[1]).write_text('ready')\n"
    "while True:\n"
    "    b = a @ a\n"
)
COMPETITOR_SIZE = 512
"""Side of the competitor's square matmuls."""

SETTINGS = {
    "default": ([], {}),
    "1": (["--threads", "1"], {}),
    "2-libgomp": (["--threads", "2"], {"GOMP_SPINCOUNT": "300000"}),
    "2-passive": (["--threads", "2"], {"OMP_WAIT_POLICY": "PASSIVE"}),
    "2-spin3000": (["--threads", "2"], {"GOMP_SPINCOUNT": "3000"}),
}
"""Thread settings timed, as ``(arguments, environment)``: the CLIs' own default (no ``--threads``, nothing set:
the count and wait policy :mod:`generation.threads` chooses in the command itself), one thread, and two threads
that spin as libgomp does when nothing is set (300000 spins: torch's own behaviour, what the CLIs ran before issue
36), never spin (passive, set by the parent before torch loads), or spin 3000 times before they sleep."""


def default_setting() -> str:
    """The row of :data:`SETTINGS` the CLIs' default should match (its count, passive beyond one thread): the
    ``default`` row measures whether the command's own setting takes effect as the parent's does."""
    n = resolve_threads(None, env=child_env())[0]
    return "1" if n == 1 else f"{n}-passive"


THREAD_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
"""Variables of the thread policy, left out of the jobs' environment so that each setting says all of it."""


def child_env() -> dict[str, str]:
    """The jobs' environment: this one less :data:`THREAD_VARIABLES`, so ``1`` times the package's default
    (and the competitor runs as torch does when nothing is set)."""
    return {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}


def torch_default_threads() -> int:
    """Torch's own thread count in a fresh process with no setting (what the CLIs once used)."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=child_env(),
                         capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


class Competitor:
    """A competing 2-thread torch process, running from ``__enter__`` (once it is busy) to ``__exit__``."""

    def __init__(self, folder: Path) -> None:
        self.ready = folder / "competitor.ready"

    def __enter__(self) -> Competitor:
        self.ready.unlink(missing_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-c", _COMPETITOR, str(self.ready), str(COMPETITOR_SIZE)],
                                     env=child_env())
        while not self.ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the competing process exited with status {self.proc.returncode}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait()


def timed(module: str, args: list[str], log: Path, env: dict[str, str] | None = None) -> float:
    """Run ``module``'s ``main(args)`` in a fresh process (``env``: :func:`child_env`); its seconds (output
    appended to ``log``)."""
    with log.open("a") as f:
        f.write(f"\n$ python -m {module} {' '.join(args)}\n")
        f.flush()
        out = subprocess.run([sys.executable, "-c", _TIMED, module, *args], env=env or child_env(),
                             stdout=subprocess.PIPE,
                             stderr=f, text=True)
        f.write(out.stdout)
    if out.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise RuntimeError(f"python -m {module} {' '.join(args)} exited with status {out.returncode}; the end of "
                           f"its log:\n{tail}")
    return float(out.stdout.rsplit("SECONDS", 1)[1])


def build_args(data_dir: Path, quick: bool) -> list[str]:
    """The threads benchmark's label build (48 problems, shards of 16 prefixes); 4 problems with ``--quick``."""
    return ["--data_dir", str(data_dir), "--build.n_problems", "4" if quick else "48", "--build.shard_size", "16"]


def fit_config(folder: Path, data_dir: Path, quick: bool) -> Path:
    """A YAML over configs/arithmetic.yaml: fixed work (epochs, live problems), nothing kept after training."""
    epochs, problems = (1, 4) if quick else (4, 8)
    text = f"""\
trainer:
  max_epochs: {epochs}
  default_root_dir: {folder / "runs"}
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  num_sanity_val_steps: 0
  callbacks:
    - class_path: callbacks.speculative_validation.SpeculativeValidation
      init_args:
        max_problems: {problems}
        max_seconds: 1.0e9
        every_n_epochs: 1
data:
  data_dir: {data_dir}
  build: null
  val_fraction: {0.5 if quick else 0.25}   # live validation runs on epochs that have a val split
test: false
export: false
"""
    path = folder / "fit.yaml"
    path.write_text(text)
    return path


def run_pass(order: list[tuple[str, str, bool]], folder: Path, quick: bool, fit_yaml: Path,
             times: dict[tuple[str, str, bool], list[float]]) -> None:
    """Time each ``(job, setting, beside)`` of ``order`` once, appending the seconds to ``times``."""
    log = folder / "jobs.log"
    for job, setting, beside in order:
        if job == "build":
            out = folder / f"build-{len(times.get((job, setting, beside), []))}-{setting}-{int(beside)}"
            args = build_args(out, quick) + SETTINGS[setting][0]
            module = "datamodules.labels.build"
        else:
            args = ["--config", "configs/arithmetic.yaml", "--config", str(fit_yaml)] + SETTINGS[setting][0]
            module = "probes.fit"
        with Competitor(folder) if beside else contextlib.nullcontext():
            seconds = timed(module, args, log, {**child_env(), **SETTINGS[setting][1]})
        times.setdefault((job, setting, beside), []).append(seconds)
        print(f"{job:5s} threads={setting:9s} {'beside' if beside else 'alone '}: {seconds:7.1f} s", flush=True)


def figures(times: dict[tuple[str, str, bool], list[float]], torch_default: int) -> dict:
    """``{job: {setting: {alone_s, beside_s, slowdown, alone_over_torch_default}}}`` from the medians."""
    out: dict = {}
    for job in ("build", "fit"):
        rows: dict = {}
        for s in SETTINGS:
            alone, beside = statistics.median(times[(job, s, False)]), statistics.median(times[(job, s, True)])
            rows[s] = {"alone_s": round(alone, 2), "beside_s": round(beside, 2), "slowdown": round(beside / alone, 3),
                       "passes": len(times[(job, s, False)])}
        ref = rows.get(f"{torch_default}-libgomp")
        for s in SETTINGS:
            rows[s]["alone_over_torch_default"] = round(rows[s]["alone_s"] / ref["alone_s"], 3) if ref else None
        out[job] = rows
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__, quick="4-problem build, 1-epoch fit on 4 live problems, one pass; "
                        "writes threads-quick.json", name="threads")
    ap.add_argument("--passes", type=harness.count, default=None,
                    help="passes over every configuration (default 2, quick 1)")
    args = ap.parse_args(argv)
    passes = args.passes or (1 if args.quick else 2)
    load_before = [round(x, 2) for x in os.getloadavg()]
    torch_default = torch_default_threads()
    configs = [(job, s, beside) for s in SETTINGS for beside in (False, True) for job in ("build", "fit")]
    times: dict = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="threads-bench-") as tmp:
        folder = Path(tmp)
        fit_data = folder / "fit-data"
        print(f"building the fit's shards once (untimed) in {fit_data}", flush=True)
        timed("datamodules.labels.build", build_args(fit_data, args.quick), folder / "jobs.log")
        fit_yaml = fit_config(folder, fit_data, args.quick)
        for i in range(passes):
            run_pass(configs if i % 2 == 0 else configs[::-1], folder, args.quick, fit_yaml, times)
    report = {"default_setting": default_setting(), "torch_default_threads": torch_default,
              "cpu_count": available_cores(),
              "competitor": {"threads": 2, "matmul_size": COMPETITOR_SIZE}, "uptime_load": load_before,
              "uptime_load_after": [round(x, 2) for x in os.getloadavg()], "passes": passes,
              "seconds": round(time.perf_counter() - t0, 1), "quick": args.quick,
              **figures(times, torch_default)}
    harness.write(report, harness.results_path("threads", args.quick, args.out),
                  f"{tables.threads(report)}\n\nthe default should match {report['default_setting']}")
    return report


if __name__ == "__main__":
    main()
