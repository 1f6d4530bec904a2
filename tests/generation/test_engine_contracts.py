"""Contract tests: every engine client against every recorded answer shape of the engine versions it claims.

``tests/fixtures/engines/<engine>-<version>.json`` hold what a version of an engine is asked and answers (the
request fields that matter, the response as the engine's code writes it) and the engine file and function each
shape comes from. A replay server answers the client's requests from a fixture (a request that matches no recorded
one is a 500, so a client that asks differently fails), and the client's typed answer must equal the fixture's
``expect``. Versions below a client's floor must be refused before any request that reads or writes. The fakes in
``tests/fake_engines.py`` are checked against the same fixtures' shapes.
"""

import json
from pathlib import Path

import pytest
import torch
from packaging.version import Version

from generation.engines import make_engine
from generation.engines.base import MalformedAnswer, Unsupported
from generation.engines.openai_compat import VLLM_MIN_VERSION
from generation.engines.sglang import MIN_VERSION as SGLANG_MIN_VERSION, READ_TOKENS
from generation.specs import SamplingSpec, StepSpec
from tests.fake_engines import FakeSGLang, FakeVLLM, _Server

FIXTURES = sorted((Path(__file__).resolve().parents[1] / "fixtures" / "engines").glob("*.json"))
FLOORS = {"sglang": SGLANG_MIN_VERSION, "vllm": VLLM_MIN_VERSION}
GREEDY = SamplingSpec(0.0, 1.0)


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _matches(want, got) -> bool:
    """``want``'s fields (recursively, for dicts) are in ``got`` with the same values."""
    if isinstance(want, dict):
        return isinstance(got, dict) and all(k in got and _matches(v, got[k]) for k, v in want.items())
    return want == got


class Replay(_Server):
    """Answers each request with the first recorded exchange of its route whose request fields it carries."""

    def __init__(self, fixture: dict):
        self.unmatched: list[tuple[str, dict]] = []
        get = {x["route"]: (lambda x=x: (200, x["response"])) for x in fixture["exchanges"] if x["method"] == "GET"}
        posts = [x for x in fixture["exchanges"] if x["method"] == "POST"]

        def answer(route):
            def f(body, headers):
                for x in posts:
                    if x["route"] == route and _matches(x["request"], body):
                        return 200, x["response"]
                self.unmatched.append((route, body))
                return 500, {"error": {"message": f"no recorded exchange for this {route} request"}}
            return f

        super().__init__(get, {r: answer(r) for r in {x["route"] for x in posts}})


@pytest.fixture(params=FIXTURES, ids=[p.stem for p in FIXTURES])
def recorded(request):
    fixture = _load(request.param)
    server = Replay(fixture)
    yield fixture, server
    server.close()


def test_every_fixture_names_its_source():
    assert FIXTURES, "no engine fixtures found"
    for path in FIXTURES:
        fx = _load(path)
        assert path.stem == f"{fx['engine']}-{fx['version']}"
        assert fx["sources"] and all({"repo", "file", "function", "what"} <= set(s) for s in fx["sources"])
        assert all({"route", "method", "request", "response"} <= set(x) for x in fx["exchanges"])


def test_each_client_answers_every_version_it_claims_and_refuses_the_rest(recorded):
    fixture, server = recorded
    kind, version = fixture["engine"], fixture["version"]
    claimed = Version(version) >= Version(FLOORS[kind])
    assert claimed == ("refused" not in fixture["expect"])
    if not claimed:
        with pytest.raises(Unsupported, match=fixture["expect"]["refused"]) as e:
            make_engine(kind, server.root, api_key_env="", retries=1, timeout=10.0)
        assert server.root in str(e.value) and version in str(e.value) and not server.requests
        return
    engine = make_engine(kind, server.root, api_key_env="", retries=1, timeout=10.0)
    assert engine.version == version
    card = next(x for x in fixture["exchanges"] if x["route"] == "/v1/models")["response"]["data"][0]
    # the context the server states; SGLang's less what its reads ask for past it (it refuses input + max_new_tokens
    # >= its context_len, tokenizer_manager.py _validate_one_request)
    stated = card["max_model_len"]
    assert engine.context_length == (stated - READ_TOKENS if kind == "sglang" else stated)
    want = fixture["expect"]["read"]
    r = engine.read(want["context"], want["step"], top_k=want["top_k"], hidden=want["hidden"], sampling=GREEDY, seed=0)
    assert not server.unmatched, server.unmatched
    assert (r.step.ids, r.step.tokens) == (want["ids"], want["tokens"])
    torch.testing.assert_close(r.step.logprobs, torch.tensor(want["logprobs"]))
    torch.testing.assert_close(r.step.top, torch.tensor(want["top"]))
    if want["hidden_rows"] is None:
        assert r.hidden is None
    else:
        torch.testing.assert_close(r.hidden, torch.tensor(want["hidden_rows"]))
    assert (r.next_text, r.next_eos) == (want["next_text"], want["next_eos"])
    assert (r.usage.cached_tokens, r.usage.prefill_tokens) == (want["cached_tokens"], want["prefill_tokens"])
    if "hidden_refused" in fixture["expect"]:  # a version whose hidden rows cannot be trusted: refused for hidden
        caps = engine.capabilities()
        assert not caps.hidden and fixture["expect"]["hidden_refused"] in caps.remarks[0]
    want = fixture["expect"]["write"]
    w = engine.write(want["context"], step=StepSpec(tuple(want["delimiters"]), want["max_tokens"]),
                     max_tokens=want["max_tokens"], sampling=GREEDY, seed=0, top_k=want["top_k"])
    assert not server.unmatched, server.unmatched
    assert (w.text, w.stop) == (want["text"], want["stop"])
    torch.testing.assert_close(w.tokens.logprobs, torch.tensor(want["logprobs"]))
    torch.testing.assert_close(w.tokens.top, torch.tensor(want["top"]))


def _keys(exchange: dict) -> tuple[set, set]:
    """The answer's top-level keys and those of its ``meta_info`` (SGLang) or first choice (vLLM)."""
    got = exchange["response"]
    inner = got.get("meta_info") or (got.get("choices") or [{}])[0]
    return set(got), set(inner)


@pytest.mark.parametrize("path", [p for p in FIXTURES if "refused" not in _load(p)["expect"]], ids=lambda p: p.stem)
def test_the_fakes_answer_with_the_recorded_shapes(path):
    """The fakes' answers carry every field the engine's answer carries, with the same null-first positions."""
    fixture = _load(path)
    kind = fixture["engine"]
    fake = FakeSGLang(version=fixture["version"]) if kind == "sglang" else FakeVLLM(version=fixture["version"])
    try:
        engine = make_engine(kind, fake.root, api_key_env="", retries=1, timeout=10.0)
        want = fixture["expect"]["read"]
        engine.read(want["context"], want["step"], top_k=2, hidden=want["hidden"], sampling=GREEDY, seed=0)
        engine.write(want["context"], step=StepSpec(("\n\n",), 8), max_tokens=8, sampling=GREEDY, seed=0, top_k=2)
        route = "/generate" if kind == "sglang" else "/v1/completions"
        recorded = [x for x in fixture["exchanges"] if x["route"] == route]
        answers = [fake.answers[i] for i in range(len(fake.answers)) if fake.answers[i][0] == route]
        for x, (_, got) in zip(recorded, answers):
            want_top, want_inner = _keys(x)
            got_top, got_inner = _keys({"response": got})
            assert want_top <= got_top and want_inner <= got_inner, (want_inner - got_inner, want_top - got_top)
        if kind == "sglang":
            meta = answers[0][1]["meta_info"]
            assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
        else:
            assert answers[0][1]["choices"][0]["prompt_logprobs"][0] is None
            assert answers[0][1]["usage"]["prompt_tokens_details"] is None
    finally:
        fake.close()


@pytest.mark.parametrize("name,field", [("sglang-0.5.23", "input_token_logprobs"), ("vllm-0.34.0", "prompt_logprobs"),
                                        ("vllm-0.34.0", "logprobs")])
def test_a_malformed_answer_names_the_url_and_the_field_never_the_key(name, field, monkeypatch):
    monkeypatch.setenv("CONTRACT_KEY", "sk-contract-secret-9")
    fixture = _load(FIXTURES[0].parent / f"{name}.json")
    for x in fixture["exchanges"]:
        got = x["response"] if isinstance(x["response"], dict) else {}
        for inner in [got.get("meta_info")] + list(got.get("choices") or []):
            if isinstance(inner, dict) and field in inner:
                inner[field] = None
    server = Replay(fixture)
    try:
        engine = make_engine(fixture["engine"], server.root, api_key_env="CONTRACT_KEY", retries=1, timeout=10.0)
        want = fixture["expect"]["read"]
        with pytest.raises(MalformedAnswer) as e:
            engine.read(want["context"], want["step"], top_k=2, hidden=want["hidden"], sampling=GREEDY, seed=0)
        msg = str(e.value)
        assert server.root in msg and field in msg and "sk-contract-secret-9" not in msg
    finally:
        server.close()
