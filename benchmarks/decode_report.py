"""The decode benchmark's report: its figures as markdown tables, and the accuracy-vs-speedup plot."""

from __future__ import annotations

from pathlib import Path

from benchmarks import batching, harness
from benchmarks import report as tables


def markdown(report: dict) -> str:
    """The report as markdown tables: methods, decisions, phases, probes, sweeps, batch scaling and goals."""
    sections = (_methods_table, _decisions_table, _phases_table, _window_cost_table, _probes_table, _sweep_table,
                _scaling_table, _goals_table)
    return "\n".join(line for section in sections for line in section(report))


def scaling_markdown(report: dict) -> str:
    """The batch-scaling section alone (``--only-batch-scaling``) as markdown: its tables and its goals."""
    return "\n".join(_scaling_table(report) + _goals_table(report))


def _methods_table(report: dict) -> list[str]:
    """One row per method and variant: the headline figures and token-level acceptance where there is one."""
    cols = ("accuracy", "accuracy_delta", "wall_s", "speedup", "step_acceptance", "draft_token_share",
            "target_passes_per_100_tokens", "probe_overhead")
    rows = [[name, *(f"{m[c]:.3f}" if isinstance(m[c], float) else str(m[c]) for c in cols),
             "" if (acc_tok := m.get("mean_accepted_tokens_per_verification")) is None else f"{acc_tok:.2f}"]
            for name, m in report["methods"].items()]
    return [harness.table(["method", *cols, "accepted tokens / verification"], rows)]


def _decisions_table(report: dict) -> list[str]:
    """The oracle-judged decisions of every method that has them."""
    keys = ("right_kept", "wrong_kept", "right_refused", "wrong_refused", "wrong_kept_fast_path")
    rows = [[name, *(str(m["decisions"][k]) for k in keys)]
            for name, m in report["methods"].items() if "decisions" in m]
    return ["", harness.table(["decisions (oracle-judged draft steps)", *keys], rows)]


def _phases_table(report: dict) -> list[str]:
    """Each drafting method's share of wall time per phase and its cost model (none when there are no phases)."""
    if not report.get("phases"):
        return []
    names = ("first_step", "draft", "verify", "probe", "rewrite", "other")
    rows = [[name, *(f"{ph[k] / (sum(ph.values()) or 1.0):.1%}" for k in names),
             f"{c['target_step_over_target_per_token']:.2f}", f"{c['draft_over_target_per_token']:.3f}",
             f"{c['verify_over_target_per_proposal']:.2f}", f"{c['predicted_speedup']:.2f}",
             f"{c['measured_speedup']:.2f}"] for name, ph in report["phases"].items() for c in [report["cost"][name]]]
    return ["", harness.table(["phases (share of wall time)", *names, "target step/target per token",
                               "draft/target per token", "verify/target per proposal", "predicted speedup",
                               "measured"], rows)]


def _window_cost_table(report: dict) -> list[str]:
    """The windows' cost model as docs/benchmarks.md shows it (none when the run had no windowed rows)."""
    return ["", tables.window_costs(report)] if "machine" in (report.get("window_cost") or {}) else []


def _probes_table(report: dict) -> list[str]:
    """Each probe pair's draft-step AUROC (none when no pair was scored)."""
    if not report.get("probes"):
        return []
    rows = [[name, f"{pr['draft_step_auroc']:.4f}", str(pr["n_judged"]), str(pr["n_wrong"])]
            for name, pr in report["probes"].items()]
    return ["", harness.table(["probe pair", "draft-step AUROC", "judged steps", "wrong"], rows)]


def _sweep_table(report: dict) -> list[str]:
    """One row per swept knob value of every method."""
    rows = [[method, str(r["knob"]), str(r["value"]), f"{r['accuracy']:.3f}", f"{r['speedup']:.3f}",
             f"{r['step_acceptance']:.3f}"] for method, sweep in report["sweep"].items() for r in sweep]
    return ["", harness.table(["sweep", "knob", "value", "accuracy", "speedup", "step_acceptance"], rows)]


def _scaling_table(report: dict) -> list[str]:
    """Batch scaling, its cost model and SemanticSpec's phases per size (none when batch scaling was skipped)."""
    return batching.markdown(report.get("batch_scaling") or {})


def _goals_table(report: dict) -> list[str]:
    """Each goal with its measured value and whether it is met."""
    rows = [[name, f"{g['value']:.3f}", "yes" if g["met"] else "**MISSED**"] for name, g in report["goals"].items()]
    return ["", harness.table(["goal", "value", "met"], rows)]


def plot(report: dict, path: Path) -> None:
    """Every method's accuracy against its speedup, and each sweep's curve, as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for name, m in report["methods"].items():
        if name == "hf_target_only":
            continue
        ax.scatter(m["speedup"], m["accuracy"], s=40)
        ax.annotate(name, (m["speedup"], m["accuracy"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    styles = {"semanticspec": "o--", "random_accept": "s:", "oracle_accept": "^-."}
    for method, rows in report["sweep"].items():
        if not rows:
            continue
        ax.plot([r["speedup"] for r in rows], [r["accuracy"] for r in rows], styles.get(method, "o--"),
                alpha=0.7, label=f"{method}: {rows[0]['knob']} sweep")
        for r in rows:
            ax.annotate(str(r["value"]), (r["speedup"], r["accuracy"]), textcoords="offset points", xytext=(4, -10),
                        fontsize=7, color="gray")
    ax.legend(loc="best", fontsize=8)
    ax.set_xlabel("speedup vs target-only (token_sd: vs transformers' target-only)")
    ax.set_ylabel("accuracy")
    ax.set_title(f"Decoding on the embedded world ({report['n_problems']} problems)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
