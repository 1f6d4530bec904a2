"""The step loop computes and its meter measures: the loop reads no clock, the meter shares a
round's and a phase's seconds among the rows that took part, and a decode's step and phase seconds add up to no more
than its wall time."""

import ast
import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest

from semanticspec import meter as meter_mod
from semanticspec.meter import Meter
from semanticspec.results import Decision, StepTrace
from semanticspec.rows import Row
from tests.conftest import PROMPTS
from tests.semanticspec.conftest import GREEDY, stub_decoder
from semanticspec.policies import RandomPolicy

LOOP = Path(__file__).resolve().parents[2] / "semanticspec" / "loop.py"


def test_the_loop_reads_no_clock():
    names = {a.name for n in ast.walk(ast.parse(LOOP.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in n.names}
    modules = {n.module for n in ast.walk(ast.parse(LOOP.read_text())) if isinstance(n, ast.ImportFrom)}
    assert "time" not in names | modules and "perf_counter" not in LOOP.read_text()


@pytest.fixture
def clock(monkeypatch):
    """``time.perf_counter`` in the meter reads 0, 1, 2, ... seconds, one per call."""
    ticks = itertools.count()
    monkeypatch.setattr(meter_mod.time, "perf_counter", lambda: float(next(ticks)))


def parts(n):
    return [SimpleNamespace(forward_s=0.0, served_s=[0.0] * n, probe_s=0.0) for _ in range(2)]


def test_a_round_shares_its_seconds_and_a_rows_new_steps_share_what_it_was_given(clock):
    rows = [Row(100, None) for _ in range(3)]
    verifier, proposer = parts(3)
    m = Meter(rows, verifier, proposer)  # t = 0
    with m.round([0, 1]):  # t = 1 .. 2: one second, half each
        rows[0].trace.append(StepTrace("draft", "a", 1))
        verifier.forward_s, verifier.served_s[0] = 4.0, 4.0  # a forward that fed row 0 only
    assert rows[0].trace[0].seconds == 0.5 and m.pending[1] == 0.5 and m.pending[2] == 0.0
    assert rows[1].stats.idle_row_s == 4.0 and rows[0].stats.idle_row_s == 0.0
    with m.round([1]):  # t = 3 .. 4
        rows[1].trace += [StepTrace("draft", "b", 1), StepTrace("target", "c", 1)]
        rows[1].finish("eos")
    assert [t.seconds for t in rows[1].trace] == [0.75, 0.75]  # (0.5 + 1) seconds over its two new steps
    assert m.t_done == {1: 4.0}


def test_a_phase_moves_the_probes_seconds_to_the_judged_rows_and_skips_failed_ones(clock):
    rows = [Row(100, None) for _ in range(3)]
    verifier, proposer = parts(3)
    m = Meter(rows, verifier, proposer)
    with m.phase({0: "verify", 1: "rewrite", 2: "verify"}):  # t = 1 .. 2 (the probe counters are read between)
        verifier.probe_s += 0.5
        rows[2].fail("the server went away")
    assert rows[0].stats.verify_s == rows[1].stats.rewrite_s == pytest.approx(0.25)  # (1 - 0.5) / 2
    assert rows[0].stats.probe_s == 0.5 and rows[1].stats.probe_s == 0.0 and rows[2].stats.verify_s == 0.0


def test_a_phase_name_outside_the_stats_fields_is_refused():
    rows = [Row(100, None)]
    m = Meter(rows, *parts(1))
    with pytest.raises(ValueError, match="'drafting'"):
        with m.phase({0: "drafting"}):
            pass
    assert rows[0].stats.draft_s == 0.0


@pytest.mark.parametrize("loop", [{}, {"rewrite_in_rounds": False}], ids=["defaults", "rewrite_phase"])
def test_a_decodes_step_and_phase_seconds_fit_in_its_wall_time(tiny_pair, loop):
    # Per batch: a row that runs longer than the others takes a larger share of the rounds than of the wall.
    target, draft, tok = tiny_pair
    dec = stub_decoder(target, draft, tok, q=0.5, p=1.0, **loop)
    results = dec.generate(PROMPTS, method=RandomPolicy(0.5), **GREEDY)
    wall = sum(r.stats.wall_s for r in results)
    phases = sum(r.stats.first_step_s + r.stats.draft_s + r.stats.verify_s + r.stats.probe_s + r.stats.rewrite_s
                 for r in results)
    assert 0 < phases <= wall and all(r.stats.draft_s > 0 and r.stats.verify_s > 0 for r in results)
    assert 0 < sum(t.seconds for r in results for t in r.steps) <= wall
    assert all(t.seconds > 0 for r in results for t in r.steps)
    assert {t.decision for r in results for t in r.steps} >= {Decision.ACCEPT, Decision.REJECT, Decision.TARGET}
