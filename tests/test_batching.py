"""The decode benchmark's batch-scaling section (``benchmarks/batching.py``): passes, figures and bad input."""

import time
from types import SimpleNamespace

import pytest

from benchmarks import batching
from probes.decoding.results import DecodeResult, DecodeStats


class SlowFake:
    """A decoder whose ``generate`` takes ``pause[method]`` seconds per prompt and writes ``"<prompt>!"``."""

    def __init__(self, pause: dict[str, float]):
        self.pause, self.calls = pause, []
        self.target, self.draft = object(), object()

    def generate(self, prompts, method, batch_size, seed, **gen):
        self.calls.append((method, batch_size, len(prompts), gen["max_new_tokens"]))
        time.sleep(self.pause[method] * len(prompts))
        return [DecodeResult(p + "!", stats=DecodeStats(wall_s=self.pause[method], output_tokens=3)) for p in prompts]


ARGS = SimpleNamespace(max_new_tokens=8, temperature=0.6, top_p=0.95, seed=0)


def test_repeats_decode_every_chunk_again_and_report_each_pass_speedup():
    fake = SlowFake({"target_only": 0.004, "semanticspec": 0.002})
    problems = [f"p{i}" for i in range(4)]
    section = batching.batch_scaling(fake, problems, ARGS, prompt=str, check=lambda text, p: text == p + "!",
                                     sizes=(1, 2), repeats=3)
    decodes = [c for c in fake.calls if c[3] == ARGS.max_new_tokens]  # after the warm-up's short decodes
    assert len(decodes) == 3 * 2 * 2 * 2  # passes x chunks (of lcm(1, 2) = 2 problems) x sizes x methods
    for b in ("1", "2"):
        row, ref = section["table"]["semanticspec"][b], section["table"]["target_only"][b]
        assert row["problems"] == 4 and row["accuracy"] == 1.0 and row["output_tokens"] == 4 * 3  # one pass's
        assert row["tokens_per_s"] == pytest.approx(3 * 4 * 3 / row["wall_s"])  # every pass's tokens over its walls
        assert len(row["speedup_repeats"]) == 3 and all(s > 1.0 for s in row["speedup_repeats"])  # half the sleep
        assert row["speedup"] == pytest.approx(ref["wall_s"] / row["wall_s"])
    assert section["repeats"] == 3
    assert "(" in "\n".join(batching.markdown(section))  # each pass's speedup beside the overall one
    with pytest.raises(ValueError, match=r"repeats=0: expected an integer >= 1"):
        batching.batch_scaling(fake, problems, ARGS, prompt=str, check=lambda t, p: True, sizes=(1,), repeats=0)
