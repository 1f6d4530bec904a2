"""Label pipeline benchmark on the embedded world: label quality against the oracle, cost, storage, streaming.

    python -m benchmarks.labels [--quick]      # SEMANTICSPEC_WORLD=/tmp/world to use other world models
    python -m benchmarks.labels --only backends  # just the sampling backends on the real pair
    python -m benchmarks.labels --only world     # everything but the backends (no llama.cpp server needed)

Measures (docs/design.md "Benchmark figures" -> labels.json):
- ``ari``: adjusted Rand index of the pipeline's groups vs the oracle's meanings, mean over prefixes
  (goal >= 0.9); ``ari_hdbscan_only`` and ``ari_judge_only`` regroup the same samples without the
  judge or without HDBSCAN;
- ``ari_oracle_judge``: the same pipeline with the oracle as its judge (audit only: what a perfect
  judge would give, so judge quality and pipeline logic can be told apart);
- ``judge_accuracy``: share of the pairs the judge was asked that it answered as the oracle does;
- ``q_mae`` / ``p_mae``: mean absolute error of the labels vs labels from oracle groups (goal <= 0.05);
- ``audit.<target|draft>.<right|wrong>``: per writer and oracle correctness (a sample is right when
  its meaning is the reference step's), the mean label q, the mean oracle q (share of the target's
  samples with its meaning) and ``false_high_share`` (label q >= 0.5 where the oracle q < 0.5; goal
  for wrong draft steps < 10%); ``variants`` regroups with ``match_numbers`` off to show
  what the numbers check changes;
- ``seconds_per_stage`` of the default build and the share of clustering + judge (goal <= 25%);
- ``bytes_per_sample`` on disk;
- ``backends``: sampling with ``hf`` against the ``openai`` backend on a local llama.cpp server, on the
  real pair (:mod:`benchmarks.backends`: sampler over bare-loop throughput, builds' seconds per stage,
  samples per second, reading share, greedy agreement); ``--only backends`` refreshes just this part;
- ``read_samples_per_s`` streaming 384-wide synthetic shards through the DataModule (goal >= 200k/s)
  and ``peak_rss_mb`` at 1x and 10x data (flat = memory independent of dataset size).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.metrics import adjusted_rand_score

from benchmarks import backends, harness
from datamodules.labels import shards as S
from arithmetic_world.task import meaning
from datamodules.labels.config import BuildConfig
from datamodules.labels.build import build
from datamodules.labels.shard import make_judge
from datamodules.labels.clustering import group_prefixes, normalize_text
from datamodules.labels.judges import OracleJudge
from datamodules.labels.shares import TARGET, joint_labels
from generation.paths import portable_paths
from generation.steps import split_steps


def oracle_key(text: str) -> str:
    """The oracle's meaning of a step; malformed steps mean only themselves."""
    m = meaning(text)
    return str(tuple(m)) if m is not None else "malformed:" + normalize_text(text)


def load_prefixes(data_dir: Path, problems: list[dict] | None = None) -> list[dict]:
    """Per prefix: texts, writers, groups, q, p and the target's features of its 2N samples.

    With ``problems`` (the build's, as :meth:`~datamodules.tasks.base.Task.problems` gives them) each
    prefix also gets ``reference``: the reference trace's step that follows it.
    """
    out = []
    manifest = S.read_manifest(data_dir)
    for entry in manifest["shards"]:
        recs = [json.loads(line) for line in (data_dir / entry["steps_file"]).read_text().splitlines()]
        t = S.read_shard(data_dir / entry["file"], ["target.features", "target.sample_id"])
        row_of = {int(s): i for i, s in enumerate(t["target.sample_id"])}
        for rec in recs:
            samples = rec["samples"]
            rows = [row_of[s["sample_id"]] for s in samples]
            ref = split_steps(problems[rec["problem_id"]]["trace"])[rec["step_index"]] if problems else None
            out.append({"texts": [s["text"] for s in samples], "writers": np.array([s["writer"] for s in samples]),
                        "groups": np.array([s["group"] for s in samples]), "q": np.array([s["q"] for s in samples]),
                        "p": np.array([s["p"] for s in samples]),
                        "features": t["target.features"][rows].float().numpy(),
                        "reference": ref})
    return out


def audit(prefixes: list[dict], groups: list[np.ndarray]) -> dict:
    """ARI and label errors of ``groups`` against the oracle's meanings."""
    aris, q_err, p_err = [], [], []
    for pre, g in zip(prefixes, groups):
        truth = [oracle_key(t) for t in pre["texts"]]
        aris.append(adjusted_rand_score(truth, g))
        codes = np.unique(truth, return_inverse=True)[1]
        ours, oracle = joint_labels(np.asarray(g), pre["writers"]), joint_labels(codes, pre["writers"])
        q_err.append(np.abs(ours["q"] - oracle["q"]))
        p_err.append(np.abs(ours["p"] - oracle["p"]))
    return {"ari": float(np.mean(aris)), "q_mae": float(np.concatenate(q_err).mean()),
            "p_mae": float(np.concatenate(p_err).mean()), "n_prefixes": len(prefixes)}


def label_audit(prefixes: list[dict], groups: list[np.ndarray]) -> dict:
    """Label q against the oracle per writer x correctness: ``{writer: {right|wrong: {n, mean_label_q,
    mean_oracle_q, false_high_share}}}`` (needs ``reference`` in ``prefixes``)."""
    cells: dict[tuple[int, bool], list[tuple[float, float]]] = {}
    for pre, g in zip(prefixes, groups):
        truth = [oracle_key(t) for t in pre["texts"]]
        ref = oracle_key(pre["reference"])
        q = joint_labels(np.asarray(g), pre["writers"])["q"]
        target_keys = [k for k, w in zip(truth, pre["writers"]) if w == TARGET]
        for key, w, label in zip(truth, pre["writers"], q):
            oracle_q = sum(k == key for k in target_keys) / max(len(target_keys), 1)
            cells.setdefault((int(w), key == ref), []).append((float(label), oracle_q))
    out: dict = {}
    for (w, right), v in sorted(cells.items()):
        a = np.array(v)
        out.setdefault("target" if w == TARGET else "draft", {})["right" if right else "wrong"] = {
            "n": len(a), "mean_label_q": float(a[:, 0].mean()), "mean_oracle_q": float(a[:, 1].mean()),
            "false_high_share": float(((a[:, 0] >= 0.5) & (a[:, 1] < 0.5)).mean())}
    return out


def judge_accuracy(asked: list) -> float:
    """Share of judged pairs answered as the oracle does."""
    if not asked:
        return float("nan")
    return float(np.mean([same == (oracle_key(a) == oracle_key(b)) for a, b, same in asked]))


def variants(config: BuildConfig, prefixes: list[dict]) -> dict:
    """Regroup the built samples with each clustering method (same judge, no disk cache)."""
    out = {}
    base = config.clustering
    batch = [(p["texts"], p["features"]) for p in prefixes]
    runs = {"hdbscan+judge": ("hdbscan+judge", make_judge(config)), "hdbscan": ("hdbscan", None),
            "judge": ("judge", make_judge(config)),
            "hdbscan+judge, match_numbers off": ("hdbscan+judge", make_judge(config)),
            # audit only: the same pipeline with the exact oracle as its judge, an upper bound for any judge
            "hdbscan+oracle_judge": ("hdbscan+judge", OracleJudge())}
    for name, (method, judge) in runs.items():
        asked: list = []
        t0 = time.perf_counter()
        cc = dataclasses.replace(base, method=method,
                                 match_numbers=base.match_numbers and "match_numbers off" not in name)
        groups = group_prefixes(batch, judge, cc, asked)
        res = audit(prefixes, groups)
        if prefixes and prefixes[0].get("reference") is not None:
            wrong = label_audit(prefixes, groups).get("draft", {}).get("wrong", {})
            res["draft_wrong_false_high_share"] = wrong.get("false_high_share", float("nan"))
        res.update(seconds=round(time.perf_counter() - t0, 2), judge_pairs=len(asked),
                   judge_accuracy=judge_accuracy(asked))
        out[name] = res
    return out


# ---- streaming read ------------------------------------------------------------------------


def write_synthetic(d: Path, rows: int, width: int = 384, rows_per_shard: int = 8192, seed: int = 0) -> None:
    """Shards of one role shaped like a build's (fp16 features, labels, ids) and their manifest."""
    g = torch.Generator().manual_seed(seed)

    def shards():  # one at a time: the 10x set does not fit in memory at once
        for start in range(0, rows, rows_per_shard):
            n = min(rows_per_shard, rows - start)
            ids = torch.arange(start, start + n)
            yield {"target.features": torch.randn(n, width, generator=g).half(),
                   "target.label": torch.rand(n, generator=g),
                   "target.q": torch.rand(n), "target.p": torch.rand(n),
                   "target.writer": torch.zeros(n, dtype=torch.int8),
                   "target.problem_id": ids // 64, "target.prefix_id": ids // 16, "target.sample_id": ids,
                   "target.group_id": torch.zeros(n, dtype=torch.int32), "target.group_entropy": torch.zeros(n)}

    reads = {"target": {"name_or_path": "synthetic", "architecture": "none", "hidden_size": width, "num_layers": 1,
                        "vocab_size": 1}}
    S.write_dataset(d, shards(),
                    {"reads": reads, "layer_ids": [-1], "pooling": "mean", "delimiters": ["\n\n"], "labels": {}})


_READER = """
import json, sys, time
from datamodules.datamodule import SemanticProbeDataModule
base = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
dm = SemanticProbeDataModule(sys.argv[1], build=None, roles=["target"], batch_size=int(sys.argv[2]),
                             shuffle_buffer=16384, val_fraction=0.0, test_fraction=0.0)
t0 = time.perf_counter()
dm.setup()  # checksums and a finiteness scan of every shard
setup_s = time.perf_counter() - t0
loader = dm.train_dataloader()
t0, n = time.perf_counter(), 0
for batch in loader:
    n += len(batch["target"]["label"])
dt = time.perf_counter() - t0
# VmHWM: this process's own peak RSS (ru_maxrss would carry the parent's peak across fork + exec)
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024
print(json.dumps({"rows": n, "seconds": dt, "rows_per_s": n / dt, "peak_rss_mb": hwm, "setup_seconds": setup_s,
                  "import_rss_mb": base}))
"""


def read_benchmark(rows: int, batch_size: int = 128) -> dict:
    """Stream ``rows`` synthetic 384-wide rows in a fresh process; rows/s and its peak RSS."""
    with tempfile.TemporaryDirectory(prefix="labels-read-") as tmp:
        write_synthetic(Path(tmp), rows)
        return harness.child_json(_READER, [tmp, str(batch_size)], 1, "read benchmark")


# ---- main ----------------------------------------------------------------------------------


def run(quick: bool, with_backends: bool = True) -> dict:
    config = BuildConfig(n_problems=30) if quick else BuildConfig()
    with tempfile.TemporaryDirectory(prefix="labels-build-") as tmp:
        t0 = time.perf_counter()
        manifest = build(config, tmp)
        build_s = time.perf_counter() - t0
        prefixes = load_prefixes(Path(tmp), config.resolved_task().problems(config.n_problems, config.task_seed))
        built = audit(prefixes, [p["groups"] for p in prefixes])
        label_rows = label_audit(prefixes, [p["groups"] for p in prefixes])
        var = variants(config, prefixes)
        shard_bytes = sum(s["bytes"] for s in manifest["shards"])
        rows = sum(r["rows"] for r in manifest["roles"].values())
        feature_bytes = sum(2 * r["width"] * r["rows"] for r in manifest["roles"].values())
    stages = manifest["stats"]["seconds_per_stage"]
    share = (stages.get("clustering", 0) + stages.get("judge", 0)) / build_s
    small, big = (20_000, 200_000) if quick else (100_000, 1_000_000)
    r1, r10 = read_benchmark(small), read_benchmark(big)
    return {
        "ari": built["ari"],
        "judge_accuracy": var["hdbscan+judge"]["judge_accuracy"],
        "q_mae": built["q_mae"],
        "p_mae": built["p_mae"],
        "ari_hdbscan_only": var["hdbscan"]["ari"],
        "ari_judge_only": var["judge"]["ari"],
        "ari_oracle_judge": var["hdbscan+oracle_judge"]["ari"],
        "seconds_per_stage": stages,
        "build_seconds": round(build_s, 2),
        "clustering_judge_share": round(share, 3),
        "bytes_per_sample": round(shard_bytes / rows, 1),
        "feature_bytes_per_sample": round(feature_bytes / rows, 1),
        "overhead_bytes_per_sample": round((shard_bytes - feature_bytes) / rows, 1),
        "read_samples_per_s": round(r10["rows_per_s"]),
        "read_samples_per_s_1x": round(r1["rows_per_s"]),
        "peak_rss_mb": {"1x": round(r1["peak_rss_mb"], 1), "10x": round(r10["peak_rss_mb"], 1)},
        "read_rows": {"1x": small, "10x": big},
        "import_rss_mb": round(r1["import_rss_mb"], 1),
        "read_setup_seconds": {"1x": round(r1["setup_seconds"], 2), "10x": round(r10["setup_seconds"], 2)},
        "audit": label_rows,
        "variants": var,
        "build": {"n_problems": config.n_problems, "n_prefixes": manifest["n_prefixes"],
                  "n_samples": config.sampling.n_samples,
                  "rows": {r: v["rows"] for r, v in manifest["roles"].items()},
                  "judge": manifest["build"]["labels"]["judge"]["kind"],
                  "this_run": manifest["stats"]["this_run"], "world": portable_paths(str(config.model_path("target")))},
        **({"backends": backends.run(quick)} if with_backends else {}),
        "quick": quick,
    }


def _goal(ok: bool) -> str:
    return "met" if ok else "MISSED"


def table(res: dict) -> str:
    st, rss, rows_read = res["seconds_per_stage"], res["peak_rss_mb"], res["read_rows"]
    metrics = [
        ["ARI vs oracle (HDBSCAN + judge)", f"{res['ari']:.3f}", f">= 0.9 {_goal(res['ari'] >= 0.9)}"],
        ["ARI HDBSCAN only", f"{res['ari_hdbscan_only']:.3f}", ""],
        ["ARI judge only", f"{res['ari_judge_only']:.3f}", ""],
        ["ARI with the oracle as judge (audit: bound for a perfect judge)", f"{res['ari_oracle_judge']:.3f}", ""],
        ["judge accuracy on asked pairs", f"{res['judge_accuracy']:.3f}", ""],
        ["q MAE vs oracle groups", f"{res['q_mae']:.4f}", f"<= 0.05 {_goal(res['q_mae'] <= 0.05)}"],
        ["p MAE vs oracle groups", f"{res['p_mae']:.4f}", f"<= 0.05 {_goal(res['p_mae'] <= 0.05)}"],
        ["build seconds", f"{res['build_seconds']:.1f}", f"<= 180 {_goal(res['build_seconds'] <= 180)}"],
        ["seconds per stage", ", ".join(f"{k} {v:.1f}" for k, v in st.items()), ""],
        ["clustering + judge share", f"{res['clustering_judge_share']:.1%}",
         f"<= 25% {_goal(res['clustering_judge_share'] <= 0.25)}"],
        ["bytes per sample (features + overhead)", f"{res['bytes_per_sample']:.0f} "
         f"({res['feature_bytes_per_sample']:.0f} + {res['overhead_bytes_per_sample']:.0f})",
         "2 B/feature/layer + fixed"],
        ["streaming read, 384-wide, samples/s", f"{res['read_samples_per_s']:,}",
         f">= 200,000 {_goal(res['read_samples_per_s'] >= 200_000)}"],
        ["peak RSS MB at 1x / 10x rows", f"{rss['1x']:.0f} / {rss['10x']:.0f} ({rows_read['1x']:,} / "
         f"{rows_read['10x']:,} rows; {res['import_rss_mb']:.0f} after imports)", "flat"],
    ]
    audit = [[f"{writer}, {kind}", str(c["n"]), f"{c['mean_label_q']:.3f}", f"{c['mean_oracle_q']:.3f}",
              f"{c['false_high_share']:.1%}",
              f"< 10% {_goal(c['false_high_share'] < 0.10)}" if (writer, kind) == ("draft", "wrong") else ""]
             for writer, cells in res["audit"].items() for kind, c in cells.items()]
    groupings = [[name, f"{v['ari']:.3f}", f"{v['q_mae']:.4f}", f"{v['p_mae']:.4f}",
                  f"{v.get('draft_wrong_false_high_share', float('nan')):.1%}", str(v["judge_pairs"]),
                  f"{v['judge_accuracy']:.3f}", f"{v['seconds']:.1f}"] for name, v in res["variants"].items()]
    lines = [harness.table(["metric", "value", "goal"], metrics), "",
             harness.table(["label audit: writer, oracle", "rows", "mean label q", "mean oracle q",
                            "false-high share", "goal"], audit), "",
             harness.table(["grouping", "ARI", "q MAE", "p MAE", "wrong draft false-high", "judge pairs",
                            "judge accuracy", "seconds"], groupings)]
    if "backends" in res:
        lines += ["", backends_table(res["backends"])]
    return "\n".join(lines)


def backends_table(b: dict) -> str:
    """The sampling backends' figures (:mod:`benchmarks.backends`) as markdown."""
    if "skipped" in b:
        return f"sampling backends: skipped ({b['skipped']})"
    o = b["overhead"]

    def ok(good):
        return "(met)" if good else "(missed)"
    rows = [[f"openai sampler over a bare loop, same {o['requests_per_round']} requests x {o['rounds']}",
             f"{o['sampler_over_bare']:.2f} ({o['sampler_tokens_per_s']:.1f} vs {o['bare_tokens_per_s']:.1f} tok/s)",
             f">= 0.9 {ok(o['sampler_over_bare'] >= 0.9)}"]]
    for name, v in b["builds"].items():
        rows += [[f"build with {name}: {v['samples']} samples in {v['seconds']:.1f} s, {v['samples_per_s']:.2f} "
                  "samples/s sampling; reading share", f"{v['reading_share']:.1%}",
                  f"<= 30% {ok(v['reading_share'] <= 0.3)}" if name == "openai" else ""],
                 [f"build with {name}: seconds per stage",
                  ", ".join(f"{k} {x:.1f}" for k, x in v["seconds_per_stage"].items()), ""]]
    rows += [[f"greedy step agreement, server vs hf, {role}", f"{g['equal']}/{g['prefixes']} ({g['share']:.0%})",
              "reported"] for role, g in b["greedy_agreement"].items()]
    return harness.table(["sampling backends, real pair", "value", "goal"], rows)


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__, quick="a reduced run (about 6 minutes on 2 CPU cores, 2 of them the real pair's "
                        "build through llama.cpp)", name="labels", threads=1)
    ap.add_argument("--only", choices=["backends", "world"], default=None,
                    help="measure only this part and update it in the existing JSON (backends: hf vs a llama.cpp "
                    "server; world: everything else, on the embedded world, keeping the stored backends figures)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = harness.results_path("labels", args.quick, args.out)
    stored = json.loads(path.read_text()) if args.only and path.is_file() else {"quick": args.quick}
    if args.only == "backends":
        res = {**stored, "backends": backends.run(args.quick)}
        shown = backends_table(res["backends"])
    else:
        res = run(args.quick, with_backends=args.only is None)
        if args.only == "world" and "backends" in stored:  # keep the stored backends figures
            res["backends"] = stored["backends"]
        shown = table(res)
    harness.write(res, path, shown)
    return res


if __name__ == "__main__":
    main()
