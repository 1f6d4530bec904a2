"""docs/benchmarks.md and the README's headline table are written from benchmarks/results/*.json."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("page", report.PAGES, ids=lambda p: p.name)
def test_generated_tables_are_up_to_date_with_the_json(page):
    assert report.BLOCK.search(page.read_text()), f"{page.name} holds no generated table"
    assert report.stale(page) == [], f"{page.name} is out of date: run python -m benchmarks.report"


def test_every_table_is_placed_and_every_result_with_a_table_is_shown():
    placed = {m["name"] for page in report.PAGES for m in report.BLOCK.finditer(page.read_text())}
    assert placed == set(report.TABLES)
    assert "<!-- report:headline -->" in (ROOT / "README.md").read_text()


def test_a_changed_result_makes_the_page_stale_and_the_report_rewrites_only_its_table(monkeypatch, tmp_path):
    """The check can fail: a figure moved in the JSON shows up as a stale table, and rendering fixes just that."""
    results = tmp_path / "results"
    shutil.copytree(report.RESULTS, results)
    decode = json.loads((results / "decode.json").read_text())
    decode["methods"]["semanticspec"]["speedup"] = 9.87
    (results / "decode.json").write_text(json.dumps(decode))
    monkeypatch.setattr(report, "RESULTS", results)
    report.load.cache_clear()
    try:
        page = tmp_path / "benchmarks.md"
        page.write_text((ROOT / "docs" / "benchmarks.md").read_text())
        assert report.stale(page) == ["decode-methods"]
        text = page.read_text()
        fresh = report.render(text)
        cell = re.compile(r"\| 9\.87 +\|")  # tabulate pads cells to the column's width
        assert cell.search(fresh) and not cell.search(text)
        outside = re.sub(report.BLOCK, "", text)
        assert re.sub(report.BLOCK, "", fresh) == outside  # the hand-written text is kept as it is
    finally:
        report.load.cache_clear()


def test_an_unknown_table_name_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"report:nope.*no such table.*decode-methods"):
        report.render("<!-- report:nope -->\n<!-- /report:nope -->")


@pytest.mark.integration
def test_the_check_command_exits_0_when_up_to_date():
    run = subprocess.run([sys.executable, "-m", "benchmarks.report", "--check"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_the_32b_projection_credits_target_only_with_output_tokens_not_thrown_away_drafts():
    from benchmarks.served import projection

    method = {"draft_steps_proposed": 10, "output_tokens": 60, "drafted_tokens": 100, "step_acceptance": 0.8,
              "windows": 4, "requests": 10}
    p = projection(method, o_ms=0.0, prefill={})
    # s = 6 output tokens per judged step, L = 10 drafted (4 thrown away), r = 0.2, w = 0.4 reads per judged step
    assert p["value"] == pytest.approx(6 * 25 / (10 * 6 + 0.4 * 1.1 * 25 + 0.2 * 6 * 25))
    assert p["ceiling"] == pytest.approx(6 * 25 / (10 * 6 + 0.2 * 6 * 25))
    kept_drafts = projection({**method, "drafted_tokens": 60}, o_ms=0.0, prefill={})
    assert kept_drafts["value"] > p["value"] and p["inputs"]["s"]["value"] == 6.0


def test_the_endpoint_table_has_a_row_per_setting_method_and_concurrency_and_the_speedups():
    from benchmarks import endpoint

    res = json.loads((report.RESULTS / "endpoint.json").read_text())
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in endpoint.table(res).splitlines()
            if line.startswith("| ") and not line.startswith("| setting")]
    s = res["in_process"]["semanticspec"]["c8"]
    assert ["in_process", "semanticspec", "8", str(s["tokens_per_s"]), f"{s['ttft_p50_s']} / {s['ttft_p95_s']}",
            f"{s['e2e_p50_s']} / {s['e2e_p95_s']}"] in rows
    settings = [k for k in ("in_process", "served") if res.get(k)]
    per_setting = [sum(len(res[k][m]) for m in endpoint.METHODS) + 1 for k in settings]  # + its speedup row
    assert len(rows) == sum(per_setting)
    assert rows[per_setting[0] - 1][1:4] == ["speedup (tokens/s)", "", ", ".join(
        f"{c[1:]}: {v}x" for c, v in res["in_process"]["speedup"].items())]
