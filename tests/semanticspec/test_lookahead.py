"""Lookahead windows (``DecodeConfig.lookahead``): several drafted steps judged from one target forward, each as the
step-by-step loop would judge it; in-process and served over the same loop; bad input refused."""

import dataclasses

from types import SimpleNamespace

import pytest
import torch

from datamodules.labels.reading import read_steps
from generation.engines.local import LocalEngine
from generation.features import probe_input
from semanticspec.decoder import DraftProposer, SemanticSpecDecoder, TargetVerifier
from semanticspec.config import DecodeConfig
from semanticspec.loop import StepLoop
from semanticspec.policies import OraclePolicy, ProbePolicy, RandomPolicy
from semanticspec.parts import SHIPPED_WINDOW, Window
from semanticspec.results import summarize
from semanticspec.served import ServedDecoder
from probes.model import load_probe
from tests.conftest import PROMPTS
from tests.semanticspec.conftest import make_decoder, stub_decoder, texts

GREEDY = {"temperature": 0.0, "max_new_tokens": 96}
MARKER = SimpleNamespace(answer_marker="Answer:")  # a task: its answer marker ends every decode


@pytest.fixture(scope="module")
def world():
    from arithmetic_world.models import load_model, load_tokenizer
    from arithmetic_world.task import ArithmeticTask

    tok, task = load_tokenizer(), ArithmeticTask()
    target = load_model("target")
    probe = load_probe("checkpoints/arithmetic/probes/target", target, tok, role="target")
    hidden = load_probe("checkpoints/arithmetic/probes-ablation/hidden/target", target, tok, role="target")
    for p in (probe, hidden):
        p.config = dataclasses.replace(p.config, sampling=None)  # it decides greedy decodes too
    return {"target": target, "draft": load_model("draft"), "tok": tok, "task": task, "probe": probe,
            "servable": hidden}


def _prompts(world, n: int, seed: int) -> tuple[list, list[str]]:
    problems = world["task"].problems(n, seed)
    return problems, [world["task"].prompt_text(world["tok"], p["problem"]) for p in problems]


def decisions(results):
    return [[s.decision for s in r.steps] for r in results]


@pytest.mark.slow  # 32 problems, then every judged step read again on its own: in CI's slow set
def test_a_window_reads_and_judges_each_step_as_the_step_by_step_loop(world, monkeypatch):
    """The features a window's one forward gives each step equal those the label build reads for the same
    prefix and step, read on their own (as the sequential loop reads it once the steps before it are kept), within
    float tolerance, and so do the probe's decisions; greedy, 32 problems, windows of 3. Windows drafted after a
    rewrite's continuation, read in its forward, are among them, and some are settled; one step per pass drafts
    none. Every token the draft wrote for a step (a rewrite's continuation aside) counts in ``drafted_tokens``, those
    of the windows thrown away after a continuation the target did not finish as drafted too."""
    reads, scored, after, steps_drafted, thrown = [], [], [], [0], [0]
    read, score, settle = TargetVerifier._read, TargetVerifier._score, StepLoop._settle
    write, rewrite_tokens = DraftProposer._write, StepLoop._rewrite_tokens

    def spy_write(self, rows, for_p, more):  # every step the draft writes, a window's later ones too
        out = write(self, rows, for_p, more)
        steps_drafted[0] += sum(d.n_new for i, d in out.items() if not rows[i].rewrite)
        return out

    def spy_rewrite_tokens(self, i, proposal, drawn, offset=0, hold=False):
        held = rewrite_tokens(self, i, proposal, drawn, offset, hold)
        thrown[0] += hold and not held
        return held

    def spy_read(self, i, f, a, b, *args):
        reads.append((list(self.cache.seq[i][:a]), list(self.cache.seq[i][a:b])))
        return read(self, i, f, a, b, *args)

    def spy_score(self, steps, outputs, got, needs):
        out = score(self, steps, outputs, got, needs)
        scored.extend((j, out[k].features, out[k].q) for k in got for j in [k[1]])
        return out

    def spy_settle(self, judged, windows, scores, decisions, states, rewritten=None):
        after.extend(rewritten or {})
        return settle(self, judged, windows, scores, decisions, states, rewritten)

    monkeypatch.setattr(TargetVerifier, "_read", spy_read)
    monkeypatch.setattr(TargetVerifier, "_score", spy_score)
    monkeypatch.setattr(StepLoop, "_settle", spy_settle)
    monkeypatch.setattr(DraftProposer, "_write", spy_write)
    monkeypatch.setattr(StepLoop, "_rewrite_tokens", spy_rewrite_tokens)
    policy = ProbePolicy()  # no fast path: the probe reads every step
    dec = SemanticSpecDecoder(world["target"], world["draft"], world["tok"], target_probe=world["probe"],
                              policy=policy, task=MARKER)
    _, prompts = _prompts(world, 32, 11)
    res = dec.generate(prompts, lookahead=3, **GREEDY)
    assert len(reads) == len(scored) and sum(j > 0 for j, _, _ in scored) >= 40  # later steps of windows judged
    spec, probe = world["probe"].config.features, world["probe"]
    worst = 0.0
    for (prefix, step), (_, x, q) in zip(reads, scored):
        built = probe_input(read_steps(world["target"], [prefix], [[step]], spec), spec.groups)[0]
        torch.testing.assert_close(x.float().cpu(), built.float(), atol=1e-4, rtol=1e-4)
        worst = max(worst, (x.float().cpu() - built.float()).abs().max().item())
        q_alone = probe.predict(built[None]).item()
        if abs(q_alone - policy.tau) > 1e-3:  # a decision within float noise of tau is not compared
            assert (q >= policy.tau) == (q_alone >= policy.tau)
    print(f"[measured] {len(reads)} steps read in windows of up to 3 ({len(after)} windows settled after a rewrite, "
          f"{thrown[0]} thrown away), max |window - alone| feature {worst:.2e}")
    assert after and thrown[0]
    assert summarize(res)["drafted_tokens"] == steps_drafted[0]
    n_after = len(after)
    one = dec.generate(prompts, lookahead=1, **GREEDY)  # one step per pass: never a window after a rewrite
    assert len(after) == n_after and sum(r.stats.windows for r in one) == sum(r.stats.draft_steps_proposed for r in one)
    assert all(r.ok for r in res)


@pytest.mark.parametrize("k", [2, 4])
def test_windows_keep_the_equivalences_of_one_step(tiny_pair, k):
    """Greedy: a window refused at its first step every time writes what the target writes alone; a window always
    kept (no bonus token) writes what the draft writes alone; and a window of k costs fewer target passes."""
    target, draft, tok = tiny_pair
    rej = stub_decoder(target, draft, tok, q=0.0, max_step_tokens=3)
    assert texts(rej.generate(PROMPTS, lookahead=k, **GREEDY)) == texts(rej.generate(PROMPTS, method="target_only",
                                                                                     **GREEDY))
    acc = stub_decoder(target, draft, tok, q=1.0, bonus_token=False, max_step_tokens=3)
    one, win = acc.generate(PROMPTS, **GREEDY), acc.generate(PROMPTS, lookahead=k, **GREEDY)
    assert texts(win) == texts(one) == texts(acc.generate(PROMPTS, method="draft_only", **GREEDY))
    assert summarize(win)["target_passes"] < summarize(one)["target_passes"]
    assert summarize(win)["step_acceptance"] == 1


@pytest.mark.slow  # the world's models behind LocalEngines, two windows sizes both ways: in CI's slow set
def test_served_windows_decide_as_in_process_windows_with_fewer_requests(world):
    """The engine parts read a window in one request and split it per step: the same decisions and texts as
    in-process windows over the same weights, and fewer requests per committed step than one-step windows."""
    _, prompts = _prompts(world, 6, 1)
    engines = LocalEngine(world["target"], world["tok"]), LocalEngine(world["draft"], world["tok"])
    served = ServedDecoder(*engines, world["servable"], task=MARKER)  # a probe of what a server returns
    local = SemanticSpecDecoder(world["target"], world["draft"], world["tok"], target_probe=world["servable"],
                                task=MARKER)
    per_step = {}
    for k in (1, 3):
        a, b = served.generate(prompts, lookahead=k, **GREEDY), local.generate(prompts, lookahead=k, **GREEDY)
        assert decisions(a) == decisions(b) and texts(a) == texts(b), k
        s = summarize(a)
        per_step[k] = s["requests"] / s["steps"]
    assert per_step[1] > 1.9 and per_step[3] < 1.3, per_step  # one draft write and one read per window


def test_bad_lookahead_is_refused_naming_it(tiny_pair):
    target, draft, tok = tiny_pair
    dec = stub_decoder(target, draft, tok, q=1.0)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=f"lookahead={bad!r}: expected an integer >= 1"):
            dec.generate(PROMPTS, lookahead=bad)
    with pytest.raises(ValueError, match="lookahead=2: method='target_only' drafts no steps.*; use lookahead=1"):
        dec.generate(PROMPTS, method="target_only", lookahead=2)
    with pytest.raises(ValueError, match="overlap=True: method='target_only' drafts no steps.*; use overlap=False"):
        dec.generate(PROMPTS, method="target_only", overlap=True)  # not "lookahead=1: ...; use lookahead=1"
    with pytest.raises(ValueError, match="lookahead=3: method='specreason' reads a judge turn"):
        dec.generate(PROMPTS, method="specreason", lookahead=3)
    ratio = stub_decoder(target, draft, tok, q=1.0, rule="ratio")
    with pytest.raises(ValueError, match="lookahead=2: the ratio rule reads the draft probe's p"):
        ratio.generate(PROMPTS, lookahead=2)
    from tests.conftest import char_tokenizer, tiny_llama

    ctok = char_tokenizer()
    two = make_decoder(target, tiny_llama(len(ctok), 24, 1, seed=1), tok, draft_tokenizer=ctok)
    with pytest.raises(ValueError, match="lookahead=2: .* needs one tokenizer"):
        two.generate(PROMPTS, method=RandomPolicy(0.5), lookahead=2)


def test_a_window_that_cannot_fit_the_context_is_refused_naming_it(tiny_pair):
    """Bad input: a window whose steps, each at the step spec's most tokens, could not fit the models'
    context after a one-token prompt is refused before any model call, naming the value and the most that fits; the
    largest window that fits decodes. Served decoders check it with the engines that tell their context."""
    target, draft, tok = tiny_pair
    dec = stub_decoder(target, draft, tok, q=1.0)
    cap, room = dec.step.max_step_tokens, dec.context_room()
    assert room == min(m.config.max_position_embeddings for m in (target, draft)) - 1 - dec.spare(dec.config)
    most = room // cap
    assert dec.generate(PROMPTS[:1], lookahead=most, max_new_tokens=8, seed=0)[0].stop_reason in ("eos", "budget")
    for bad in (most + 1, 10**6):
        says = rf"lookahead={bad}: a window of {bad} steps of up to {cap} tokens \({bad * cap}\) cannot fit the {room}"
        with pytest.raises(ValueError, match=says + rf" new tokens .* lookahead <= {most}"):
            dec.generate(PROMPTS, lookahead=bad)
    served = ServedDecoder(LocalEngine(target, tok), LocalEngine(draft, tok))
    with pytest.raises(ValueError, match=rf"lookahead={10**6}: a window of {10**6} steps"):
        served.generate(PROMPTS, method=RandomPolicy(0.5), lookahead=10**6)
    assert served.generate(PROMPTS[:1], method=RandomPolicy(0.5), lookahead=2, max_new_tokens=8,
                           seed=0)[0].stop_reason in ("eos", "budget")


def test_a_window_near_the_context_or_budget_end_is_cut_there(tiny_pair):
    """Bad input: a window that would pass the context or the output budget stops at the limit, never
    past it, and the row's stop_reason names the limit (fixed windows up to the most that fits)."""
    target, draft, tok = tiny_pair
    dec = stub_decoder(target, draft, tok, q=0.5)
    long_ids = tok("Add 5, then " * 70).input_ids
    ctx = target.config.max_position_embeddings
    for k in (2, dec.context_room() // dec.step.max_step_tokens):
        for n in (ctx - 56, ctx - 16, ctx - 1):
            for method in ("semanticspec", RandomPolicy(0.5)):
                (res,) = dec.generate([long_ids[:n]], method=method, max_new_tokens=64, seed=0, lookahead=k)
                assert res.stop_reason in ("eos", "context") and n + res.stats.output_tokens <= ctx, (k, n, method)
        (res,) = dec.generate([PROMPTS[2]], max_new_tokens=3, seed=0, lookahead=k)
        assert res.stop_reason in ("eos", "budget") and res.stats.output_tokens <= 3, k


def test_an_adaptive_window_stops_after_an_unsure_step(tiny_pair):
    """``window_min_logprob``: no step is sure enough at 0 (a window is one step: the one-step loop's decode, draw for
    draw), every step is at -1e9 (the full window's decode); in between, windows of every size in between."""
    target, draft, tok = tiny_pair
    dec = stub_decoder(target, draft, tok, q=1.0, max_step_tokens=3)
    sampled = {"max_new_tokens": 48, "seed": 4, "temperature": 0.8, "allow_sampling_mismatch": True}
    one = dec.generate(PROMPTS, lookahead=1, **sampled)
    assert texts(dec.generate(PROMPTS, lookahead=4, window_min_logprob=0.0, **sampled)) == texts(one)
    full = dec.generate(PROMPTS, lookahead=4, **sampled)
    assert texts(dec.generate(PROMPTS, lookahead=4, window_min_logprob=-1e9, **sampled)) == texts(full)
    steps = [s for r in full for s in r.steps if s.writer == "draft"]
    assert all(s.confidence is not None and s.confidence <= 0 for s in steps)
    mid = sorted(s.confidence for s in steps)[len(steps) // 2]
    windows = summarize(dec.generate(PROMPTS, lookahead=4, window_min_logprob=mid, **sampled))
    per = windows["draft_steps_proposed"] / windows["windows"]
    assert 1 < per < summarize(full)["draft_steps_proposed"] / summarize(full)["windows"]


def test_the_shipped_window_is_semanticspecs_default_where_windows_apply(tiny_pair):
    """``lookahead=None`` (the default): SemanticSpec runs the shipped window where the decoder and its policy allow
    windows, and one step per pass elsewhere (no refusal); every other method runs one step unless told."""
    from tests.conftest import char_tokenizer, tiny_llama

    target, draft, tok = tiny_pair
    dec = stub_decoder(target, draft, tok, q=1.0)
    window = lambda d, **kw: d._method(DecodeConfig(**kw))[0].window  # noqa: E731
    assert window(dec) == SHIPPED_WINDOW and SHIPPED_WINDOW.size == 4 and SHIPPED_WINDOW.min_logprob < 0
    assert window(dec, lookahead=1) == Window() and window(dec, lookahead=3) == Window(3)
    assert window(dec, method=RandomPolicy(0.5)) == Window()
    assert window(dec, method=OraclePolicy(lambda s, o: True)) == Window()
    ratio = stub_decoder(target, draft, tok, q=1.0, rule="ratio")  # reads p: one step, and no refusal
    assert window(ratio) == Window() and ratio._method(DecodeConfig())[1] == []
    ctok = char_tokenizer()
    two = make_decoder(target, tiny_llama(len(ctok), 24, 1, seed=1), tok, draft_tokenizer=ctok)
    assert window(two) == Window()  # two tokenizers: the target cannot read a window in its own tokens
    sampled = {"max_new_tokens": 40, "seed": 2, "temperature": 0.8, "allow_sampling_mismatch": True}
    shipped = dec.generate(PROMPTS, lookahead=SHIPPED_WINDOW.size, window_min_logprob=SHIPPED_WINDOW.min_logprob,
                           **sampled)
    assert [r.text for r in dec.generate(PROMPTS, **sampled)] == texts(shipped)


def test_a_bad_window_threshold_is_refused_naming_it(tiny_pair):
    target, draft, tok = tiny_pair
    dec = stub_decoder(target, draft, tok, q=1.0)
    with pytest.raises(ValueError, match=r"window_min_logprob=0.5: expected a log-probability \(a number <= 0\)"):
        dec.generate(PROMPTS, lookahead=2, window_min_logprob=0.5)
    with pytest.raises(ValueError, match="window_min_logprob=-1.0: an adaptive window needs lookahead > 1"):
        dec.generate(PROMPTS, window_min_logprob=-1.0)


@pytest.mark.slow  # the world's models behind LocalEngines, with and without overlap: in CI's slow set
def test_served_overlap_drafts_the_next_window_while_the_target_reads(world):
    """``overlap``: the draft server writes each next window while the target server reads this one; greedy, the
    windows that hold give the texts and decisions of the decode without overlap, and most of them hold."""
    _, prompts = _prompts(world, 6, 1)
    engines = LocalEngine(world["target"], world["tok"]), LocalEngine(world["draft"], world["tok"])
    served = ServedDecoder(*engines, world["servable"], task=MARKER, concurrency=2)
    plain = served.generate(prompts, lookahead=2, **GREEDY)
    ahead = served.generate(prompts, lookahead=2, overlap=True, **GREEDY)
    assert decisions(ahead) == decisions(plain) and texts(ahead) == texts(plain)
    s = summarize(ahead)
    assert 0 < s["ahead_used"] <= s["ahead_windows"] and s["ahead_used"] >= 0.5 * s["ahead_windows"], s
    assert summarize(plain)["ahead_windows"] == 0
    local = SemanticSpecDecoder(world["target"], world["draft"], world["tok"], target_probe=world["servable"],
                                task=MARKER)
    with pytest.raises(ValueError, match="overlap=True: drafting the next window while the target verifies is served"):
        local.generate(prompts, overlap=True, lookahead=2)


def test_the_window_cost_model_recovers_its_costs_and_predicts_from_them():
    """benchmarks.decode.window_cost: every forward costs a + b * positions per model, fitted on the one-step loop
    and windows of 2, predicts the other rows (here made exactly so: the prediction must be exact; a row with
    forwards off the model must be missed by their extra seconds)."""
    from benchmarks.decode import ADAPTIVE_ROW, window_cost
    from generation.cache import ForwardRecord

    target, draft = object(), object()
    roles = {id(target): "target", id(draft): "draft"}
    costs = {"target": (0.008, 0.0003), "draft": (0.0006, 0.00001)}

    def forward(model, positions, extra=0.0):
        a, b = costs[roles[id(model)]]
        return ForwardRecord(model, 1, positions, positions, a + b * positions + extra, 1)

    shapes = {"target_only": ([1] * 400, []), "semanticspec": ([9, 12, 3] * 40, [1] * 300),
              "semanticspec[lookahead=2]": ([18, 25, 4] * 25, [1, 2] * 150),
              "semanticspec[lookahead=3]": ([30, 7] * 30, [1] * 320), ADAPTIVE_ROW: ([22, 14] * 33, [1] * 310),
              "semanticspec[lookahead=4]": ([40, 9] * 25, [1] * 330)}
    forwards, methods = {}, {}
    for name, (t, d) in shapes.items():
        extra = 0.01 if name == "semanticspec[lookahead=4]" else 0.0  # 50 target forwards 10 ms off the model
        forwards[name] = [forward(target, n, extra) for n in t] + [forward(draft, n) for n in d]
        methods[name] = {"wall_s": sum(r.seconds for r in forwards[name]) + 1.0, "speedup": 2.0,
                         "output_tokens": 400}
    out = window_cost(methods, forwards, roles)
    assert out["fitted_on"] == ["semanticspec", "semanticspec[lookahead=2]"]
    for role, (a, b) in costs.items():
        assert out["costs"][role]["a"] == pytest.approx(a) and out["costs"][role]["b"] == pytest.approx(b)
    assert out["machine"]["target_a_ms"] == pytest.approx(8.0)
    assert out["machine"]["target_only_ms_per_token"] == pytest.approx(1000 * methods["target_only"]["wall_s"] / 400)
    rows, ref = out["rows"], methods["target_only"]["wall_s"]
    for name in ("target_only", "semanticspec[lookahead=3]", ADAPTIVE_ROW):
        assert rows[name]["predicted_forward_s"] == pytest.approx(rows[name]["forward_s"])
        assert rows[name]["predicted_speedup"] == pytest.approx(ref / methods[name]["wall_s"])
    off = rows["semanticspec[lookahead=4]"]
    assert off["forward_s"] - off["predicted_forward_s"] == pytest.approx(0.5)
    assert off["predicted_speedup"] == pytest.approx(ref / (methods["semanticspec[lookahead=4]"]["wall_s"] - 0.5))


def test_the_shipped_window_goal_is_read_off_its_row():
    """A goal of the decode benchmark: the shipped window at 2.9x target-only or more, within 1 point
    of its accuracy; absent when the run had no shipped-window row."""
    from benchmarks.decode import ADAPTIVE_ROW, window_goals

    target = {"speedup": 1.0, "accuracy": 0.97}
    assert window_goals({"target_only": target}) == {}
    met = window_goals({"target_only": target, ADAPTIVE_ROW: {"speedup": 2.9, "accuracy": 0.965}})
    assert met["shipped_window_at_least_2.9x"]["met"] and met["shipped_window_accuracy_within_1_point"]["met"]
    missed = window_goals({"target_only": target, ADAPTIVE_ROW: {"speedup": 2.89, "accuracy": 0.955}})
    assert missed["shipped_window_at_least_2.9x"] == {"value": 2.89, "met": False}
    assert not missed["shipped_window_accuracy_within_1_point"]["met"]
