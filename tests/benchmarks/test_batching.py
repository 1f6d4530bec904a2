"""The decode benchmark's batch-scaling section (``benchmarks/batching.py``): passes, figures and bad input."""

import time
from types import SimpleNamespace

import pytest
import torch

from benchmarks import batching
from semanticspec.results import DecodeResult, DecodeStats


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
    fake = SlowFake({"target_only": 0.02, "semanticspec": 0.01})  # pauses well above a loaded machine's jitter
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


def test_the_decode_benchmark_refuses_a_device_it_cannot_run_on(capsys):
    """``--device`` takes any torch device this machine has; a bad name or a missing GPU is refused, named."""
    from benchmarks.decode import parse_args

    assert parse_args(["--device", "cpu"]).device == "cpu"
    with pytest.raises(SystemExit):
        parse_args(["--device", "gpu0"])
    assert "--device 'gpu0' is not a torch device" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            parse_args(["--device", "cuda"])
        assert "--device 'cuda': torch sees no CUDA device here" in capsys.readouterr().err


def test_figures_predict_the_wall_from_forwards_and_positions_and_with_positions_free():
    """The cost model's prediction sums a + b * positions per forward; with positions free only the a's remain,
    and the time outside the forwards (measured) is added to both."""
    from generation.cache import ForwardRecord

    target, draft = object(), object()
    run = batching.Run()
    results = [DecodeResult("x!", stats=DecodeStats(wall_s=1.0, output_tokens=5))]
    recs = [ForwardRecord(target, 8, 8, 8, 0.012, 8), ForwardRecord(target, 8, 80, 70, 0.020, 8),
            ForwardRecord(draft, 8, 8, 8, 0.001, 8)]
    run.add(results, 0.1, recs, 1)
    costs = {"target": {"a": 0.010, "b": 0.0001}, "draft": {"a": 0.001, "b": 0.0}}
    fig = batching.figures(run, ["x"], lambda text, p: text == p + "!", costs,
                           {id(target): "target", id(draft): "draft"})
    other = 0.1 - 0.033
    assert fig["other_s"] == pytest.approx(other)
    assert fig["predicted_wall_s"] == pytest.approx(2 * 0.010 + 88 * 0.0001 + 0.001 + other)
    assert fig["positions_free_wall_s"] == pytest.approx(2 * 0.010 + 0.001 + other)
    assert fig["target_positions_per_forward"] == 44 and fig["accuracy"] == 1.0
