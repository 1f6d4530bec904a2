"""Run-level figures (speedup, accuracy) and the ratios summarize divides out of the decoder's counters."""

import pytest
import torch

from semanticspec import results as metrics
from semanticspec.decoder import DecodeResult, DecodeStats, summarize


def test_summarize_uses_the_definitions():
    fields = ("wall_s", "output_tokens", "draft_tokens", "steps", "draft_steps_proposed", "draft_steps_accepted",
              "target_passes", "probe_s")
    a, b = (DecodeResult(text, stats=DecodeStats(**dict(zip(fields, values))))
            for text, values in (("x", (2.0, 100, 60, 10, 9, 6, 30, 0.1)), ("y", (1.0, 50, 0, 5, 4, 0, 20, 0.05))))
    s = summarize([a, b])
    assert s["step_acceptance"] == pytest.approx(6 / 13)
    assert s["draft_token_share"] == pytest.approx(60 / 150)
    assert s["target_passes_per_100_tokens"] == pytest.approx(100 * 50 / 150)
    assert s["probe_overhead"] == pytest.approx(0.15 / 3.0)
    assert s["tokens_per_s"] == pytest.approx(150 / 3.0)
    assert s["wall_s"] == pytest.approx(3.0) and s["output_tokens"] == 150 and s["n_prompts"] == 2


def test_summarize_counts_nothing_counted_as_zero_not_nan():
    target_only = DecodeResult("x", stats=DecodeStats(wall_s=1.0, output_tokens=20, target_passes=20))
    s = summarize([target_only])
    assert s["step_acceptance"] == 0.0 and s["draft_token_share"] == 0.0 and s["probe_overhead"] == 0.0
    assert s["target_passes_per_100_tokens"] == pytest.approx(100.0)
    empty = summarize([])
    assert all(empty[k] == 0.0 for k in ("step_acceptance", "draft_token_share", "target_passes_per_100_tokens",
                                         "probe_overhead", "tokens_per_s"))
    assert all(isinstance(empty[k], float) for k in ("step_acceptance", "tokens_per_s"))


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
