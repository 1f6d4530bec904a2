"""Acceptance figures: pure update/compute, the functional forms, and agreement with summarize."""

import pytest
import torch

from probes import metrics
from probes.decoder import DecodeResult, DecodeStats, summarize


def test_functional_twins_compute_ratios_of_sums():
    assert float(metrics.step_acceptance([3, 1], [4, 4])) == pytest.approx(0.5)
    assert float(metrics.draft_token_share(torch.tensor([10, 30]), torch.tensor([40, 60]))) == pytest.approx(0.4)
    assert float(metrics.target_passes_per_100_tokens(25, 200)) == pytest.approx(12.5)
    assert float(metrics.probe_overhead(0.5, 10.0)) == pytest.approx(0.05)
    assert float(metrics.step_acceptance(0, 0)) == 0.0  # nothing proposed (target only) is 0, not NaN


def test_bad_counts_are_refused_with_values():
    with pytest.raises(ValueError, match="accepted=5 draft steps exceeds proposed=4"):
        metrics.step_acceptance(5, 4)
    with pytest.raises(ValueError, match="non-negative.*-1"):
        metrics.draft_token_share(-1, 3)


def test_summarize_uses_the_definitions():
    a = DecodeResult(
        "x",
        stats=DecodeStats(
            wall_s=2.0,
            output_tokens=100,
            draft_tokens=60,
            steps=10,
            draft_steps_proposed=9,
            draft_steps_accepted=6,
            target_passes=30,
            probe_s=0.1,
        ),
    )
    b = DecodeResult(
        "y",
        stats=DecodeStats(
            wall_s=1.0,
            output_tokens=50,
            draft_tokens=0,
            steps=5,
            draft_steps_proposed=4,
            draft_steps_accepted=0,
            target_passes=20,
            probe_s=0.05,
        ),
    )
    s = summarize([a, b])
    assert s["step_acceptance"] == pytest.approx(6 / 13)
    assert s["draft_token_share"] == pytest.approx(60 / 150)
    assert s["target_passes_per_100_tokens"] == pytest.approx(100 * 50 / 150)
    assert s["probe_overhead"] == pytest.approx(0.15 / 3.0)
    assert s["wall_s"] == pytest.approx(3.0) and s["output_tokens"] == 150 and s["n_prompts"] == 2


def test_speedup_is_reference_time_over_method_time():
    assert metrics.speedup(3.0, 1.5) == 2.0
    assert metrics.speedup(1.0, 4.0) == 0.25
    assert isinstance(metrics.speedup(torch.tensor(2.0), 1), float)
    assert metrics.speedup(1.0, 0.0) != metrics.speedup(1.0, 0.0)  # NaN: nothing was timed
    with pytest.raises(ValueError, match=r"non-negative.*reference_wall_s=1.0, wall_s=-2.0"):
        metrics.speedup(1.0, -2.0)


def test_accuracy_is_the_share_of_correct_problems():
    assert metrics.accuracy([True, False, True, True]) == 0.75
    assert metrics.accuracy(x > 1 for x in (0, 2, 3)) == 2 / 3  # any iterable of flags, e.g. a generator
    assert metrics.accuracy([]) == 0.0
