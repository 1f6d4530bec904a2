"""Judges: LLM (yes/no log-probs), HTTP (OpenAI-compatible, local server), NLI; disk cache; both directions."""

import socket

import pytest
import torch

from arithmetic_world.tokenizer import JUDGE_TEMPLATE
from arithmetic_world.train import judge_yes_prob
from generation.engines.base import Unreachable
from datamodules.labels.judges import HTTPJudge, JudgeCache, LLMJudge, NLIJudge, OracleJudge
from tests.conftest import tiny_llama
from tests.fake_openai import FakeJudgeServer

PAIRS = [("3 + 4 = 7.", "Adding 4 to 3 gives 7."), ("3 + 4 = 7.", "3 + 4 = 8."),
         ("5 * 2 = 10.", "5 times 2 equals 10.")]


def test_llm_judge_reads_yes_no_probabilities(world_tokenizer):
    model = tiny_llama(len(world_tokenizer), seed=3)
    judge = LLMJudge(model, world_tokenizer, JUDGE_TEMPLATE, batch_size=2)
    got = judge.prob_same(PAIRS)
    want = judge_yes_prob(model, world_tokenizer, PAIRS).tolist()  # the world's own scoring
    assert got == pytest.approx(want, abs=1e-5)
    fwd, bwd = got, judge.prob_same([(b, a) for a, b in PAIRS])
    assert judge.score(PAIRS) == pytest.approx([(f + b) / 2 for f, b in zip(fwd, bwd)])
    assert judge.same(PAIRS) == [s >= 0.5 for s in judge.score(PAIRS)]


def test_both_directions_are_asked_and_cached_on_disk(world_tokenizer, tmp_path):
    model = tiny_llama(len(world_tokenizer), seed=3)
    judge = LLMJudge(model, world_tokenizer, JUDGE_TEMPLATE, cache_dir=tmp_path)
    judge.same(PAIRS)
    assert judge.calls == 2 * len(PAIRS) and judge.cache_hits == 0
    again = LLMJudge(model, world_tokenizer, JUDGE_TEMPLATE, cache_dir=tmp_path)
    again._prob_same = lambda pairs: pytest.fail("the cache should have answered")
    assert again.score(PAIRS) == judge.score(PAIRS)
    assert again.calls == 0 and again.cache_hits == 2 * len(PAIRS)
    other = LLMJudge(model, world_tokenizer, JUDGE_TEMPLATE.replace("Same", "Same same"), cache_dir=tmp_path)
    other.same(PAIRS[:1])
    assert other.calls == 2  # the key holds the judge's identity, not only the texts
    # a line cut by a kill is ignored
    with open(next(tmp_path.glob("answers-*.jsonl")), "a") as f:
        f.write('{"k": "abc", "p"')
    assert len(JudgeCache(tmp_path).memory) == 2 * len(PAIRS) + 2


def test_oracle_judge_knows_meanings():
    assert OracleJudge().same(PAIRS) == [True, False, True]


def _tiny_nli(world_tokenizer, id2label):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(world_tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, num_labels=len(id2label), id2label=id2label,
                     label2id={v: k for k, v in id2label.items()}, pad_token_id=0)
    return BertForSequenceClassification(cfg).eval()


def test_nli_judge_needs_entailment_both_ways(world_tokenizer):
    model = _tiny_nli(world_tokenizer, {0: "contradiction", 1: "neutral", 2: "entailment"})
    judge = NLIJudge(model, world_tokenizer)
    assert judge.label == 2 and judge.combine == "both"
    fwd = judge.prob_same(PAIRS)
    bwd = judge.prob_same([(b, a) for a, b in PAIRS])
    enc = world_tokenizer([PAIRS[0][0]], [PAIRS[0][1]], return_tensors="pt")
    assert fwd[0] == pytest.approx(torch.softmax(model(**enc).logits, -1)[0, 2].item(), abs=1e-5)
    assert judge.score(PAIRS) == pytest.approx([min(f, b) for f, b in zip(fwd, bwd)])
    with pytest.raises(ValueError, match="entailment class"):
        NLIJudge(_tiny_nli(world_tokenizer, {0: "a", 1: "b"}), world_tokenizer)


@pytest.fixture()
def server():
    s = FakeJudgeServer()
    yield s
    s.close()


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_http_judge_against_a_local_server(server, monkeypatch, api):
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-secret-123")
    judge = HTTPJudge(server.url, "tiny", "Step A: {a}\nStep B: {b}\nSame?", api=api, api_key_env="MY_JUDGE_KEY",
                      timeout=5, concurrency=2)
    assert judge.same(PAIRS) == [True, False, True]
    probs = judge.prob_same(PAIRS[:2])
    p_yes = 1 / (1 + torch.exp(torch.tensor(-2.4)).item())
    assert probs == pytest.approx([p_yes, 1 - p_yes], abs=1e-6)
    path, headers, body = server.requests[0]
    assert path == ("/v1/chat/completions" if api == "chat" else "/v1/completions")
    headers = {k.lower(): v for k, v in headers.items()}
    assert headers["authorization"] == "Bearer sk-secret-123" and body["model"] == "tiny" and body["max_tokens"] == 1


def test_http_judge_retries_then_succeeds():
    server = FakeJudgeServer(fail_first=2)
    try:
        judge = HTTPJudge(server.url, "tiny", "Step A: {a}\nStep B: {b}", retries=3, concurrency=1)
        assert judge.prob_same(PAIRS[:1])[0] > 0.5
        assert len(server.requests) == 3
    finally:
        server.close()


def test_an_http_judge_with_the_same_word_for_both_answers_is_refused():
    """As the LLM judge refuses answers that start with the same token: P(same) would read one word twice."""
    with pytest.raises(ValueError, match=r"answers 'Yes' and ' yes' are the same word; give distinct answers"):
        HTTPJudge("http://127.0.0.1:9/v1", "tiny", "{a} {b}", yes="Yes", no=" yes")


def test_unreachable_endpoint_fails_after_retries_naming_url_not_key(monkeypatch):
    monkeypatch.setenv("MY_JUDGE_KEY", "sk-secret-123")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    judge = HTTPJudge(f"http://127.0.0.1:{port}/v1", "tiny", "{a} {b}", api_key_env="MY_JUDGE_KEY", retries=2,
                      timeout=1)
    with pytest.raises(Unreachable) as err:  # an EngineError the CLIs catch by type
        judge.same(PAIRS[:1])
    msg = str(err.value)
    assert f"http://127.0.0.1:{port}/v1/chat/completions" in msg and "2 attempt" in msg
    assert "sk-secret-123" not in msg and "sk-secret-123" not in repr(judge.__dict__)
