"""SemanticSpecDecoder: equivalences with stub probes, batching, scripted models, baselines and bad input."""

import dataclasses
import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

from generation.cache import record_forwards
from generation.specs import TOKEN_STATS, SamplingSpec, StepSpec
from generation.steps import DEFAULT_DELIMITERS
from probes.config import ProbeConfig
from semanticspec.config import DecodeConfig
from semanticspec.decoder import DecodeResult, DraftProposer, SemanticSpecDecoder, TargetVerifier, summarize
from probes.model import SemanticProbe, export_probe, resolve_probe_dtype
from semanticspec.policies import OraclePolicy, ProbePolicy, RandomPolicy, SpecReasonPolicy, fast_path_keeps_rows
from generation.fingerprints import model_fingerprint
from tests.conftest import PROMPTS, char_tokenizer, tiny_llama
from tests.semanticspec.conftest import (GREEDY, SIX, ConstProbe, check_stream, make_decoder, stub_decoder,
                                         texts)

# --------------------------------------------------------------------------- equivalences


PAIRS = ["one tokenizer", "multi-layer probes", "two tokenizers"]
SLOW = pytest.mark.slow
"""Over 5 s a case on 2 cores: the README's command checks a call's batching with one pair (one tokenizer); the other
pairs, the per-prompt seeds and the ragged batches run in CI's slow set."""


@pytest.fixture(params=PAIRS)
def pair(request, world_tokenizer):
    """(target, draft, kwargs for stub_decoder): the equivalences hold for each kind of pair and probe."""
    target = tiny_llama(len(world_tokenizer), 32, 2, seed=0)
    if request.param == "two tokenizers":
        ctok = char_tokenizer()
        return target, tiny_llama(len(ctok), 24, 1, seed=1), {"tok": world_tokenizer, "draft_tokenizer": ctok}
    kw = {"tok": world_tokenizer}
    if request.param == "multi-layer probes":
        kw["layer_ids"] = (-1, 1)  # the last layer and the first block's output
    return target, tiny_llama(len(world_tokenizer), 24, 1, seed=1), kw


@pytest.mark.parametrize("loop", [{}, {"rewrite_in_rounds": False}, {"target_first_step": True, "token_sd": False}],
                         ids=["defaults", "rewrite_phase", "paper_loop"])
def test_always_reject_is_target_only(pair, loop):
    target, draft, kw = pair
    dec = stub_decoder(target, draft, q=0.0, p=1.0, **kw, **loop)
    spec = dec.generate(PROMPTS, method="semanticspec", **GREEDY)
    ref = dec.generate(PROMPTS, method="target_only", **GREEDY)
    assert texts(spec) == texts(ref)
    s = summarize(spec)
    assert s["draft_steps_proposed"] > 0 and s["step_acceptance"] == 0 and s["draft_token_share"] == 0
    assert all(t.decision in ("reject", "target") for r in spec for t in r.steps)


def test_always_accept_without_bonus_is_draft_only(pair):
    target, draft, kw = pair
    dec = stub_decoder(target, draft, q=1.0, p=1.0, target_first_step=False, bonus_token=False, **kw)
    spec = dec.generate(PROMPTS, method="semanticspec", **GREEDY)
    assert texts(spec) == texts(dec.generate(PROMPTS, method="draft_only", **GREEDY))
    s = summarize(spec)
    assert s["step_acceptance"] == 1 and s["draft_token_share"] == 1
    # the target reads each step in one pass: passes == steps (the first one includes the prompt)
    assert all(r.stats.target_passes == r.stats.steps for r in spec)


def test_always_accept_with_bonus_and_target_equal_to_draft_is_both(tiny_pair):
    # With bonus tokens the next step opens with the target's token, so equality with draft_only holds
    # when the target predicts what the draft would: the same model on both sides.
    _, draft, tok = tiny_pair
    dec = stub_decoder(draft, draft, tok, q=1.0, p=1.0)
    spec = texts(dec.generate(PROMPTS, method="semanticspec", **GREEDY))
    assert spec == texts(dec.generate(PROMPTS, method="draft_only", **GREEDY))
    assert spec == texts(dec.generate(PROMPTS, method="target_only", **GREEDY))


def test_batched_rows_decide_independently_and_match_one_by_one(pair):
    target, draft, kw = pair
    def sometimes(x):  # splits every pair's steps both ways (asserted below)
        return (x.flatten(1)[:, 5] > 0).float()
    dec = stub_decoder(target, draft, q=sometimes, rule="threshold", tau=0.5, **kw)
    batched = dec.generate(PROMPTS, method="semanticspec", **GREEDY)
    single = dec.generate(PROMPTS, method="semanticspec", batch_size=1, **GREEDY)
    assert texts(batched) == texts(single)
    decisions = {t.decision for r in batched for t in r.steps}
    assert {"accept", "reject"} <= decisions  # the test exercises both branches


@pytest.mark.parametrize("groups", [["hidden"], ["token_stats"], ["hidden", "token_stats"], ["topk_stats"],
                                    ["hidden", "token_stats", "topk_stats"]])
def test_decode_time_features_equal_build_time_features(tiny_pair, monkeypatch, groups):
    """q and p read exactly what the label build stores for the same prefix and step.

    Every draft step is kept, so from the second proposal on each step opens with the target's bonus
    token: the features cover it on both sides. The build reads with ``datamodules.labels.reading.read_steps``.
    """
    from datamodules.labels.reading import read_steps
    from generation.specs import TOKEN_STATS
    from generation.features import probe_input
    from generation.specs import FeatureSpec

    target, draft, tok = tiny_pair
    seen = {"q": [], "p": []}
    stats = list(TOKEN_STATS)
    dec = stub_decoder(target, draft, tok, q=lambda x: seen["q"].append(x) or torch.full((len(x),), 0.5),
                       groups=groups, stats=stats, rule="ratio", lazy_p=False, max_step_tokens=3)
    dec.draft_probe.value = lambda x: seen["p"].append(x) or torch.full((len(x),), 0.1)  # q/p > 1: keep
    spans = {"q": [], "p": []}
    verify, score = TargetVerifier.verify, DraftProposer.score

    def spy_verify(self, windows, outputs, needs, rewrites=()):
        n0 = {i: len(self.cache.seq[i]) - self.handover.forced_in_target(w[0]) for i, w in windows.items()}
        out = verify(self, windows, outputs, needs, rewrites)
        for i in out:  # (prefix, step) as the target holds them (one-step windows)
            d = windows[i][0]
            spans["q"].append((self.cache.seq[i][: n0[i]], self.cache.seq[i][n0[i] : n0[i] + len(d.tokens)]))
        return out

    def spy_score(self, rows):
        for i in rows:  # (prefix, step) as the draft holds them
            d = self.window[i][0]
            spans["p"].append((self.cache.seq[i][: d.start], list(d.tokens)))
        return score(self, rows)

    monkeypatch.setattr(TargetVerifier, "verify", spy_verify)
    monkeypatch.setattr(DraftProposer, "score", spy_score)
    res = dec.generate(PROMPTS[:1], temperature=0.0, max_new_tokens=40, seed=1)
    assert sum(t.decision == "accept" for t in res[0].steps) >= 2  # the bonus-token path is exercised
    spec = FeatureSpec(groups, [-1], "mean", stats)
    for key, model in (("q", target), ("p", draft)):
        assert len(seen[key]) == len(spans[key]) >= 2
        for x, (prefix, step) in zip(seen[key], spans[key]):
            built = probe_input(read_steps(model, [prefix], [[step]], spec), groups)
            torch.testing.assert_close(x.cpu(), built, atol=1e-4, rtol=1e-4)


def test_ratio_rule_accepts_with_probability_q_over_p_and_lazy_p_changes_nothing(tiny_pair):
    target, draft, tok = tiny_pair
    runs = {}
    for lazy in (True, False):
        dec = stub_decoder(target, draft, tok, q=0.3, p=0.6, lazy_p=lazy, max_step_tokens=2, rule="ratio")
        runs[lazy] = dec.generate(PROMPTS, max_new_tokens=48, seed=5)
        judged = [t for r in runs[lazy] for t in r.steps if t.writer == "draft"]
        assert all(t.q == pytest.approx(0.3) for t in judged)
        if lazy:  # p is skipped only when q alone accepts (u <= q); every refusal needed p
            assert all(t.decision == "accept" for t in judged if t.p is None)
            assert all(t.p == pytest.approx(0.6) for t in judged if t.decision == "reject")
        else:
            assert all(t.p == pytest.approx(0.6) for t in judged)
    assert texts(runs[True]) == texts(runs[False])
    rate = summarize(runs[True])["step_acceptance"]
    assert 0.25 < rate < 0.75, rate  # min(1, 0.3 / 0.6) = 0.5
    sure = stub_decoder(target, draft, tok, q=1.0, p=0.5, lazy_p=True, rule="ratio")  # q = 1 >= u: kept, p never needed
    res = sure.generate(PROMPTS, max_new_tokens=24, seed=5)
    assert summarize(res)["step_acceptance"] == 1 and sure.draft_probe.calls == 0


def test_fast_path_skips_the_probes(tiny_pair):
    target, draft, tok = tiny_pair
    # every token is in the top-|V| and passes a floor of -1e9: everything takes the fast path
    dec = stub_decoder(target, draft, tok, q=0.0, top_k=len(tok), fast_path_min_logprob=-1e9)
    res = dec.generate(PROMPTS[:1], method="semanticspec", **GREEDY)
    assert {t.decision for t in res[0].steps} == {"accept_fast"}  # the draft writes the first step too (default)
    assert dec.target_probe.calls == 0 and dec.draft_probe.calls == 0
    assert res[0].stats.probe_s == 0
    # the default floor (log 0.5) on untrained models: no step is that sure, so the probe (q = 0) refuses all
    gated = stub_decoder(target, draft, tok, q=0.0, top_k=len(tok))
    res = gated.generate(PROMPTS[:1], method="semanticspec", **GREEDY)
    assert "accept_fast" not in {t.decision for t in res[0].steps} and gated.target_probe.calls > 0


def fast_path_keeps(logits, tokens, top_k: int, floor: float) -> bool:
    """The fast path's verdict on one step alone."""
    return fast_path_keeps_rows([(logits, tokens)], top_k, floor)[0]


def test_fast_path_needs_top_k_and_the_log_prob_floor(tiny_pair):
    """A token that is the target's top-1 but below the floor, or above the floor but outside the top-k, stops it."""
    import math

    floor = math.log(0.5)

    def keeps(probs, tokens, top_k=1):  # (k, 4) logits of the given probabilities
        return fast_path_keeps(torch.log(torch.tensor(probs)), torch.tensor(tokens, dtype=torch.long), top_k, floor)

    assert keeps([[0.7, 0.1, 0.1, 0.1], [0.1, 0.8, 0.05, 0.05]], [0, 1])
    assert not keeps([[0.7, 0.1, 0.1, 0.1], [0.4, 0.3, 0.2, 0.1]], [0, 0])  # top-1, p = 0.4 < 0.5
    assert not keeps([[0.7, 0.1, 0.1, 0.1], [0.6, 0.3, 0.05, 0.05]], [0, 1])  # not top-1
    assert not keeps([[0.6, 0.35, 0.05, 0.0]], [1], top_k=2)  # top-2 but p = 0.35 below the floor
    assert keeps([[0.6, 0.35, 0.05, 0.0]], [1], top_k=2) is False and keeps([[0.6, 0.35, 0.05, 0.0]], [0], top_k=2)
    assert not keeps([[0.6, 0.4]], [])  # an empty step never takes the fast path
    assert not keeps([[0.7, 0.1, 0.1, 0.1]], [0], top_k=0)  # top_k = 0: off


def test_fast_path_verdicts_of_a_batch_are_each_steps_own():
    """The verifier scores every row's step in one pass (:func:`fast_path_keeps_rows`): each verdict is the one
    step's alone, whatever the other steps hold (empty ones included)."""
    import math

    g = torch.Generator().manual_seed(5)
    steps = []
    for n in (3, 0, 1, 4, 2, 5, 0, 3):
        logits = torch.randn(n, 6, generator=g) * 3
        tokens = logits.argmax(-1) if n % 2 else torch.randint(0, 6, (n,), generator=g)  # odd rows: top-1 steps
        steps.append((logits, tokens.tolist()))
    for top_k, floor in ((1, math.log(0.5)), (2, math.log(0.2)), (6, -100.0), (0, -100.0)):
        each = [fast_path_keeps(lg, torch.tensor(t, dtype=torch.long), top_k, floor) for lg, t in steps]
        assert fast_path_keeps_rows(steps, top_k, floor) == each
        if top_k == 6:
            assert each == [n > 0 for n in (3, 0, 1, 4, 2, 5, 0, 3)]
    mixed = fast_path_keeps_rows(steps, 1, -100.0)
    # top-1 steps are kept beside steps of random tokens that are not: the verdicts are not pooled
    assert [mixed[k] for k in (0, 2, 5, 7)] == [True] * 4 and not (mixed[3] and mixed[4])
    assert fast_path_keeps_rows([], 1, 0.0) == []


def test_fast_path_is_refused_for_two_tokenizers(tiny_pair):
    target, draft, tok = tiny_pair
    other = __import__("copy").deepcopy(tok)
    assert make_decoder(target, draft, tok, draft_tokenizer=other, top_k=2).shared  # the same vocabulary: shared
    other.add_tokens(["<only-the-draft-has-it>"])
    with pytest.raises(ValueError, match="top_k=2.*shared tokenizer"):
        make_decoder(target, draft, tok, draft_tokenizer=other, top_k=2)


def test_sampling_is_seeded(tiny_pair):
    target, draft, tok = tiny_pair
    dec = stub_decoder(target, draft, tok, q=0.5, p=0.5)
    a = dec.generate(PROMPTS, seed=3, max_new_tokens=16)
    assert texts(a) == texts(dec.generate(PROMPTS, seed=3, max_new_tokens=16))
    assert all(r.stats.output_tokens <= 16 for r in a)


# --------------------------------------------------------------------------- scripted models


class ScriptedLM(torch.nn.Module):
    """Stub causal LM that predicts ``script[k]`` as output token ``k`` (prompt of ``prompt_len`` tokens)."""

    def __init__(self, script, prompt_len, vocab_size, hidden_size=8):
        super().__init__()
        self.config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_hidden_layers=1,
            num_attention_heads=1,
            max_position_embeddings=256,
        )
        self.embed = torch.nn.Embedding(vocab_size, hidden_size)
        self.script, self.prompt_len, self.calls = list(script), prompt_len, 0

    def forward(self, input_ids, position_ids, logits_to_keep=0, output_hidden_states=False, **_):
        self.calls += 1
        nxt = position_ids + 1 - self.prompt_len  # index in the script of the token predicted here
        ids = torch.tensor([[self.script[min(max(k, 0), len(self.script) - 1)] for k in row] for row in nxt.tolist()])
        logits = torch.nn.functional.one_hot(ids, self.config.vocab_size).float() * 10
        if isinstance(logits_to_keep, torch.Tensor):
            logits = logits[:, logits_to_keep]
        elif logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        h = self.embed(input_ids)
        return CausalLMOutputWithPast(logits=logits, hidden_states=(h, h) if output_hidden_states else None)


def scripted_pair(tok, target_text, draft_text, prompt):
    def enc(s):
        return tok(s, add_special_tokens=False).input_ids + [tok.eos_token_id]
    n = len(tok(prompt).input_ids)
    return ScriptedLM(enc(target_text), n, len(tok)), ScriptedLM(enc(draft_text), n, len(tok), hidden_size=6)


def test_scripted_fast_path_bonus_and_answer_marker(world_tokenizer):
    tok, prompt = world_tokenizer, PROMPTS[1]
    target, draft = scripted_pair(
        tok, "3 + 1 = 4.\n\nAnswer: 4\n\nAdd 9", "3 plus 1 equals 4.\n\nAnswer: 4\n\nAdd 9", prompt
    )
    dec = stub_decoder(
        target, draft, tok, q=1.0, top_k=1, answer_marker="Answer:", target_first_step=False, max_step_tokens=16
    )
    (res,) = dec.generate([prompt], method="semanticspec", lookahead=1, **GREEDY)  # one step, then the bonus
    assert res.text == "3 plus 1 equals 4.\n\nAnswer: 4\n\n"  # stops once the answer line is complete
    assert res.stop_reason == "answer"
    decisions = [t.decision for t in res.steps]
    assert decisions == ["accept", "accept_fast"]  # the 2nd step matches the target token for token
    assert res.stats.draft_tokens == res.stats.output_tokens - 1  # "Answer" was the target's bonus token


def test_the_decoder_takes_the_answer_marker_from_the_task(world_tokenizer):
    """``task=`` gives the decoder the task's answer marker; no config needed."""
    from datamodules.tasks.base import Task

    tok, prompt = world_tokenizer, PROMPTS[1]
    target, draft = scripted_pair(tok, "3 + 1 = 4.\n\nAnswer: 4\n\nAdd 9", "3 + 1 = 4.\n\nAnswer: 4\n\nAdd 9", prompt)
    probe = ConstProbe(target.config.hidden_size, 1.0, step=StepSpec(DEFAULT_DELIMITERS, 16))
    task = Task()
    dec = SemanticSpecDecoder(target, draft, tok, target_probe=probe, task=task)
    assert dec.loop_setup().answer_marker == task.answer_marker == "Answer:"
    (res,) = dec.generate([prompt], **GREEDY)
    assert (res.text, res.stop_reason) == ("3 + 1 = 4.\n\nAnswer: 4\n\n", "answer")
    (res,) = SemanticSpecDecoder(target, draft, tok, target_probe=probe).generate([prompt], **GREEDY)
    assert res.stop_reason != "answer" and res.text.endswith("Add 9")  # no task, no marker: on to the end
    same = SemanticSpecDecoder(target, draft, tok, target_probe=probe, config=DecodeConfig(answer_marker="Answer:"),
                               task=task)
    assert same.loop_setup().answer_marker == "Answer:"
    with pytest.raises(ValueError, match=r"answer_marker='Result:' but the task's is 'Answer:'; give one"):
        SemanticSpecDecoder(target, draft, tok, target_probe=probe, config=DecodeConfig(answer_marker="Result:"),
                            task=task)
    with pytest.raises(ValueError, match=r"task='math' has no answer_marker"):
        SemanticSpecDecoder(target, draft, tok, target_probe=probe, task="math")


def test_eos_inside_a_draft_step_ends_the_output(world_tokenizer):
    tok, prompt = world_tokenizer, PROMPTS[1]
    target, draft = scripted_pair(tok, "3 + 1 = 4.\n\nAnswer: 4", "3 plus", prompt)  # draft: EOS after 2 tokens
    dec = stub_decoder(target, draft, tok, q=1.0, target_first_step=False, bonus_token=False)
    (res,) = dec.generate([prompt], method="semanticspec", **GREEDY)
    assert res.text == "3 plus" and len(res.steps) == 1 and res.steps[0].n_tokens == 3
    assert res.stop_reason == "eos"


def test_step_without_delimiter_is_cut_at_max_step_tokens(tiny_pair):
    target, draft, tok = tiny_pair
    for q in (0.0, 1.0):  # always refused; always kept (steps then open with the target's bonus token)
        dec = stub_decoder(target, draft, tok, q=q, delimiters=("never",), max_step_tokens=5)
        for method in ("semanticspec", "target_only", "draft_only"):
            (res,) = dec.generate(PROMPTS[:1], method=method, temperature=0.0, max_new_tokens=23)
            assert all(t.n_tokens <= 5 for t in res.steps)
            kept = [t for t in res.steps if t.decision != "reject"]
            lengths = [t.n_tokens for t in kept]  # EOS would end the output early
            assert lengths[:-1] == [5] * (len(lengths) - 1) and 0 < lengths[-1] <= 5, (method, lengths)
            assert res.stats.output_tokens == 23
            assert res.text == "".join(t.text for t in kept)


# --------------------------------------------------------------------------- baselines


def test_random_and_oracle_acceptance(tiny_pair):
    target, draft, tok = tiny_pair
    dec = make_decoder(target, draft, tok, max_step_tokens=4)
    for rate, expected in ((0.0, 0.0), (1.0, 1.0)):
        s = summarize(dec.generate(PROMPTS, method=RandomPolicy(rate), max_new_tokens=16))
        assert s["step_acceptance"] == expected and s["draft_steps_proposed"] > 0
    seen = []
    def keep_even(step, prefix):
        return seen.append((step, prefix)) or len(seen) % 2 == 0
    (res,) = dec.generate(PROMPTS[:1], method=OraclePolicy(keep_even), max_new_tokens=24)
    proposals = [t for t in res.steps if t.writer == "draft"]
    assert [t.decision for t in proposals] == ["accept" if k % 2 else "reject" for k in range(len(proposals))]
    assert [s for s, _ in seen] == [t.text for t in proposals]
    assert all(res.text.startswith(prefix) for _, prefix in seen)


@pytest.mark.parametrize("digit, decision", [(9, "accept"), (7, "accept"), (6, "reject"), (0, "reject")])
def test_specreason_keeps_steps_scored_seven_or_more(tiny_pair, digit, decision):
    # A scripted judge: the target's logits favour one digit by far, so it scores every draft step `digit`.
    # (An untrained judge scores below 7 and rejects everything, which a test of rejections alone cannot tell
    # from a decoder that never accepts.)
    target, draft, tok = tiny_pair
    dec = make_decoder(target, draft, tok, max_step_tokens=4)
    bias = torch.zeros(target.config.vocab_size)
    bias[dec.judge(dec.config.judge_suffix).digits[digit]] = 100.0
    hook = target.lm_head.register_forward_hook(lambda module, inputs, logits: logits + bias)
    try:
        (res,) = dec.generate(PROMPTS[:1], method="specreason", max_new_tokens=24, temperature=0.0)
    finally:
        hook.remove()
    judged = [t for t in res.steps if t.writer == "draft"]
    assert judged and all(t.score == pytest.approx(digit, abs=1e-3) for t in judged)
    assert all(t.decision == decision for t in judged)
    assert (summarize([res])["step_acceptance"] == 1.0) == (decision == "accept")


def test_transformers_baselines_report_their_own_times(tiny_pair):
    target, draft, tok = tiny_pair
    dec = make_decoder(target, draft, tok)
    ours = dec.generate(PROMPTS, method="target_only", temperature=0.0, max_new_tokens=12)
    for method in ("token_sd", "hf_target_only"):
        res = dec.generate(PROMPTS, method=method, temperature=0.0, max_new_tokens=12)
        # greedy: transformers' loop (assisted or not) writes exactly what our target-only loop writes
        assert texts(res) == texts(ours), method
        for r in res:
            assert isinstance(r, DecodeResult) and 0 < r.stats.output_tokens <= 12
            assert r.stats.wall_s > 0 and r.stats.target_passes > 0
        if method == "hf_target_only":  # plain generate: one pass per token
            assert all(r.stats.target_passes >= r.stats.output_tokens for r in res)


def test_transformers_baselines_end_at_the_answer_and_leave_torchs_generator_alone():
    """transformers' loop (plain and assisted) ends a decode at the answer marker's completed line, as the step loop
    does, so the methods' outputs and times compare; it samples from torch's global generator, which the call
    seeds and then restores: a caller's own draws go on as if it had not run."""
    from arithmetic_world.models import load_world
    from semanticspec.rows import answer_complete

    w = load_world()
    dec = SemanticSpecDecoder(w.target, w.draft, w.tokenizer)  # no task: the marker is the call's
    prompt = "<bos>Start with 7. Add 5. What is the result?\n\n"
    ours = dec.generate([prompt], method="target_only", temperature=0.0, max_new_tokens=48, answer_marker="+")[0]
    assert ours.stop_reason == "answer" and ours.text.count("\n\n") == 1  # the first line holds "+"
    for method in ("hf_target_only", "token_sd"):
        torch.manual_seed(5)
        r = dec.generate([prompt], method=method, temperature=0.0, max_new_tokens=48, answer_marker="+")[0]
        drawn = float(torch.rand(()))
        torch.manual_seed(5)
        assert drawn == float(torch.rand(())), method  # the caller's generator, untouched
        assert r.stop_reason == "answer" and ours.text.startswith(r.text) and answer_complete(r.text, "+"), method
        assert not answer_complete(w.tokenizer.decode(w.tokenizer(r.text).input_ids[1:-1]), "+")  # ends at the line


def test_sampled_token_sd_with_two_tokenizers_repeats_with_its_seed(world_tokenizer):
    """transformers' universal assisted generation prunes the draft's LM head in the order the draft tokenizer's
    ``get_vocab()`` lists its tokens, which a fast tokenizer changes from call to call: the same seed drew other
    tokens every call. The draft's vocabulary is handed over in id order (``IdOrderedVocab``)."""
    ctok = char_tokenizer()
    target, draft = tiny_llama(len(world_tokenizer), 32, 1), tiny_llama(len(ctok), 24, 1, seed=1)
    dec = make_decoder(target, draft, world_tokenizer, draft_tokenizer=ctok)
    runs = [texts(dec.generate(PROMPTS[:2], method="token_sd", max_new_tokens=16, seed=[4, 5], temperature=1.0,
                               top_p=1.0)) for _ in range(4)]
    assert all(r == runs[0] for r in runs) and any(runs[0])
    from semanticspec.hf import IdOrderedVocab

    ordered = IdOrderedVocab(ctok)
    assert list(ordered.get_vocab().values()) == sorted(ctok.get_vocab().values()) and len(ordered) == len(ctok)
    assert ordered("ab", add_special_tokens=False).input_ids == ctok("ab", add_special_tokens=False).input_ids


def test_a_step_that_completes_the_answer_line_and_writes_the_marker_again_ends_the_decode():
    """With steps cut at the marker (``=``), every step completed one line and wrote the marker again: the step loop
    looked at the last occurrence only and wrote past three answers to EOS, where transformers' loop, reading token
    by token, ended at the first line."""
    from arithmetic_world.models import load_world
    from semanticspec.rows import answer_complete

    assert answer_complete("19 + 5 = 24.\n\n24 + 8 =", "=") and not answer_complete("19 + 5 =", "=")
    assert not answer_complete("no marker\n", "=") and not answer_complete("a = 1\n", None)
    w = load_world()
    dec = SemanticSpecDecoder(w.target, w.draft, w.tokenizer)  # no task: the marker is the call's
    prompt = "<bos>Take 19. Add 5, then add 8, then subtract 8. What number do you get?\n\n"
    kw = dict(temperature=0.0, max_new_tokens=60, answer_marker="=", step=StepSpec(("=",), 32))
    ours, hf = (dec.generate([prompt], method=m, **kw)[0] for m in ("target_only", "hf_target_only"))
    assert (ours.stop_reason, hf.stop_reason) == ("answer", "answer")
    assert ours.text.startswith(hf.text) and ours.text.count("\n\n") == 1  # the step that completed the line


def test_transformers_methods_keep_the_step_loops_room_at_the_context_end():
    """The step loop's methods keep room for a bonus token and the judge turn at the context's end; transformers'
    loop did not, so greedy ``hf_target_only`` wrote past where ``target_only`` stopped."""
    from arithmetic_world.models import load_world

    w = load_world()
    dec = SemanticSpecDecoder(w.target, w.draft, w.tokenizer)
    one = w.tokenizer("<bos>Take 6. Add 3, then add 3. What number do you get?\n\n").input_ids
    context = w.target.config.max_position_embeddings
    for length in (context - 6, context - 12):  # inside the kept room, and just past it
        ids = (one * (context // len(one) + 1))[-length:]
        out = [dec.generate([ids], method=m, temperature=0.0, max_new_tokens=20)[0]
               for m in ("target_only", "hf_target_only", "token_sd")]
        assert len({(r.text, r.stop_reason, r.stats.output_tokens) for r in out}) == 1, (length, out)
        assert out[0].stop_reason == "context"


def test_an_eos_drawn_as_the_bonus_token_is_a_traced_step():
    """A target bonus token that was EOS counted in ``output_tokens`` and ended the row, but no step held it: the
    trace and the stream's steps held one token fewer than the stats."""
    from arithmetic_world.models import load_world

    w = load_world()
    dec = SemanticSpecDecoder(w.target, w.draft, w.tokenizer)
    prompt = "<bos>Take 6. Add 3, then add 3. What number do you get?\n\n"
    kw = dict(temperature=0.0, max_new_tokens=60, step=StepSpec((" ",), 20))
    (r,) = dec.generate([prompt], method="always_accept", **kw)
    assert r.stop_reason == "eos" and r.steps[-1].writer == "target" and r.steps[-1].n_tokens == 1
    assert r.stats.output_tokens == sum(s.n_tokens for s in r.steps if s.decision != "reject")
    assert r.stats.steps == len([s for s in r.steps if s.decision != "reject"])
    check_stream(list(dec.stream([prompt], method="always_accept", **kw)), [r], 1)


def test_a_refused_step_its_forced_token_finishes_is_rewritten_as_that_token_alone():
    """A refused step rewritten in the rounds started from its forced token (the bonus token) without asking whether
    that token already finished the step (a delimiter ``\\n\\n``, or the cap): the target's rewrite crossed the
    delimiter or held two tokens of a one-token cap. The rewrite phase and the served decoder cut there. Greedy, the
    two ways of rewriting write and decide the same."""
    from arithmetic_world.models import load_world
    from arithmetic_world.task import ArithmeticTask

    w, task = load_world(), ArithmeticTask()
    prompts = [task.prompt_text(w.tokenizer, p["problem"]) for p in task.problems(4, 1)]
    dec = SemanticSpecDecoder(w.target, w.draft, w.tokenizer)
    for cap in (1, 6):
        kw = dict(method=RandomPolicy(0.5), temperature=0.0, max_new_tokens=40, step=StepSpec(DEFAULT_DELIMITERS, cap))
        rides, phase = (dec.generate(prompts, rewrite_in_rounds=r, **kw) for r in (True, False))
        assert [[(s.text, s.decision) for s in r.steps] for r in rides] == \
               [[(s.text, s.decision) for s in r.steps] for r in phase], cap
        kept = [s for r in rides for s in r.steps if s.decision != "reject"]
        assert max(s.n_tokens for s in kept) <= cap and any(s.text == "\n\n" for s in kept), cap
        assert not any(d in s.text[: -len(d)] for s in kept for d in DEFAULT_DELIMITERS), cap


# --------------------------------------------------------------------------- cross-tokenizer


def test_cross_tokenizer_pair_hands_over_text(world_tokenizer):
    ctok = char_tokenizer()
    target, draft = tiny_llama(len(world_tokenizer), 32, 2), tiny_llama(len(ctok), 24, 1, seed=1)
    prompts = PROMPTS[:2]
    accept = make_decoder(
        target,
        draft,
        world_tokenizer,
        draft_tokenizer=ctok,
        target_probe=ConstProbe(32, 1.0, step=SIX),
        draft_probe=ConstProbe(24, 1.0, role="draft", step=SIX),
        target_first_step=False,
    )
    assert accept.policy.top_k == 0  # no fast path across tokenizers (asking for one is refused, see above)
    assert texts(accept.generate(prompts, **GREEDY)) == texts(accept.generate(prompts, method="draft_only", **GREEDY))
    reject = make_decoder(
        target,
        draft,
        world_tokenizer,
        draft_tokenizer=ctok,
        target_probe=ConstProbe(32, 0.0, step=SIX),
        draft_probe=ConstProbe(24, 1.0, role="draft", step=SIX),
    )
    res = reject.generate(prompts, **GREEDY)
    assert texts(res) == texts(reject.generate(prompts, method="target_only", **GREEDY))
    assert summarize(res)["draft_steps_proposed"] > 0


# --------------------------------------------------------------------------- bad input


def test_probe_for_another_model_is_refused_naming_fields(tiny_pair, tmp_path):
    target, draft, tok = tiny_pair
    cfg = ProbeConfig(hidden_size=24, hidden_dims=[4], reads=model_fingerprint(draft, tok), role="draft")
    export_probe(SemanticProbe(cfg), tmp_path / "draft_probe")
    cfg.role = "target"  # a target-role probe, but of the draft model (a draft-role one is refused by its role)
    export_probe(SemanticProbe(cfg), tmp_path / "other_target_probe")
    with pytest.raises(ValueError, match=r"hidden_size: probe has 24, model has 32.*num_layers"):
        make_decoder(target, draft, tok, target_probe=tmp_path / "other_target_probe")
    dec = make_decoder(target, draft, tok, draft_probe=str(tmp_path / "draft_probe"), rule="threshold")
    assert dec.draft_probe.config.reads == cfg.reads  # the right model loads


@pytest.mark.parametrize("groups, refused", [(["hidden"], True), (["hidden", "topk_stats"], True),
                                             (["token_stats", "topk_stats"], False)])
def test_a_probe_of_a_servers_hidden_states_is_refused_in_process(tiny_pair, groups, refused):
    """The in-process decoder reads transformers' states after the final norm; statistics come from any source. The
    live-validation callback and the evaluation, which decode in-process too, check a probe with the same
    ``check_probe_matches``."""
    from probes.model import check_probe_matches

    target, draft, tok = tiny_pair
    probe = ConstProbe(target.config.hidden_size, 1.0, groups=groups,
                       stats=TOKEN_STATS if "token_stats" in groups else ())
    probe.config.features = dataclasses.replace(probe.config.features, source="sglang", hidden_norm="pre_norm")
    if refused:
        with pytest.raises(ValueError, match=r"the target probe: .*source='sglang' "
                                             r"\(hidden_norm='pre_norm'\).*source='transformers'"):
            make_decoder(target, draft, tok, target_probe=probe, rule="threshold")
        with pytest.raises(ValueError, match=r"target probe in training: .*source='sglang'"):
            check_probe_matches(probe.config, target, tok, where="target probe in training")
    else:
        make_decoder(target, draft, tok, target_probe=probe, rule="threshold")
        check_probe_matches(probe.config, target, tok)


def test_prompt_longer_than_context_names_both_lengths(tiny_pair):
    target, draft, tok = tiny_pair
    dec = stub_decoder(target, draft, tok)
    long_prompt = "Add 5, then " * 100  # 401 tokens with <bos>; the tiny models have 256 positions
    n = len(tok(long_prompt).input_ids)
    with pytest.raises(ValueError, match=rf"prompt 1 has {n} tokens.*target.*is 256"):
        dec.generate(["Take 3.\n\n", long_prompt], max_new_tokens=4)


def test_output_stops_at_the_context_end(tiny_pair):
    target, draft, tok = tiny_pair
    dec = stub_decoder(target, draft, tok, q=0.5)
    prompt = "Add 5, then " * 60  # 241 tokens: 15 positions left
    (res,) = dec.generate([prompt], max_new_tokens=100)
    assert 0 < res.stats.output_tokens <= 256 - len(tok(prompt).input_ids)


def test_empty_prompt_list_and_bad_arguments(tiny_pair):
    target, draft, tok = tiny_pair
    dec = stub_decoder(target, draft, tok)
    assert dec.generate([]) == []
    with pytest.raises(ValueError, match="method='beam'"):
        dec.generate(PROMPTS, method="beam")
    with pytest.raises(ValueError, match="invalid DecodeConfig: method='beam': expected one of"):
        DecodeConfig(method="beam")  # refused where it is built, as every other bad field
    with pytest.raises(TypeError, match=r"policy=RandomPolicy\(rate=0.5\): expected a ProbePolicy .* "
                                        r"method=RandomPolicy\(0.5\)"):
        SemanticSpecDecoder(target, draft, tok, policy=RandomPolicy(0.5))
    for threshold in ("7", None, float("nan"), -5, 100, True):
        with pytest.raises(ValueError, match=r"SpecReasonPolicy\(threshold=.*\): expected a number in \[0, 9\]"):
            SpecReasonPolicy(threshold=threshold)
    with pytest.raises(ValueError, match="method='random_accept': expected one of .* or an AcceptancePolicy"):
        dec.generate(PROMPTS, method="random_accept")  # a method with an argument is named by its policy
    with pytest.raises(ValueError, match="needs target_probe"):
        make_decoder(target, draft, tok).generate(PROMPTS)
    with pytest.raises(ValueError, match=r"rule='greedy'.*tau=2"):
        make_decoder(target, draft, tok, rule="greedy", tau=2)
    for bad in (0, -1):  # 0 used to mean "all prompts" silently
        with pytest.raises(ValueError, match=rf"batch_size={bad}: expected an integer >= 1"):
            dec.generate(PROMPTS, batch_size=bad)
    for bad in (float("nan"), float("inf"), -0.5):  # nan used to reach torch.multinomial
        with pytest.raises(ValueError, match=rf"temperature={bad}: expected a finite number >= 0"):
            dec.generate(PROMPTS, temperature=bad)


def test_a_bare_string_is_one_prompt(tiny_pair):
    target, draft, tok = tiny_pair
    dec = stub_decoder(target, draft, tok)
    one = dec.generate(PROMPTS[0], **GREEDY)  # not one prompt per character
    assert len(one) == 1 and texts(one) == texts(dec.generate(PROMPTS[:1], **GREEDY))


def test_models_on_different_devices_and_dtypes(tiny_pair):
    # On CPU-only machines the draft differs from the target in dtype (float64), which exercises the
    # same hand-over code (features, logits, tokens moved to each model's device and dtype); with a
    # GPU the draft runs on it.
    target, draft, tok = tiny_pair
    draft = draft.to(torch.device("cuda") if torch.cuda.is_available() else torch.float64)
    dec = stub_decoder(target, draft, tok, q=lambda x: (x.flatten(1)[:, 0] > 0).float(), rule="threshold")
    ref = stub_decoder(target, draft, tok, q=0.0)
    res = dec.generate(PROMPTS, **GREEDY)
    assert summarize(res)["draft_steps_proposed"] > 0
    assert texts(ref.generate(PROMPTS, **GREEDY)) == texts(ref.generate(PROMPTS, method="target_only", **GREEDY))


# --------------------------------------------------------------------------- token-level speculation option


def test_token_sd_inside_target_steps_is_lossless_when_greedy(tiny_pair):
    target, draft, tok = tiny_pair
    plain = stub_decoder(target, draft, tok, q=0.0)
    spec = stub_decoder(target, draft, tok, q=0.0, token_sd=True, token_sd_tokens=3)
    ref = plain.generate(PROMPTS, method="target_only", **GREEDY)
    out = spec.generate(PROMPTS, **GREEDY)  # every draft step rejected: the target writes all, speculatively
    assert texts(out) == texts(ref)
    # with a draft that always agrees (the same model) each target pass keeps token_sd_tokens + 1 tokens
    same = stub_decoder(draft, draft, tok, q=0.0, token_sd=True, token_sd_tokens=3).generate(PROMPTS, **GREEDY)
    assert texts(same) == texts(plain.generate(PROMPTS, method="draft_only", **GREEDY))
    s = summarize(same)
    assert s["target_passes"] < 0.6 * s["output_tokens"]
    sampled = spec.generate(PROMPTS, max_new_tokens=24, seed=1)
    assert all(0 < r.stats.output_tokens <= 24 for r in sampled)
    with pytest.raises(ValueError, match="token_sd=True.*shared tokenizer"):
        make_decoder(target, draft, tok, draft_tokenizer=char_tokenizer(), token_sd=True)


def test_defaults_follow_the_first_step_benchmark(tiny_pair):
    """The draft writes the first step; token-level speculation writes the target's steps when the tokenizer is
    shared."""
    target, draft, tok = tiny_pair
    shared = stub_decoder(target, draft, tok)
    assert shared.loop_setup().token_sd is True and shared.loop_setup().target_first_step is False
    assert stub_decoder(target, draft, tok, token_sd=False).loop_setup().token_sd is False
    ctok = char_tokenizer()
    cross = make_decoder(target, tiny_llama(len(ctok), 24, 1, seed=1), tok, draft_tokenizer=ctok,
                                target_probe=ConstProbe(target.config.hidden_size),
                                draft_probe=ConstProbe(24, role="draft"))
    assert cross.loop_setup().token_sd is False  # needs a shared tokenizer: off, not refused, when left to the default
    res = shared.generate(PROMPTS[:1], max_new_tokens=12, seed=0)
    assert res[0].steps[0].writer == "draft"  # the first step was proposed by the draft


def test_transformers_assisted_generation_is_refused_for_two_tokenizers_of_one_vocabulary_size(world_tokenizer):
    """transformers reads two models of one ``vocab_size`` as sharing a tokenizer and refuses the draft's tokenizer
    with an error about omitting it: two tokenizers of equal size are refused for ``token_sd`` in one line, as the
    decoder refuses what it cannot run, and the step loop's methods decode them."""
    ctok = char_tokenizer()
    size = max(len(world_tokenizer), len(ctok))
    target, draft = tiny_llama(size, 32, 1), tiny_llama(size, 24, 1, seed=1)
    dec = make_decoder(target, draft, world_tokenizer, draft_tokenizer=ctok)
    with pytest.raises(ValueError, match=r"method='token_sd': transformers' assisted generation reads two models of "
                                         rf"one vocabulary size \({size}\) as sharing a tokenizer"):
        dec.generate(PROMPTS[:1], method="token_sd", max_new_tokens=4, temperature=0.0)
    assert dec.generate(PROMPTS[:1], method="target_only", max_new_tokens=4, temperature=0.0)[0].stop_reason


def test_the_step_definition_travels_with_the_probes(tiny_pair):
    """The step spec comes from the probes' labels; an explicit one that differs is refused naming both."""
    target, draft, tok = tiny_pair
    seven = StepSpec((".\n\n",), 7)
    tprobe = ConstProbe(target.config.hidden_size, step=seven)
    dprobe = ConstProbe(draft.config.hidden_size, role="draft", step=seven)
    dec = make_decoder(target, draft, tok, target_probe=tprobe, draft_probe=dprobe)
    assert dec.step == seven
    assert all(stop.max_step_tokens == 7 for stop in dec._stopper(dec.step))
    assert make_decoder(target, draft, tok, target_probe=tprobe, draft_probe=dprobe, step=seven).step == seven
    with pytest.raises(ValueError, match=r"step=StepSpec\(delimiters=\('\\n\\n',\), max_step_tokens=64\) but the "
                                         r"target probe was trained on steps with step=StepSpec\(delimiters=\('\.\\n"):
        make_decoder(target, draft, tok, target_probe=tprobe, draft_probe=dprobe, delimiters=["\n\n"],
                     max_step_tokens=64)
    dprobe.config.step = StepSpec((".\n\n",), 9)
    with pytest.raises(ValueError, match=r"the target probe has step=.*max_step_tokens=7\), the draft probe .*=9\)"):
        make_decoder(target, draft, tok, target_probe=tprobe, draft_probe=dprobe)
    assert make_decoder(target, draft, tok).step == StepSpec()  # no probe: the one default


def test_sampling_spec_comes_from_the_probes_and_a_conflict_is_refused(tiny_pair):
    target, draft, tok = tiny_pair
    dec = stub_decoder(target, draft, tok, q=0.0)
    for probe in (dec.target_probe, dec.draft_probe):
        probe.config.sampling = SamplingSpec(0.6, 0.9)
    dec = make_decoder(target, draft, tok, target_probe=dec.target_probe, draft_probe=dec.draft_probe,
                       max_step_tokens=6)
    assert dec.sampling() == SamplingSpec(0.6, 0.9) and dec.sampling(top_p=0.5, enforce=False).top_p == 0.5
    with pytest.raises(ValueError, match=r"temperature=0\.0 but the target probe was trained on steps sampled with "
                                         r"temperature=0\.6"):
        dec.generate(PROMPTS[:1], temperature=0.0, max_new_tokens=8)
    with pytest.raises(ValueError, match=r"leave temperature unset to use the probe's, or pass "
                                         r"allow_sampling_mismatch=True"):
        dec.generate(PROMPTS[:1], temperature=0.0, max_new_tokens=8)
    # greedy decoding with probes trained at 0.6, as an explicit opt-in that warns
    with pytest.warns(UserWarning, match=r"allow_sampling_mismatch=True: temperature=0\.0 but the target probe was "
                                         r"trained on steps sampled with temperature=0\.6"):
        greedy = dec.generate(PROMPTS[:1], temperature=0.0, max_new_tokens=16, allow_sampling_mismatch=True)
    assert texts(greedy) == texts(dec.generate(PROMPTS[:1], method="target_only", temperature=0.0, max_new_tokens=16))
    with pytest.warns(UserWarning, match="allow_sampling_mismatch=True") as caught:  # each names the caller's line
        dec.generate(PROMPTS[:1], temperature=0.0, max_new_tokens=4, allow_sampling_mismatch=True)
        dec.stream(PROMPTS[:1], temperature=0.0, max_new_tokens=4, allow_sampling_mismatch=True)
        dec.sampling(temperature=0.0, allow_mismatch=True)
    assert [w.filename for w in caught] == [__file__] * 3
    # unset: the probes' spec, and the same draws as passing it explicitly
    same = dec.generate(PROMPTS[:1], max_new_tokens=16, seed=3)
    assert texts(same) == texts(dec.generate(PROMPTS[:1], temperature=0.6, top_p=0.9, max_new_tokens=16, seed=3))
    assert dec.generate(PROMPTS[:1], method="target_only", temperature=0.0, max_new_tokens=8)  # no probe decides
    with pytest.raises(ValueError, match=r"invalid DecodeConfig: temperature=-1.0"):  # refused where it is built
        dec.generate(PROMPTS[:1], method="target_only", temperature=-1.0, max_new_tokens=8)
    dec.draft_probe.config.sampling, dec.draft_probe.config.role = SamplingSpec(1.0, 0.9), "draft"
    with pytest.raises(ValueError, match="temperature=0.6, the draft probe 1.0"):
        make_decoder(target, draft, tok, target_probe=dec.target_probe, draft_probe=dec.draft_probe,
                     max_step_tokens=6)


def test_prompts_given_as_token_ids_decode_like_their_text(world_tokenizer):
    ctok = char_tokenizer()
    target, draft = tiny_llama(len(world_tokenizer), 32, 2), tiny_llama(len(ctok), 24, 1, seed=1)
    dec = make_decoder(target, draft, world_tokenizer, draft_tokenizer=ctok,
                       target_probe=ConstProbe(32, 0.5, step=SIX),
                       draft_probe=ConstProbe(24, 1.0, role="draft", step=SIX))
    text = dec.generate(PROMPTS[:1], **GREEDY)
    pair = (world_tokenizer(PROMPTS[0]).input_ids, ctok(PROMPTS[0]).input_ids)
    assert texts(dec.generate([pair], **GREEDY)) == texts(text)
    with pytest.raises(ValueError, match=r"\(target_ids, draft_ids\) pair"):
        dec.generate([pair[0]], **GREEDY)  # ids alone are ambiguous with two tokenizers
    shared = stub_decoder(target, tiny_llama(len(world_tokenizer), 24, 1, seed=1), world_tokenizer)
    assert texts(shared.generate([pair[0]], **GREEDY)) == texts(shared.generate(PROMPTS[:1], **GREEDY))


# --------------------------------------------------------------------------- prompts: bad input, context, streams


def test_bad_prompts_are_refused_before_any_model_call_naming_the_index(tiny_pair):
    """Bad input: one ValueError naming the prompt's index and what is wrong."""
    target, draft, tok = tiny_pair
    dec = stub_decoder(target, draft, tok)
    calls = []
    hooks = [m.register_forward_hook(lambda *a: calls.append(1)) for m in (target, draft)]
    V, ids = target.config.vocab_size, tok(PROMPTS[1]).input_ids
    cases = [
        ([[]], r"prompt 0 is empty"),
        ([PROMPTS[0], ""], r"prompt 1 is empty"),
        ([PROMPTS[0], None], r"prompt 1 is None"),
        (None, r"prompts=None"),
        ([ids, [1, V]], rf"prompt 1 holds token id {V} at position 1, outside the target's vocabulary \[0, {V}\)"),
        ([[5, -1]], r"prompt 0 holds token id -1 at position 1"),
        ([[5, 2.5]], r"prompt 0 holds 2.5 at position 1: expected an integer token id"),
        ([PROMPTS[0], ids], r"prompt 1 is token ids but prompt 0 is text: a batch holds prompts of one form"),
        ([PROMPTS[0], "Add 5, then " * 100], r"prompt 1 has \d+ tokens but the target model's context .* is 256"),
        ([(ids, ids[:-1])], r"prompt 0 is a \(target_ids, draft_ids\) pair whose two sides differ, but this pair "
                            r"shares one tokenizer"),
        (5, r"prompts=5: expected a list of prompts"),  # 'int' object is not iterable, before
        (torch.tensor(ids), r"prompts=tensor\(.*\): expected a list of prompts .*its \.tolist\(\)"),
        ({PROMPTS[0]: 1}, r"prompts=\{.*\}: expected a list of prompts"),  # its keys were decoded, before
        (["abc\ud800"], r"prompt 0 is not valid UTF-8 text: surrogates not allowed at character 3"),
    ]
    try:
        for prompts, match in cases:
            with pytest.raises(ValueError, match=match):
                dec.generate(prompts, max_new_tokens=4)
        for bad in (5.5, True, 0):
            with pytest.raises(ValueError, match=rf"max_new_tokens={bad}: expected an integer >= 1"):
                dec.generate(PROMPTS, max_new_tokens=bad)
        with pytest.raises(ValueError, match="batch_size=1.5: expected an integer >= 1"):
            dec.generate(PROMPTS, batch_size=1.5)
    finally:
        for h in hooks:
            h.remove()
    assert not calls  # every refusal came before any model call
    assert texts(dec.generate([(ids, ids)], max_new_tokens=4)) == texts(dec.generate([ids], max_new_tokens=4))
    assert texts(dec.generate(iter([ids]), max_new_tokens=4)) == texts(dec.generate([ids], max_new_tokens=4))
    with pytest.raises(ValueError, match=r"ratio_scale=nan: expected a finite number > 0"):
        ProbePolicy(rule="ratio", ratio_scale=float("nan"))
    with pytest.raises(ValueError, match=r"ratio_scale=True: expected a finite number > 0"):
        ProbePolicy(rule="ratio", ratio_scale=True)
    with pytest.raises(ValueError, match=r"top_k=1.5: expected an integer >= 0"):
        ProbePolicy(top_k=1.5)


def test_token_ids_as_a_tuple_are_ids_with_one_tokenizer_and_ambiguous_with_two(world_tokenizer):
    ctok = char_tokenizer()
    target = tiny_llama(len(world_tokenizer), 32, 2)
    shared = stub_decoder(target, tiny_llama(len(world_tokenizer), 24, 1, seed=1), world_tokenizer)
    ids = world_tokenizer(PROMPTS[1]).input_ids[:2]  # (id0, id1): used to fail with "'int' object is not iterable"
    assert texts(shared.generate([tuple(ids)], **GREEDY)) == texts(shared.generate([ids], **GREEDY))
    two = make_decoder(target, tiny_llama(len(ctok), 24, 1, seed=1), world_tokenizer, draft_tokenizer=ctok,
                       max_step_tokens=6)
    with pytest.raises(ValueError, match=r"prompt 0 is token ids, which need one tokenizer.*\(target_ids, draft_ids\)"):
        two.generate([tuple(ids)], method="target_only", **GREEDY)


def test_every_result_carries_a_stop_reason_and_no_method_passes_the_context(tiny_pair):
    """Prompts near the context end (256 positions) stop at it, with the reason, in every method."""
    from semanticspec.methods import METHODS

    target, draft, tok = tiny_pair
    dec = stub_decoder(target, draft, tok, q=0.5)
    extra = {}
    long_ids = tok("Add 5, then " * 70).input_ids
    methods = [*METHODS, RandomPolicy(0.5), OraclePolicy(lambda step, out: True)]
    for n in (240, 250, 255):
        for method in methods:
            (res,) = dec.generate([long_ids[:n]], method=method, max_new_tokens=64, seed=0, **extra)
            assert res.stop_reason in ("eos", "context"), (n, method, res.stop_reason)
            assert n + res.stats.output_tokens <= 256, (n, method, res.stats.output_tokens)
    for method in methods:
        (res,) = dec.generate([PROMPTS[2]], method=method, max_new_tokens=3, seed=0, **extra)
        assert res.stop_reason in ("eos", "budget") and res.stats.output_tokens <= 3, (method, res.stop_reason)


@pytest.mark.parametrize("pair", [PAIRS[0], *(pytest.param(p, marks=SLOW) for p in PAIRS[1:])], indirect=True)
def test_a_call_decodes_the_same_whatever_its_batch_size(pair):
    """With one integer seed, prompt k samples from its own streams (seed, k), so batching a call
    changes nothing (a prompt alone is prompt 0: see the per-prompt seeds below)."""
    target, draft, kw = pair
    sometimes = lambda x: (x.flatten(1)[:, 9] > 0).float()  # noqa: E731
    dec = stub_decoder(target, draft, q=sometimes, rule="threshold", tau=0.5, **kw)
    for method in ("semanticspec", "target_only", RandomPolicy(0.5)):
        gen = {"method": method, "max_new_tokens": 24, "seed": 7}
        together = texts(dec.generate(PROMPTS, **gen))
        for bs in (1, 2):
            assert texts(dec.generate(PROMPTS, batch_size=bs, **gen)) == together, (method, bs)
        assert texts(dec.generate(PROMPTS[:1], **gen)) == together[:1]  # alone, as the batch's prompt 0
        assert texts(dec.generate(PROMPTS[:2], **gen)) == together[:2]
    other = texts(dec.generate(PROMPTS, seed=8, max_new_tokens=24))
    assert other != texts(dec.generate(PROMPTS, seed=7, max_new_tokens=24))  # the seed still matters


SIX_PROMPTS = PROMPTS + ["Start with 2.\n\n", "Take 9. Multiply it by 2.\n\n", "Begin with 4. Add 6.\n\n"]


@SLOW  # the README's command checks a call's batching alone (the test before)
@pytest.mark.parametrize("method", ["semanticspec", "target_only", RandomPolicy(0.5)])
def test_with_one_seed_per_prompt_any_prompt_decodes_alone_as_in_its_batch(pair, method):
    """A per-prompt seed (the OpenAI API's ``seed`` is per request) makes a prompt's streams depend on
    its seed alone, so any prompt of a sampled batch decodes alone, at any position, with the same result."""
    target, draft, kw = pair
    sometimes = lambda x: (x.flatten(1)[:, 9] > 0).float()  # noqa: E731
    dec = stub_decoder(target, draft, q=sometimes, rule="threshold", tau=0.5, **kw)
    gen = {"method": method, "max_new_tokens": 24}
    for seeds in ([3, 7, 11, 0, 5, 42], [1, 1, 2, 3, 5, 8], [100 + k for k in range(6)]):
        together = texts(dec.generate(SIX_PROMPTS, seed=seeds, **gen))
        for k in range(6):
            assert texts(dec.generate([SIX_PROMPTS[k]], seed=seeds[k], **gen)) == together[k : k + 1], (seeds, k)
            assert texts(dec.generate([SIX_PROMPTS[k]], seed=[seeds[k]], **gen)) == together[k : k + 1], (seeds, k)
        assert texts(dec.generate(SIX_PROMPTS[::-1], seed=seeds[::-1], batch_size=4, **gen)) == together[::-1]
    assert together != texts(dec.generate(SIX_PROMPTS, seed=[s + 1 for s in seeds], **gen))  # the seeds still matter


def test_a_judge_suffix_that_fills_the_context_is_refused_naming_it(tiny_pair):
    # every method keeps room for SpecReason's judge turn: one longer than the context emptied every decode
    # (stop_reason "context", text "") without a word
    target, draft, tok = tiny_pair
    dec = make_decoder(target, draft, tok)
    with pytest.raises(ValueError, match=r"judge_suffix: its \d+ tokens, .* leave no room in the models' context "
                                         r"\(256 tokens\); shorten it"):
        dec.generate(PROMPTS[:1], method="target_only", max_new_tokens=4, judge_suffix=" Score" * 300)
    assert dec.generate(PROMPTS[:1], method="target_only", max_new_tokens=4, temperature=0.0,
                        allow_sampling_mismatch=True)[0].text


def test_a_bad_seed_is_refused_naming_it(tiny_pair):
    target, draft, tok = tiny_pair
    dec = stub_decoder(target, draft, tok)
    with pytest.raises(ValueError, match=r"seed holds 2 seeds for 3 prompts: give one seed per prompt"):
        dec.generate(PROMPTS, seed=[1, 2], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"seed\[1\]='x': expected integers"):
        dec.generate(PROMPTS, seed=[1, "x", 3], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"seed='7': expected an integer, or a list of one integer per prompt"):
        dec.generate(PROMPTS, seed="7", max_new_tokens=4)


LONG = "Start with 7. Add 5, then multiply it by 3. Subtract 4, then add 9. What is the result?\n\n"
RAGGED = ["Begin with 12.\n\n", LONG * 4, "Take 3. Add 1.\n\n", LONG, "Start with 2.\n\n", LONG * 2 + "Add 1.\n\n",
          "Take 9. Multiply it by 2.\n\n", LONG * 3]
"""Eight prompts of very different lengths (6 to 105 tokens)."""


def row_view(r):
    """Everything a prompt's decode decided and wrote, step by step (times left out)."""
    s = r.stats
    steps = [(t.writer, t.text, t.n_tokens, t.decision, t.q, t.p) for t in r.steps]
    return r.text, r.stop_reason, steps, (s.output_tokens, s.draft_tokens, s.steps, s.draft_steps_proposed,
                                          s.draft_steps_accepted, s.drafted_tokens, s.target_passes, s.draft_passes)


@SLOW
@pytest.mark.parametrize("rewrite", [{"token_sd": True}, {"token_sd": True, "rewrite_in_rounds": False},
                                     {"token_sd": False}], ids=["in_rounds", "rewrite_phase", "no_token_sd"])
@pytest.mark.parametrize("first", [False, True], ids=["draft_first", "target_first"])
def test_eight_ragged_prompts_decode_in_one_batch_as_one_by_one(tiny_pair, rewrite, first):
    """The lockstep batch of eight prompts of 6-105 tokens decides and samples each row as it would
    alone (text, stop reason, every step's writer/text/decision/q/p, counters), greedy and sampled."""
    target, draft, tok = tiny_pair
    sometimes = lambda x: (x.flatten(1)[:, 9] > 0).float()  # noqa: E731
    dec = stub_decoder(target, draft, tok, q=sometimes, rule="threshold", tau=0.5, target_first_step=first,
                       **rewrite)
    lengths = [len(tok(p).input_ids) for p in RAGGED]
    assert min(lengths) < 10 and max(lengths) > 100
    for gen in ({"temperature": 0.0}, {"seed": 11}):
        with record_forwards() as batch_log:
            batched = dec.generate(RAGGED, batch_size=8, max_new_tokens=40, **gen)
        with record_forwards() as single_log:
            single = dec.generate(RAGGED, batch_size=1, max_new_tokens=40, **gen)
        assert [row_view(r) for r in batched] == [row_view(r) for r in single], gen
        # the batch shares its forwards; each computes its unfinished rows at the widest feed (padding
        # included), and finished rows are dropped from the caches
        assert len(batch_log) < 0.75 * len(single_log), gen
        assert all(r.positions % r.live == 0 and r.positions >= r.tokens >= r.rows and r.live <= 8
                   for r in batch_log), gen
        assert batch_log[0].live == 8, gen
        if dec.loop_setup().token_sd and dec.loop_setup().rewrite_in_rounds and not first:
            # refused steps are rewritten in the rounds: every target forward reads every unfinished row
            assert all(r.rows == r.live for r in batch_log if r.model is target), gen
        assert sum(r.positions for r in batch_log) > sum(r.tokens for r in batch_log), gen
        decisions = [t.decision for r in batched for t in r.steps]
        assert {"accept", "reject"} <= set(decisions), gen  # both branches, in the same batch
        # idle rows (timing only): alone a row is fed by every forward; in the batch rows wait for each other
        assert all(r.stats.idle_row_s == 0 for r in single) and sum(r.stats.idle_row_s for r in batched) > 0, gen
        assert max(r.stats.done_idle_row_s for r in batched) > 0 and min(r.stats.done_idle_row_s for r in batched) >= 0
        # wall seconds (phases within the wall) and row-seconds (*_row_s) are named apart
        s = summarize(batched)
        phases = [k for k in s if k.endswith("_s") and not k.endswith(("_row_s", "_per_s")) and k != "wall_s"]
        assert sum(s[k] for k in phases) <= s["wall_s"] * (1 + 1e-6), {k: s[k] for k in phases}
        assert {"idle_row_s", "done_idle_row_s"} <= set(s) and not {"idle_s", "done_idle_s"} & set(s)


def test_the_default_policy_takes_the_fast_path_only_with_one_tokenizer(tiny_pair):
    target, draft, tok = tiny_pair
    assert SemanticSpecDecoder(target, draft, tok).policy == ProbePolicy(top_k=1)
    ctok = char_tokenizer()  # two tokenizers: no fast path by default (an explicit one is refused, above)
    two = SemanticSpecDecoder(target, tiny_llama(len(ctok), 24, 1, seed=1), tok, ctok)
    assert two.policy == ProbePolicy() and two.policy.top_k == 0


def test_a_calls_fast_path_is_refused_with_two_tokenizers_as_the_decoders_is(tiny_pair):
    """``policy=ProbePolicy(top_k=1)`` is refused with two tokenizers, but ``method=ProbePolicy(top_k=1)`` decoded."""
    target, _, tok = tiny_pair
    ctok = char_tokenizer()
    two = SemanticSpecDecoder(target, tiny_llama(len(ctok), 24, 1, seed=1), tok, ctok,
                              target_probe=ConstProbe(target.config.hidden_size))
    with pytest.raises(ValueError, match=r"top_k=1: the fast path .* needs a shared tokenizer"):
        two.generate(PROMPTS[:1], method=ProbePolicy(top_k=1), max_new_tokens=2)
    with pytest.raises(ValueError, match="top_k=2"):
        two.stream(PROMPTS[:1], method=ProbePolicy(top_k=2, rule="ratio"))
    assert two.generate(PROMPTS[:1], method=ProbePolicy(), max_new_tokens=2)[0].stats.output_tokens == 2


def test_probe_dtype_runs_a_copy_of_the_mlp_in_float16_and_refuses_bad_values(tiny_pair, monkeypatch):
    target, draft, tok = tiny_pair
    cfg = ProbeConfig(hidden_size=32, hidden_dims=[16], reads=model_fingerprint(target, tok), role="target")
    probe = SemanticProbe(cfg).eval()
    x = torch.randn(8, cfg.input_size)
    half = SemanticSpecDecoder(target, draft, tok, target_probe=probe, probe_dtype="float16").target_probe
    assert half is not probe and half.mlp_dtype == torch.float16
    assert probe.mlp_dtype == torch.float32  # the caller's probe (one being trained, say) is left as it was
    torch.testing.assert_close(half.predict(x), probe.predict(x), atol=2e-3, rtol=0)
    assert SemanticSpecDecoder(target, draft, tok, target_probe=probe, probe_dtype="float32").target_probe is probe
    probe.train()  # a module being trained: the decoder judges with an eval copy, and training goes on as it was
    held = SemanticSpecDecoder(target, draft, tok, target_probe=probe, probe_dtype="float32").target_probe
    assert probe.training and not held.training and held is not probe
    probe.eval()
    for capability, want in (("AVX512", torch.float16), ("AVX2", torch.float16), ("DEFAULT", torch.float32)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert resolve_probe_dtype("auto", torch.device("cpu")) == want
        assert SemanticSpecDecoder(target, draft, tok, target_probe=probe).target_probe.mlp_dtype == want
    assert resolve_probe_dtype("auto", torch.device("cuda")) == torch.float16
    with pytest.raises(ValueError, match=r"probe_dtype='bfloat16'; expected one of \['auto', 'float32', 'float16'\]"):
        SemanticSpecDecoder(target, draft, tok, target_probe=probe, probe_dtype="bfloat16")


@pytest.mark.gpu
def test_sampled_decoding_on_a_gpu_is_reproducible_and_batch_independent(tiny_pair):
    """The decoder's per-row streams live on the CPU; a model on a GPU draws from their twins there (a generator
    only draws on its device). Both models on the GPU, and the draft alone on it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import copy

    target, draft, tok = tiny_pair  # shared by other tests: moved as copies
    on_gpu = copy.deepcopy(target).cuda(), copy.deepcopy(draft).cuda()
    sometimes = lambda x: (x.flatten(1)[:, 9] > 0).float()  # noqa: E731
    for t, d in (on_gpu, (target, on_gpu[1])):
        dec = stub_decoder(t, d, tok, q=sometimes, rule="threshold", tau=0.5)
        batched = dec.generate(RAGGED, batch_size=8, max_new_tokens=40, seed=11)
        assert [row_view(r) for r in batched] == [row_view(r) for r in dec.generate(RAGGED, batch_size=1,
                                                                                     max_new_tokens=40, seed=11)]
        assert texts(batched) == texts(dec.generate(RAGGED, batch_size=8, max_new_tokens=40, seed=11))
        assert texts(batched) != texts(dec.generate(RAGGED, batch_size=8, max_new_tokens=40, seed=12))


@pytest.mark.parametrize("method", ["semanticspec", "target_only"])
def test_stream_yields_each_step_then_the_result_generate_returns(tiny_pair, method):
    """The loop yields one event per step it tries and one end event per prompt; generate is
    those end events' results, whatever the batch size (prompt indices are the call's)."""
    target, draft, tok = tiny_pair
    sometimes = lambda x: (x.flatten(1)[:, 9] > 0).float()  # noqa: E731
    dec = stub_decoder(target, draft, tok, q=sometimes, rule="threshold", tau=0.5)
    gen = {"method": method, "max_new_tokens": 30, "seed": 5, "batch_size": 2}
    results = dec.generate(PROMPTS, **gen)
    events = list(dec.stream(PROMPTS, **gen))
    check_stream(events, results, len(PROMPTS))
    assert {e.prompt for e in events} == set(range(len(PROMPTS)))
    if method == "semanticspec":
        assert {e.step.decision for e in events if not e.end} >= {"accept", "reject", "target"}
    with pytest.raises(ValueError, match="max_new_tokens=0"):  # refused when called, not when iterated
        dec.stream(PROMPTS, max_new_tokens=0)
    dec.last_wall_s = 0.0
    left = dec.stream(PROMPTS, **gen)
    next(left)
    left.close()  # a reader that leaves after the first event: its wall time is the stream's so far
    assert dec.last_wall_s > 0.0


def test_in_process_always_reject_writes_what_target_only_writes(tiny_pair):
    """One method table; always_reject (a random policy at rate 0) is the served decoder's check and
    runs in-process too: greedy, every draft step refused and rewritten by the target gives target-only's text."""
    target, draft, tok = tiny_pair
    dec = stub_decoder(target, draft, tok)
    spec = dec.generate(PROMPTS, method="always_reject", **GREEDY)
    assert texts(spec) == texts(dec.generate(PROMPTS, method="target_only", **GREEDY))
    assert {s.decision for r in spec for s in r.steps if s.writer == "draft"} == {"reject"}
    kept = dec.generate(PROMPTS, method="always_accept", **GREEDY)
    assert {s.decision for r in kept for s in r.steps if s.writer == "draft"} == {"accept"}


def test_a_loop_setting_is_a_field_of_the_call_or_of_the_decoders_default_config(tiny_pair):
    """The loop's settings are DecodeConfig fields: per call, or in the decoder's own config (a call without a
    config starts from it); an explicit config replaces the decoder's whole."""
    target, draft, tok = tiny_pair
    gen = dict(max_new_tokens=24, seed=3)
    plain = stub_decoder(target, draft, tok, q=0.0)
    paper = stub_decoder(target, draft, tok, q=0.0, target_first_step=True, token_sd=False)
    per_call = plain.generate(PROMPTS, target_first_step=True, token_sd=False, **gen)
    assert texts(per_call) == texts(paper.generate(PROMPTS, **gen))
    assert {r.steps[0].writer for r in per_call} == {"target"}  # the target wrote each first step
    assert {r.steps[0].writer for r in plain.generate(PROMPTS, **gen)} == {"draft"}  # the draft did (refused)
    assert {r.steps[0].writer for r in paper.generate(PROMPTS, DecodeConfig(**gen))} == {"draft"}
    two = make_decoder(target, draft, tok, draft_tokenizer=char_tokenizer())
    with pytest.raises(ValueError, match="token_sd=True .* needs a shared tokenizer"):
        two.generate(PROMPTS, token_sd=True, **gen)


def test_parts_of_the_wrong_kind_and_bad_problems_are_refused_naming_them(tiny_pair):
    """A model, tokenizer, server or task of the wrong kind is named where the decoder is built (an AttributeError
    from deep inside, or a class for a task accepted until the first prompt, before); an empty problem is refused."""
    from arithmetic_world.task import ArithmeticTask
    from semanticspec import ServedDecoder

    target, draft, tok = tiny_pair
    for args, says in [((None, draft, tok), r"target=None: expected an in-process transformers model"),
                       ((target, "draft-path", tok), r"draft='draft-path': expected an in-process transformers"),
                       ((target, draft, None), r"tokenizer=None: expected a transformers tokenizer")]:
        with pytest.raises(TypeError, match=says):
            SemanticSpecDecoder(*args)
    with pytest.raises(TypeError, match=r"task=ArithmeticTask: a class; give an instance, e.g. "
                                        r"task=ArithmeticTask\(\)"):
        SemanticSpecDecoder(target, draft, tok, task=ArithmeticTask)
    with pytest.raises(TypeError, match=r"target='http://127.0.0.1:1/v1': expected an engine client"):
        ServedDecoder("http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1")
    dec = SemanticSpecDecoder(target, draft, tok, task=ArithmeticTask())
    for problems, says in [("", r"problem 0 is empty"), (["Start with 7.", " "], r"problem 1 is empty"),
                           ({"Start with 7.": 1}, r"problems=\{.*\}: expected a list of problem texts")]:
        with pytest.raises(ValueError, match=says):
            dec.prompts(problems)
    assert dec.prompts(p for p in ["Start with 7."]) == dec.prompts(["Start with 7."])


def test_an_oracle_is_checked_when_built_and_its_answers_when_called():
    """An oracle that takes other arguments failed mid-decode; one answering "no" kept the step (truthiness)."""
    from semanticspec.policies import OraclePolicy
    from semanticspec.scores import Scores

    with pytest.raises(ValueError, match=r"expected a callable oracle\(step_text, output_so_far\)"):
        OraclePolicy(lambda text: True)
    policy = OraclePolicy(lambda text, out: "no")
    with pytest.raises(TypeError, match=r"returned 'no'; expected True or False"):
        policy.keep(Scores(text="Add 5.", output=""))
