"""The tables and the plot of an evaluation report (:func:`semanticspec.evaluate.Evaluation.report`): the methods
against target-only, the threshold sweep's accuracy-speedup curve and the rule's pick."""

from __future__ import annotations

import math
from pathlib import Path

METHOD_COLUMNS = ("method", "accuracy [95% CI]", "vs target-only [95% CI]", "speedup", "tokens/s",
                  "step acceptance", "draft token share", "target passes / 100 tokens")
SWEEP_COLUMNS = ("tau", "accuracy [95% CI]", "vs target-only [95% CI]", "speedup", "step acceptance", "reused")


def _ci(value: float, ci: list[float], signed: bool = False) -> str:
    fmt = "{:+.3f}" if signed else "{:.3f}"
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    lo, hi = ci
    return f"{fmt.format(value)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def _table(header, rows) -> str:
    from tabulate import tabulate

    return tabulate(list(rows), list(header), tablefmt="github", disable_numparse=True)


def methods_table(report: dict) -> str:
    """One row per method: accuracy (Wilson 95%), its paired difference from target-only, speedup, and the decode
    figures."""
    rows = []
    for name, m in report["methods"].items():
        rows.append([name, _ci(m["accuracy"], m["accuracy_ci95"]),
                     _ci(m["accuracy_delta"], m["accuracy_delta_ci95"], signed=True), f"{m['speedup']:.2f}x",
                     f"{m['tokens_per_s']:.1f}", f"{m['step_acceptance']:.3f}", f"{m['draft_token_share']:.3f}",
                     f"{m['target_passes_per_100_tokens']:.1f}"])
    return _table(METHOD_COLUMNS, rows)


def sweep_table(report: dict) -> str:
    """The accuracy-speedup curve, one row per threshold; the pick marked."""
    tau = report["pick"]["tau"]
    rows = [[f"{r['threshold']:g}" + (" (pick)" if r["threshold"] == tau else ""),
             _ci(r["accuracy"], r["accuracy_ci95"]), _ci(r["accuracy_delta"], r["accuracy_delta_ci95"], signed=True),
             f"{r['speedup']:.2f}x", f"{r['step_acceptance']:.3f}", f"{r['reused']}/{r['n_problems']}"]
            for r in report["sweep"]]
    return _table(SWEEP_COLUMNS, rows)


def decisions_line(report: dict) -> str:
    """SemanticSpec's decisions on draft steps, judged by the task (empty when the task cannot judge steps)."""
    d = report["methods"].get("semanticspec", {}).get("decisions")
    if not d:
        return ""
    return "SemanticSpec's decisions on draft steps (judged by the task): " + ", ".join(f"{k} {v}" for k, v in
                                                                                    d.items())


def pick_line(report: dict) -> str:
    """The rule and what it picked, with the pick's intervals."""
    p = report["pick"]
    if p["tau"] is None:
        return f"Rule: {p['rule']} ({p['max_accuracy_drop']}): nothing picked ({p['why']})."
    lo, hi = p["accuracy_ci95"]
    dlo, dhi = p["accuracy_delta_ci95"]
    return (f"Pick: tau = {p['tau']:g} ({p['rule']}, max_accuracy_drop {p['max_accuracy_drop']}): accuracy "
            f"{p['accuracy']:.3f} (95% CI [{lo:.3f}, {hi:.3f}]), {p['accuracy_delta']:+.3f} against target-only "
            f"(paired 95% CI [{dlo:+.3f}, {dhi:+.3f}]), speedup {p['speedup']:.2f}x.")


def markdown(report: dict) -> str:
    """The report as markdown: the methods, the sweep, the decisions, the pick and any failures."""
    head = (f"{report['n_evaluated']} of {report['n_problems']} held-out problems (seed {report['seed']}); "
            f"SemanticSpec at tau {report['tau']:g}, shipped window")
    parts = [head, "", methods_table(report), "", "Threshold sweep (SemanticSpec, speedup against target-only):", "",
             sweep_table(report), "", pick_line(report)]
    if line := decisions_line(report):
        parts += ["", line]
    if report["failed"]:
        parts += ["", f"{len(report['failed'])} failed decode(s), left out with their problems: "
                  + "; ".join(f"problem {f['problem']} {f['method']}: {f['reason'][:80]}" for f in report["failed"])]
    return "\n".join(parts)


def plot(report: dict, path: Path) -> Path:
    """The accuracy-speedup curve of the sweep (95% intervals), target-only and token-level SD as points, the pick
    ringed; written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    sweep = report["sweep"]
    xs, ys = [r["speedup"] for r in sweep], [r["accuracy"] for r in sweep]
    err = [[max(0.0, r["accuracy"] - r["accuracy_ci95"][0]) for r in sweep],  # Wilson's bounds can round past p
           [max(0.0, r["accuracy_ci95"][1] - r["accuracy"]) for r in sweep]]
    ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label="SemanticSpec (tau sweep)")
    middle = (min(xs + [1.0]) + max(xs + [1.0])) / 2  # a label right of the middle is written to its point's left
    # labels of points at one accuracy alternate above and below it (two written to the left overlapped)
    for k, ((x, y), taus) in enumerate(sorted(_labels(sweep, near=0.02 * max(xs, default=1.0)).items(),
                                              key=lambda item: (item[0][1], item[0][0]))):
        ax.annotate(", ".join(taus), (x, y), textcoords="offset points", ha="right" if x > middle else "left",
                    xytext=(-6 if x > middle else 4, 4 if k % 2 == 0 else -12), fontsize=8)
    for name, m in report["methods"].items():
        if name in ("target_only", "token_sd"):
            ax.errorbar([m["speedup"]], [m["accuracy"]], yerr=[[max(0.0, m["accuracy"] - m["accuracy_ci95"][0])],
                                                              [max(0.0, m["accuracy_ci95"][1] - m["accuracy"])]],
                        marker="s", capsize=3, linestyle="none", label=name)
    p = report["pick"]
    if p["tau"] is not None:
        ax.scatter([p["speedup"]], [p["accuracy"]], s=200, facecolors="none", edgecolors="red",
                   label=f"pick tau={p['tau']:g}")
    ax.set_xlabel("speedup over target-only (wall time)")
    ax.set_ylabel("accuracy")
    ax.set_title(f"{report['n_evaluated']} held-out problems")
    ax.legend(fontsize=8, loc="lower center")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _labels(sweep: list[dict], near: float) -> dict[tuple[float, float], list[str]]:
    """The sweep's thresholds by the point they are written at: thresholds whose accuracy is the same and whose speedup
    is within ``near`` of the first share one label (they decided alike; single labels overlapped)."""
    out: dict[tuple[float, float], list[str]] = {}
    for r in sweep:
        at = next((k for k in out if k[1] == r["accuracy"] and abs(k[0] - r["speedup"]) <= near),
                  (r["speedup"], r["accuracy"]))
        out.setdefault(at, []).append(f"{r['threshold']:g}")
    return out
