"""The world's models as GGUF: llama.cpp tokenizes, scores and writes as the world does.

Fast tier: no server. ``llama_cpp.Llama(vocab_only=True)`` reads the GGUF tokenizer; a full ``Llama``
scores texts in-process. Slow tier: a real ``python -m llama_cpp.server`` from :func:`world_server`.
``.ci/run`` installs llama-cpp-python before the tests run, so under ``CI=1`` a missing one fails.
"""

import json
import os
import shutil
import urllib.request

import numpy as np
import pytest
import torch
from generation.specs import SamplingSpec

from arithmetic_world import task
from arithmetic_world.tokenizer import JUDGE_TEMPLATE

ATOL = 5e-4
"""Largest |log p(transformers) - log p(llama.cpp, f32 KV)| allowed, over the whole vocabulary at every position.

Measured on 30 world texts (problem + trace, 1803 positions, all 513 tokens): target 3.2e-5, draft 1.0e-4,
judge 2.5e-4. With llama.cpp's default f16 KV cache: 9.6e-3, 4.7e-2, 4.8e-2."""


def _llama_cpp():
    import importlib.util

    missing = [m for m in ("llama_cpp", "gguf") if importlib.util.find_spec(m) is None]
    if missing and os.environ.get("CI"):
        pytest.fail(f"{missing} not installed; .ci/run installs them (.ci/install-llama-server.sh, the dev extra)")
    if missing:
        pytest.skip(f"needs {missing}: pip install 'llama-cpp-python[server]' gguf")
    import llama_cpp

    return llama_cpp


@pytest.fixture(scope="module")
def world():
    from arithmetic_world.models import load_tokenizer

    _llama_cpp()
    return load_tokenizer()


def _vocab(role="target"):
    from arithmetic_world.gguf import world_gguf

    return _llama_cpp().Llama(model_path=str(world_gguf(role)), vocab_only=True, verbose=False)


def _world_texts(tok) -> list[str]:
    """Everything the world writes from its templates: problems, traces, both joined, judge prompts, answers, pieces."""
    problems = task.generate_problems(300, 7) + task.generate_problems(100, 8, task.TaskConfig(min_ops=4, max_ops=4))
    texts = [t for p in problems for t in (p.problem, p.trace, p.problem + task.STEP_DELIMITER + p.trace)]
    steps = [s for p in problems[:100] for s in p.trace.split(task.STEP_DELIMITER)]
    texts += [JUDGE_TEMPLATE.format(a=a, b=b) for a, b in zip(steps, steps[7:] + steps[:7])]
    texts += [task.answer_line(n) for n in range(200)]
    return texts + [p for p in tok.get_vocab() if p not in tok.all_special_tokens]


def _sampled_texts(tok, role: str, n_prompts: int = 40) -> list[str]:
    """Contexts + continuations the world's model samples at temperature 1 (about 2,800 tokens), decoded."""
    from arithmetic_world.models import load_model
    from generation.sampling import generate

    prompts = [tok(p.problem + task.STEP_DELIMITER).input_ids for p in task.generate_problems(n_prompts, 21)]
    outs = generate(load_model(role), prompts, max_new_tokens=120, sampling=SamplingSpec(1.0, 1.0), num_samples=2,
                    generator=torch.Generator().manual_seed(0), eos_token_id=tok.eos_token_id)
    assert sum(map(len, outs)) > 1000
    return [tok.decode(prompts[i // 2] + o, skip_special_tokens=True) for i, o in enumerate(outs)]


def _mismatches(tok, vocab, texts):
    return [(t, tok(t).input_ids, vocab.tokenize(t.encode(), add_bos=True, special=True)) for t in texts
            if tok(t).input_ids != vocab.tokenize(t.encode(), add_bos=True, special=True)]


def test_gguf_tokenizer_tokenizes_every_world_text_as_the_world_does(world):
    texts = _world_texts(world)
    vocab = _vocab()
    assert len(texts) > 1700 and vocab.n_vocab() == len(world)
    assert _mismatches(world, vocab, texts) == []
    assert [t for t in texts if vocab.detokenize(vocab.tokenize(t.encode(), add_bos=False)).decode() != t] == []
    specials = "<bos>Answer: 4<eos><pad><unk>"
    assert vocab.tokenize(specials.encode(), add_bos=False,
                          special=True) == world(specials, add_special_tokens=False).input_ids


@pytest.mark.parametrize("role", ["draft", pytest.param("target", marks=pytest.mark.slow)])  # target: 6 s on 2 cores
def test_gguf_tokenizer_agrees_on_what_the_models_sample(world, role):
    texts = _sampled_texts(world, role)
    vocab = _vocab()
    assert _mismatches(world, vocab, texts) == []
    assert [t for t in texts if vocab.detokenize(vocab.tokenize(t.encode(), add_bos=False)).decode() != t] == []


def test_only_eos_reads_as_nothing(world):
    """Only <eos> is a control token (llama.cpp detokenizes those to ""): <bos>, <pad> and <unk> read as their
    text, so the server's text-keyed ``top_logprobs`` never merges two of them (the target has <bos> and <eos>
    in one position's top-20 on ~1% of positions; merged, a log-prob was lost). The server never detokenizes the
    prompt's <bos>: completions detokenize the new tokens only, and echo drops <bos> by id."""
    vocab = _vocab()
    assert vocab.detokenize(vocab.tokenize(b" 98", add_bos=True)) == b"<bos> 98"
    assert vocab.detokenize(vocab.tokenize(b" 98", add_bos=False)) == b" 98"
    assert vocab.detokenize([world.eos_token_id]) == b""
    assert [vocab.detokenize([t]) for t in (world.bos_token_id, world.pad_token_id, world.unk_token_id)] == \
        [b"<bos>", b"<pad>", b"<unk>"]


def test_newline_runs_split_as_the_world_does(world):
    """Three newlines tie at two tokens; "\\n\\n" is user-defined so llama.cpp takes it first, as the regex."""
    vocab = _vocab()
    for t in ["\n\n\n", "12.\n\n\n\n\n24", "\n \n\n\n", "Answer: 4\n\n\n"]:
        assert vocab.tokenize(t.encode(), add_bos=True, special=True) == world(t).input_ids, repr(t)


def test_every_role_shares_the_vocabulary(world):
    vocabs = {r: _vocab(r) for r in ("target", "draft", "judge")}
    pieces = {r: [v.detokenize([i]) for i in range(len(world))] for r, v in vocabs.items()}
    assert pieces["target"] == pieces["draft"] == pieces["judge"]


def _max_logprob_gap(model, llm, tok, texts) -> float:
    worst = 0.0
    for text in texts:
        ids = tok(text).input_ids
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        llm.reset()
        llm.eval(ids)
        got = torch.log_softmax(torch.tensor(np.array(llm.scores[: len(ids)])), -1)
        worst = max(worst, (got - ref).abs().max().item())
    return worst


@pytest.mark.parametrize("role", ["target", "draft"])
def test_llama_cpp_logprobs_equal_transformers_with_f32_kv(world, role):
    """All positions, all tokens, 6 world texts: within ATOL with an f32 KV cache; the f16 default is far off."""
    from arithmetic_world.gguf import world_gguf
    from arithmetic_world.models import load_model

    llama_cpp = _llama_cpp()
    texts = [p.problem + task.STEP_DELIMITER + p.trace for p in task.generate_problems(6, 11)]
    model, path = load_model(role), str(world_gguf(role))
    gaps = {}
    for name, kv in {"f32": dict(type_k=0, type_v=0), "f16": {}}.items():
        llm = llama_cpp.Llama(model_path=path, n_ctx=256, logits_all=True, verbose=False, n_threads=1, **kv)
        gaps[name] = _max_logprob_gap(model, llm, world, texts)
    assert gaps["f32"] <= ATOL, gaps
    assert gaps["f16"] > max(10 * gaps["f32"], ATOL), gaps


def test_world_gguf_is_written_once_and_again_when_the_weights_change(tmp_path):
    """The cache key follows the weights: same weights, same file (not rewritten); new weights, a new file, old
    removed."""
    from safetensors.torch import load_file, save_file

    from arithmetic_world.gguf import world_gguf
    from arithmetic_world.models import model_dir

    _llama_cpp()
    root = tmp_path / "world"
    shutil.copytree(model_dir("draft"), root / "draft")
    first = world_gguf("draft", tmp_path / "cache", root)
    stamp = first.stat().st_mtime_ns
    assert world_gguf("draft", tmp_path / "cache", root) == first and first.stat().st_mtime_ns == stamp
    weights = load_file(root / "draft" / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 2
    save_file(weights, root / "draft" / "model.safetensors", metadata={"format": "pt"})
    second = world_gguf("draft", tmp_path / "cache", root)
    assert second != first and second.is_file() and not first.exists()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [second.name]


def test_world_server_serves_the_cached_gguf_with_f32_kv():
    from arithmetic_world.serve import LlamaServer, world_server
    from arithmetic_world.gguf import world_gguf

    _llama_cpp()
    server = world_server("draft", 8899)
    cmd = server.command()
    assert (server.alias, server.n_ctx, server.path) == ("draft", 256, world_gguf("draft"))
    assert cmd[cmd.index("--type_k") + 1] == cmd[cmd.index("--type_v") + 1] == "0"
    assert cmd[cmd.index("--n_threads") + 1] == "1" and cmd[cmd.index("--model_alias") + 1] == "draft"
    assert "--type_k" not in LlamaServer(str(server.path), 8899, "x").command()


def test_export_refuses_a_model_llama_gguf_cannot_hold(tmp_path):
    from arithmetic_world.gguf import export_gguf
    from arithmetic_world.models import model_dir

    _llama_cpp()
    shutil.copytree(model_dir("draft"), tmp_path / "draft")
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    cfg["attention_bias"] = True
    (tmp_path / "draft" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="attention_bias=True"):
        export_gguf("draft", tmp_path / "x.gguf", tmp_path)
    assert not (tmp_path / "x.gguf").exists()


# --------------------------------------------------------------------------- slow: a real llama.cpp server

PORT = 8823
GREEDY = {"temperature": 0, "repeat_penalty": 1.0}
"""Greedy as in-process: the server's default ``repeat_penalty`` is 1.1 and it changes greedy text."""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from arithmetic_world.serve import server_available, world_server
    from arithmetic_world.models import load_model, load_tokenizer

    _llama_cpp()
    if not server_available():
        if os.environ.get("CI"):
            pytest.fail("llama-cpp-python[server] is not installed; .ci/run installs it")
        pytest.skip("llama-cpp-python[server] is not installed")
    log = tmp_path_factory.mktemp("world-server") / "target.log"
    with world_server("target", PORT, log=log) as server:
        yield server, load_model("target"), load_tokenizer()


def _complete(server, **body):
    req = urllib.request.Request(server.url + "/completions", data=json.dumps({"model": "target", **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def _text(tok, token: int) -> str:
    """A token as the server's ``top_logprobs`` keys it: its text, "" for <eos> (the one control token)."""
    return "" if token == tok.eos_token_id else tok.convert_ids_to_tokens(token)


def _greedy(model, tok, prompt: str) -> str:
    from generation.sampling import generate

    out = generate(model, [tok(prompt).input_ids], max_new_tokens=200, sampling=SamplingSpec(0, 1.0),
                   eos_token_id=tok.eos_token_id)
    return tok.decode(out[0], skip_special_tokens=True)


@pytest.mark.slow
def test_served_echo_logprobs_equal_in_process(served):
    """``echo`` + ``logprobs: 20`` + ``max_tokens: 1``, as llama-cpp-python 0.3.36 answers it:

    - ``tokens`` are the prompt's tokens WITHOUT <bos>, then the generated token (none when it is <eos>);
      entry i scores ``ids[i + 1]`` given ``ids[: i + 1]`` (``ids`` with <bos>), so it is aligned;
    - entry 0 has ``token_logprobs`` and ``top_logprobs`` None (an OpenAI habit; llama.cpp did compute it);
    - ``text_offset[i]`` is the character offset of ``tokens[i]`` in the prompt text;
    - ``top_logprobs[i]`` is a dict keyed by token TEXT: the k best, plus the token itself when it is not
      among them (k or k + 1 entries). Control tokens (<eos>, <pad>, ...) all detokenize to "", so two of
      them in the top k collapse into one key;
    - ``usage.prompt_tokens`` counts <bos> (len(ids)); every request re-reports the whole prompt, also
      when the server's slot reused the prefix.
    """
    server, model, tok = served
    for p in task.generate_problems(4, 31):
        steps = p.trace.split(task.STEP_DELIMITER)
        prompt = p.problem + task.STEP_DELIMITER + task.STEP_DELIMITER.join(steps[:2]) + task.STEP_DELIMITER
        ids = tok(prompt).input_ids
        ref = _logprobs(model, ids)
        out = _complete(server, prompt=prompt, echo=True, logprobs=20, max_tokens=1, **GREEDY)
        lp, n = out["choices"][0]["logprobs"], len(ids) - 1
        assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}
        assert lp["tokens"][:n] == tok.convert_ids_to_tokens(ids[1:]) and len(lp["tokens"]) == n + 1
        assert lp["tokens"][n] == tok.convert_ids_to_tokens(int(ref[-1].argmax()))
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(prompt.startswith(t, o) for t, o in zip(lp["tokens"][:n], lp["text_offset"]))
        for i in range(1, n + 1):
            token = ids[i + 1] if i < n else int(ref[-1].argmax())
            assert abs(lp["token_logprobs"][i] - ref[i, token].item()) <= ATOL
            top = ref[i].topk(20)
            want = {_text(tok, j): v for j, v in zip(top.indices.tolist(), top.values.tolist())}
            got = lp["top_logprobs"][i]
            assert set(got) == set(want) | {_text(tok, token)}
            assert all(abs(got[t] - v) <= ATOL for t, v in want.items() if t)


@pytest.mark.slow
def test_served_greedy_equals_in_process_greedy(served):
    """Greedy (``temperature: 0``, ``repeat_penalty: 1.0``) writes the in-process greedy text, to <eos>.

    <eos> is not in the text, the tokens or ``completion_tokens``, and ``finish_reason`` is "stop"."""
    server, model, tok = served
    for p in task.generate_problems(5, 32):
        prompt = p.problem + task.STEP_DELIMITER
        want = _greedy(model, tok, prompt)
        out = _complete(server, prompt=prompt, max_tokens=200, logprobs=1, **GREEDY)
        choice = out["choices"][0]
        assert choice["text"] == want and choice["finish_reason"] == "stop"
        assert "".join(choice["logprobs"]["tokens"]) == want
        assert out["usage"]["completion_tokens"] == len(tok(want, add_special_tokens=False).input_ids)


@pytest.mark.slow
def test_served_stop_and_eos_answers(served):
    """What ``stop``, <eos> and ``max_tokens`` do to the answer:

    - a matched stop string is cut from ``text``, but the token holding it stays in ``tokens`` (with
      its log-prob) and in ``completion_tokens``; a stop string inside a token ("\\n" in "\\n\\n") cuts
      the text there the same way;
    - <eos> next: nothing is generated; ``finish_reason`` is "stop" as for a stop string (tell them apart
      by the tokens: after a stop string their text ends with it);
    - ``max_tokens`` reached: "length".
    """
    server, model, tok = served
    p = task.generate_problems(1, 33)[0]
    prompt = p.problem + task.STEP_DELIMITER
    first_step = _greedy(model, tok, prompt).split(task.STEP_DELIMITER)[0]
    for stop in ("\n\n", "\n"):
        out = _complete(server, prompt=prompt, max_tokens=60, logprobs=1, stop=[stop], **GREEDY)
        choice = out["choices"][0]
        assert choice["text"] == first_step and choice["finish_reason"] == "stop"
        assert choice["logprobs"]["tokens"][-1] == "\n\n" and choice["logprobs"]["token_logprobs"][-1] < 0
        assert "".join(choice["logprobs"]["tokens"]) == first_step + "\n\n"
        assert out["usage"]["completion_tokens"] == len(choice["logprobs"]["tokens"])
    whole = p.problem + task.STEP_DELIMITER + p.trace
    assert _logprobs(model, tok(whole).input_ids)[-1].argmax() == tok.eos_token_id
    out = _complete(server, prompt=whole, echo=True, max_tokens=1, logprobs=5, **GREEDY)
    choice = out["choices"][0]
    assert choice["text"] == whole and choice["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 0
    assert len(choice["logprobs"]["tokens"]) == len(tok(whole).input_ids) - 1  # no row for the <eos> it chose
    out = _complete(server, prompt=prompt, max_tokens=3, **GREEDY)
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 3


@pytest.mark.slow
def test_served_seed_is_honoured_and_n_is_not(served):
    """``seed`` makes a sample reproducible; ``n`` > 1 still gives one choice (fan out with seeds instead).

    The server's sampling defaults are not the in-process sampler's: ``top_k`` 40, ``min_p`` 0.05,
    ``repeat_penalty`` 1.1 over the last 64 tokens (it changes greedy text too), and llama-cpp-python
    chains top-k, typical, top-p, min-p, then temperature, so top-p cuts the untempered distribution.
    Send ``top_k: 0, min_p: 0, repeat_penalty: 1`` (and temperature 1 or top_p 1) to sample as in-process.
    """
    server, _, _ = served
    prompt = task.generate_problems(1, 34)[0].problem + task.STEP_DELIMITER
    body = dict(prompt=prompt, max_tokens=60, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repeat_penalty=1.0)
    texts = [_complete(server, seed=s, **body)["choices"][0]["text"] for s in (5, 5, 6, 7)]
    assert texts[0] == texts[1] and len(set(texts)) >= 2
    assert len(_complete(server, seed=5, n=3, **body)["choices"]) == 1


def test_the_gguf_cache_key_follows_the_format_and_the_model_files_not_the_exporters_source(monkeypatch, tmp_path):
    """A cached GGUF is written again when the exporter's format version or a model file changes; an edit of the
    exporter that changes no byte it writes (a comment) keeps the cache."""
    from arithmetic_world import gguf, models

    key = gguf.weights_key("draft")
    source = gguf.__file__
    monkeypatch.setattr(gguf, "__file__", str(tmp_path / "edited.py"))  # the key no longer reads its own source
    assert gguf.weights_key("draft") == key
    monkeypatch.setattr(gguf, "__file__", source)
    monkeypatch.setattr(gguf, "GGUF_FORMAT", gguf.GGUF_FORMAT + 1)
    assert gguf.weights_key("draft") != key
    monkeypatch.undo()
    copy = tmp_path / "draft"
    shutil.copytree(models.model_dir("draft"), copy)
    assert gguf.weights_key("draft", tmp_path) == key
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))
    assert gguf.weights_key("draft", tmp_path) != key
