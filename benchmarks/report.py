"""Write the tables of measured figures into docs/benchmarks.md and the README from ``benchmarks/results/*.json``.

::

    python -m benchmarks.report            # rewrite every generated table in place
    python -m benchmarks.report --check    # exit 1, naming the stale tables, when a page is out of date

A generated table sits between ``<!-- report:NAME -->`` and ``<!-- /report:NAME -->``; the text around the
markers is hand-written and kept as it is. A benchmark run rewrites its JSON; this command then brings the pages
up to date, and ``tests/benchmarks/test_report.py`` fails while they are not.
"""

from __future__ import annotations

import json
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import Callable

from benchmarks import harness
from benchmarks.harness import table

ROOT = harness.REPO
RESULTS = harness.RESULTS_DIR
PAGES = (ROOT / "docs" / "benchmarks.md", ROOT / "README.md")
"""The pages whose ``report:`` blocks this module writes."""
BLOCK = re.compile(r"(<!-- report:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /report:(?P=name) -->)", re.S)

DECODE_METHODS = {
    "target_only": "target only",
    "semanticspec": "**SemanticSpec** (the defaults: hybrid probes, threshold 0.5, gated top-1 fast path, float16 "
                    "MLPs; the draft writes the first step, token-level SD in the target's steps, refused steps "
                    "rewritten in the rounds)",
    "semanticspec[no_fast_path]": "SemanticSpec, the probes alone (no fast path)",
    "semanticspec[probe_dtype=float32]": "SemanticSpec, float32 MLPs (the exported precision)",
    "semanticspec[rewrite_phase]": "SemanticSpec, refused steps rewritten in a phase of their own",
    "semanticspec[target_first_step]": "SemanticSpec, target writes the first step",
    "semanticspec[no_token_sd]": "SemanticSpec, target's steps without token-level SD",
    "semanticspec[paper_loop]": "SemanticSpec, the paper's loop (both of the above)",
    "semanticspec[token_stats]": "SemanticSpec, token statistics only (probe alone)",
    "semanticspec[hidden]": "SemanticSpec, the paper's probe (pooled hidden states only, probe alone)",
    "semanticspec[rule=ratio]": "SemanticSpec, the paper's ratio rule",
    "semanticspec[lookahead=2]": "SemanticSpec, windows of 2 drafted steps per target forward",
    "semanticspec[lookahead=3]": "SemanticSpec, windows of 3 drafted steps per target forward",
    "semanticspec[lookahead=4]": "SemanticSpec, windows of 4 drafted steps per target forward",
    "semanticspec[lookahead=4 adaptive]": "SemanticSpec, windows of up to 4, stopped after a step the draft was unsure "
                                          "of",
    "random_accept": "random acceptance (same rate)",
    "oracle_accept": "oracle acceptance",
    "oracle_accept[lookahead=2]": "oracle acceptance, windows of 2",
    "oracle_accept[lookahead=3]": "oracle acceptance, windows of 3",
    "oracle_accept[lookahead=4]": "oracle acceptance, windows of 4",
    "specreason": "SpecReason-style",
    "token_sd": "token-level SD (transformers, vs its own target-only)",
    "hf_target_only": "transformers' own target-only loop",
    "draft_only": "draft only",
}
"""Row names of the decoding table, in its order; a method the JSON holds and this does not is listed by its key."""
FIRST_STEP = {
    "target_first_step": "target writes the first step (the paper)",
    "draft_first_step": "draft writes the first step",
    "target_first_step+token_sd": "target first step, token-level SD in the target's steps",
    "draft_first_step+token_sd": "**draft first step, token-level SD in the target's steps (the default)**",
}
LABEL_VARIANTS = {
    "hdbscan+judge": "HDBSCAN + judge (default, numbers check on)",
    "hdbscan+judge, match_numbers off": "HDBSCAN + judge, numbers check off",
    "hdbscan": "HDBSCAN only",
    "judge": "judge only",
    "hdbscan+oracle_judge": "HDBSCAN + an oracle judge",
}
SERVED_METHODS = {
    "target_only": "target only (one request per problem)",
    "semanticspec": "SemanticSpec (the shipped `probes-topk` pair)",
    "oracle_accept": "oracle acceptance",
    "semanticspec_engine_probes": "SemanticSpec, probes trained on engine-read labels",
    "semanticspec[lookahead=2]": "SemanticSpec, windows of 2 steps (one draft write, one read each)",
    "semanticspec[lookahead=4]": "SemanticSpec, windows of 4 steps (one draft write, one read each)",
    "semanticspec[lookahead=4 adaptive]": "SemanticSpec's shipped window: up to 4 steps, adaptive (the default)",
    "semanticspec[lookahead=4 overlap]": "SemanticSpec, windows of 4, the draft writing the next one during the read",
}


@lru_cache(maxsize=None)
def load(name: str) -> dict:
    """``benchmarks/results/<name>.json``."""
    return json.loads((RESULTS / f"{name}.json").read_text())


def num(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def signed(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:+.{digits}f}".replace("-", "\u2212")


def ordered(found: dict, names: dict) -> list[tuple[str, str]]:
    """``(key, row name)`` for every key of ``found``: ``names``' order first, then unknown keys as they are."""
    return [(k, names[k]) for k in names if k in found] + [(k, k) for k in found if k not in names]


# --------------------------------------------------------------------------- the tables


def headline() -> str:
    """The README's one table: SemanticSpec's speedup and accuracy, where each figure comes from. Where the decoders'
    default (the shipped window) was measured it leads, with the one-step loop's speedup of the same run beside it."""
    d, w, s, r = load("decode"), load("decode-lookahead"), load("served"), load("real")
    b8 = d["batch_scaling"]["table"]["semanticspec"]["8"]

    def row(setting: str, run: dict, key: str, bold: bool = False) -> list[str]:
        m, t = run["methods"][key], run["methods"]["target_only"]
        speed = f"**{m['speedup']:.2f}x**" if bold else f"{m['speedup']:.2f}x"
        if key != "semanticspec":
            speed += f" (one step a pass: {run['methods']['semanticspec']['speedup']:.2f}x)"
        return [setting, f"{run['n_problems']}", speed, f"{m['accuracy']:.3f} ({t['accuracy']:.3f})",
                num(m["step_acceptance"])]

    window = "semanticspec[lookahead=4 adaptive]"
    rows = [
        row("embedded world, in-process, 1 prompt", w, window, bold=True),
        ["embedded world, in-process, 8 prompts, one step a pass", f"{b8['problems']}", f"{b8['speedup']:.2f}x",
         f"{b8['accuracy']:.3f} ({d['batch_scaling']['table']['target_only']['8']['accuracy']:.3f})", "-"],
        row("embedded world, two llama.cpp servers", s, window),
        row("real pair (Gemma-3-270m, SmolLM2-135M drafting), in-process, one step a pass", r, "semanticspec"),
    ]
    return table(["setting (CPU, 2 cores)", "problems", "SemanticSpec speedup over target-only (default window)",
                  "accuracy (target-only)", "step acceptance"], rows)


def decode_methods() -> str:
    ms = load("decode")["methods"]
    rows = [[name, num(m["accuracy"]), signed(m.get("accuracy_delta")) if k != "target_only" else "-",
             f"{m['speedup']:.2f}", num(m.get("step_acceptance")) if m.get("step_acceptance") else "-",
             num(m.get("draft_token_share")), num(m.get("target_passes_per_100_tokens"), 1),
             num(m["probe_overhead"]) if m.get("probe_overhead") else "-"] for k, name in ordered(ms, DECODE_METHODS)
            for m in [ms[k]]]
    return table(["method", "accuracy", "\u0394", "speedup", "step acceptance", "draft token share",
                  "target passes / 100 tokens", "probe overhead"], rows)


def decode_decisions() -> str:
    ms = load("decode")["methods"]
    cols = ["right_kept", "wrong_kept", "right_refused", "wrong_refused"]
    rows = [[name] + [str(ms[k]["decisions"][c]) for c in cols]
            for k, name in ordered(ms, DECODE_METHODS) if "decisions" in ms[k]]
    return table(["method", "right kept", "wrong kept", "right refused", "wrong refused"], rows)


def lookahead() -> str:
    """The windowed rows of the decode run with windows (``decode-lookahead.json``): speed (and its gain over the same
    method's one-step row), accuracy, target passes, steps and thrown-away draft tokens per window, and how well the
    draft's least token log-probability predicts the target's decision."""
    ms = load("decode-lookahead")["methods"]
    keys = ["semanticspec"] + [k for k in ms if k.startswith(("semanticspec[lookahead", "oracle_accept"))
                               and "keep_right" not in k]
    rows = [[k.replace("semanticspec", "SemanticSpec"), f"{m['speedup']:.2f}", num(m.get("speedup_over_one_step"), 2),
             num(m["accuracy"]), num(m.get("step_acceptance")), num(m.get("target_passes_per_100_tokens"), 1),
             num(m.get("steps_per_window"), 2), num(m.get("wasted_draft_tokens_per_window"), 2),
             num(m.get("confidence_auroc"))] for k in keys if k in ms for m in [ms[k]]]
    return table(["row", "speedup", "over one step", "accuracy", "step acceptance", "target passes / 100 tokens",
                  "steps / window", "thrown-away draft tokens / window", "AUROC of the draft's confidence"], rows)


def window_costs(run: dict | None = None) -> str:
    """The windows' cost model in the decode run with windows (``decode-lookahead.json``, or ``run``: a decode report,
    whose printed tables show it too): the per-forward costs fitted on the one-step loop and windows of 2, and each
    row's forward seconds and speedup, measured and predicted."""
    wc = (run or load("decode-lookahead"))["window_cost"]
    m = wc["machine"]
    head = (f"Fitted per forward (a + b·positions): target a = {m['target_a_ms']:.2f} ms, b = {m['target_b_ms']:.3f} "
            f"ms; draft a = {m['draft_a_ms']:.3f} ms, b = {m['draft_b_ms']:.4f} ms; a target-only token "
            f"{m['target_only_ms_per_token']:.2f} ms.\n\n")
    rows = [[k.replace("semanticspec", "SemanticSpec"), f"{r['forward_s']:.1f}", f"{r['predicted_forward_s']:.1f}",
             f"{r['speedup']:.2f}", f"{r['predicted_speedup']:.2f}"] for k, r in wc["rows"].items()]
    return head + table(["row", "forward seconds", "predicted", "speedup", "predicted"], rows)


def batch_scaling() -> str:
    bs = load("decode-scaling")["batch_scaling"]
    t, s, ph = bs["table"]["target_only"], bs["table"]["semanticspec"], bs["phases"]["semanticspec"]
    full = load("decode")["batch_scaling"]["table"]["semanticspec"]
    rows = []
    for n in sorted(s, key=int):
        each = ", ".join(f"{x:.2f}" for x in s[n]["speedup_repeats"])
        sh = ph[n]["shares"]
        rows.append([n, f"{t[n]['tokens_per_s']:.0f}", f"{s[n]['tokens_per_s']:.0f}", f"{s[n]['speedup']:.2f} ({each})",
                     f"{s[n]['predicted_speedup']:.2f}", f"{s[n]['positions_free_speedup']:.2f}",
                     f"{full[n]['speedup']:.2f}" if n in full else "-",
                     " / ".join(f"{100 * sh[p]:.1f}" for p in ("draft", "verify", "rewrite", "probe")) + "%",
                     f"{100 * ph[n]['idle_rows_share']:.1f}%", f"{100 * ph[n]['done_rows_share']:.1f}%",
                     f"{s[n]['target_positions_per_forward']:.1f}"])
    return table(["prompts", "target only tokens/s", "SemanticSpec tokens/s", "speedup (each pass)", "predicted",
                  "positions free (projected)", "full run (`decode.json`)", "draft / verify / rewrite / probe share",
                  "idle row-seconds", "finished rows' share", "target positions per forward"], rows)


def first_step() -> str:
    f = load("first-step")
    rows = [[name, num(m["accuracy"]), f"{signed(m['accuracy_delta'])} ({signed(m['accuracy_delta_ci95'][0])}, "
             f"{signed(m['accuracy_delta_ci95'][1])})", f"{m['speedup']:.2f}", num(m["step_acceptance"])]
            for k, name in ordered({k: v for k, v in f["methods"].items() if k != "target_only"}, FIRST_STEP)
            for m in [f["methods"][k]]]
    return table(["setting", "accuracy", "\u0394 (95% interval)", "speedup", "step acceptance"], rows)


def world() -> str:
    w = load("world")
    names = {"target": "target (Llama 18x128)", "draft": "draft (Llama 1x96)"}
    rows = [[names[r], num(w[r]["accuracy"]), f"{w[r]['ms_per_token']:.2f}",
             " / ".join(f"{x:.2f}" for x in w["template_distribution"][r]["shares"])] for r in names]
    return table(["model", "accuracy", "ms/token", "templates 0/1/2/3"], rows)


def labels() -> str:
    v = load("labels")["variants"]
    rows = [[name, num(v[k]["ari"]), num(v[k]["q_mae"]), num(v[k]["p_mae"]),
             f"{100 * v[k]['draft_wrong_false_high_share']:.1f}%"] for k, name in ordered(v, LABEL_VARIANTS)]
    return table(["grouping", "ARI vs oracle", "q MAE", "p MAE", "wrong draft steps with label q >= 0.5"], rows)


def served_methods() -> str:
    ms = load("served")["methods"]
    rows = [[name, num(m["accuracy"]), f"{m['speedup']:.2f}",
             num(m["step_acceptance"]) if k != "target_only" else "-", str(m["requests"])]
            for k, name in ordered(ms, SERVED_METHODS) for m in [ms[k]]]
    return table(["method", "accuracy", "speedup over served target-only", "step acceptance", "requests"], rows)


SERVED_LABELS = {
    "served_vs_in_process": "served build (engine-sampled, engine-read) vs in-process build (seed 0)",
    "in_process_other_seed": "in-process build, seed 0 vs seed 1 (the noise floor of sampling)",
    "served_repeated": "served build vs the same servers and seeds, read in-process (does served sampling repeat?)",
}


def served_labels(run: dict | None = None) -> str:
    """The served build's labels against in-process builds (``served.json``, or ``run``, the report the benchmark
    prints)."""
    a = (run or load("served"))["build"]["label_agreement"]
    rows = [[name, str(a[k]["prefixes"]), str(a[k]["shared_texts"]), num(a[k]["ari"]), num(a[k]["mean_abs_dq"]),
             f"{a[k]['coverage']['a']:.2f} / {a[k]['coverage']['b']:.2f}"]
            for k, name in SERVED_LABELS.items() if k in a]
    return table(["builds compared", "shared prefixes", "shared step texts", "ARI of the groups", "mean abs dq",
                  "coverage (first / second)"], rows)


THREAD_SETTINGS = {
    "default": "**the default** (the command's own choice: 2 passive threads on 2 cores)",
    "1": "1",
    "2-libgomp": "2, libgomp's default spin (torch's default)",
    "2-passive": "2, OMP_WAIT_POLICY=PASSIVE",
    "2-spin3000": "2, GOMP_SPINCOUNT=3000",
}


def threads(t: dict | None = None) -> str:
    """``threads.json`` (or ``t``, the report the benchmark prints) per job and thread setting."""
    t = t or load("threads")
    rows = [[job, name, f"{r['alone_s']:.1f}", f"{r['beside_s']:.1f}", f"{r['slowdown']:.2f}x",
             num(r["alone_over_torch_default"], 2)]
            for job in ("build", "fit") for s, name in ordered(t[job], THREAD_SETTINGS) for r in [t[job][s]]]
    return table(["job", "threads", "alone s", "beside a 2-thread torch job s", "slowdown",
                  "alone / torch's default (2 threads)"], rows)


def train(r: dict | None = None) -> str:
    """``train.json`` (or ``r``, the report the benchmark prints) per feature width."""
    t = (r or load("train"))["samples_per_s"]
    rows = [[w, f"{t[w]['loader']:,.0f}", f"{t[w]['step']:,.0f}", f"{t[w]['end_to_end']:,.0f}",
             "yes" if t[w]["loader"] < t[w]["step"] else "no"] for w in sorted(t, key=int)]
    return table(["features", "loader alone", "step alone", "end to end", "loader bound"], rows)


def endpoint() -> str:
    e = load("endpoint")
    rows = []
    for setting, name in (("in_process", "in-process"), ("served", "two llama.cpp servers")):
        r = e.get(setting)
        if not r:
            continue
        for c in r["semanticspec"]:
            s, t = r["semanticspec"][c], r["target_only"][c]
            rows.append([name, c[1:], f"{s['tokens_per_s']:.0f} / {t['tokens_per_s']:.0f}", f"{r['speedup'][c]:.2f}x",
                         *(f"{1000 * x['ttft_p50_s']:.0f} / {1000 * x['ttft_p95_s']:.0f}" for x in (s, t)),
                         *(f"{x['e2e_p50_s']:.2f} / {x['e2e_p95_s']:.2f}" for x in (s, t))])
    return table(["setting", "concurrency", "tokens/s SemanticSpec / target-only", "speedup",
                  "TTFT p50 / p95 ms, SemanticSpec", "TTFT, target-only", "end-to-end p50 / p95 s, SemanticSpec",
                  "end-to-end, target-only"], rows)


def evaluate() -> str:
    """``python -m semanticspec.evaluate`` on the world: the methods, the threshold sweep and the rule's pick."""
    from semanticspec.evaluation_report import methods_table, pick_line, sweep_table

    r = load("evaluate")
    return "\n\n".join([methods_table(r), sweep_table(r), pick_line(r)])


def evaluate_readme() -> str:
    """The README's evaluation table: the methods against target-only (token-level SD's reference, transformers' own
    target-only loop, left to docs/benchmarks.md)."""
    from semanticspec.evaluation_report import methods_table

    r = load("evaluate")
    names = {"token_sd": "token_sd (speedup vs transformers' own target-only)"}
    methods = {names.get(k, k): v for k, v in r["methods"].items() if k != "hf_target_only"}
    return methods_table({**r, "methods": methods})


TABLES: dict[str, Callable[[], str]] = {
    "headline": headline, "decode-methods": decode_methods, "decode-decisions": decode_decisions,
    "lookahead": lookahead, "window-cost": window_costs,
    "batch-scaling": batch_scaling, "first-step": first_step, "world": world, "labels": labels,
    "served-methods": served_methods, "served-labels": served_labels, "threads": threads, "train": train,
    "endpoint": endpoint, "evaluate": evaluate, "evaluate-readme": evaluate_readme,
}
"""Every generated table by the name its markers carry."""


# --------------------------------------------------------------------------- the pages


def fresh(name: str) -> str:
    """Block ``name``'s body (newline-ended) as the JSON gives it; an unknown name is refused, naming the known ones."""
    if name not in TABLES:
        raise ValueError(f"<!-- report:{name} -->: no such table; expected one of {sorted(TABLES)}")
    return TABLES[name]() + "\n"


def render(text: str) -> str:
    """``text`` with every ``report:`` block rewritten from the JSON."""
    return BLOCK.sub(lambda m: m.group(1) + fresh(m["name"]) + m.group(4), text)


def stale(page: Path) -> list[str]:
    """Names of the blocks of ``page`` that differ from what the JSON gives."""
    return [m["name"] for m in BLOCK.finditer(page.read_text()) if m["body"] != fresh(m["name"])]


def main(argv: list[str] | None = None) -> None:
    ap = harness.OneLineParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only say which pages are out of date (exit status 1)")
    args = ap.parse_args(argv)
    out_of_date = {p.relative_to(ROOT): names for p in PAGES if (names := stale(p))}
    if args.check:
        for page, names in out_of_date.items():
            print(f"{page}: out of date: {', '.join(names)} (run python -m benchmarks.report)", file=sys.stderr)
        raise SystemExit(1 if out_of_date else 0)
    for page in PAGES:
        page.write_text(render(page.read_text()))
    print(f"rewrote {sum(map(len, out_of_date.values()))} tables" + "".join(
        f"; {p}: {', '.join(n)}" for p, n in out_of_date.items()))


if __name__ == "__main__":
    main()
