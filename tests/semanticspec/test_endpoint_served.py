"""The endpoint in front of the embedded world's two llama.cpp servers; slow, run by ``.ci/run``.

Real clients (the ``openai`` package, sync, async, streaming) get what the served decoder decodes alone with the same
seed; a backend killed mid-stream ends that stream with an error naming the server's URL (never a key), ``/health``
reports it down, and the endpoint goes on answering.
"""

import asyncio
import json
import os
import shutil
import subprocess
import urllib.request

import pytest

from tests.conftest import Running, free_port
from arithmetic_world.task import ArithmeticTask
from tests.conftest import need_server

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
SECRET = "sk-backend-secret-4242"
TASK = ArithmeticTask()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from arithmetic_world.serve import world_server
    from semanticspec.serve.cli import ServeOptions, build

    need_server()
    logs = tmp_path_factory.mktemp("endpoint-servers")
    os.environ["ENDPOINT_TEST_BACKEND_KEY"] = SECRET  # sent to the backends; must never reach a client or a log
    with world_server("target", free_port(), log=logs / "target.log") as t, \
            world_server("draft", free_port(), log=logs / "draft.log") as d:
        app = build(ServeOptions(target_url=t.url, draft_url=d.url, target_model="target", draft_model="draft",
                                 backend_key_env="ENDPOINT_TEST_BACKEND_KEY", concurrency=4))
        running = Running(app)
        yield {"run": running, "dec": app.state.scheduler.dec, "draft": d, "target": t}
        running.stop()
        app.state.scheduler.stop(0)


def _prompt(k: int) -> str:
    from arithmetic_world.models import load_tokenizer

    return TASK.prompt_text(load_tokenizer(), TASK.problems(k + 1, seed=31)[k]["problem"])


def test_real_clients_get_what_the_served_decoder_decodes_alone(served):
    dec, run = served["dec"], served["run"]
    assert type(dec.task) is ArithmeticTask  # the world's probes: its servers serve the world, its answer marker ends
    prompts = [_prompt(k) for k in range(4)]
    want = [dec.generate([p], max_new_tokens=96, seed=50 + k)[0] for k, p in enumerate(prompts)]
    want = [w.text for w in want]
    c = run.client()
    one = c.completions.create(model="semanticspec", prompt=prompts[0], max_tokens=96, seed=50)
    assert one.choices[0].text == want[0] and one.usage.model_dump()["semanticspec"]["draft_steps_proposed"] > 0
    streamed = c.completions.create(model="semanticspec", prompt=prompts[0], max_tokens=96, seed=50, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == want[0]

    async def together():  # four at once: rows of one served loop, their requests in flight together
        a = openai.AsyncOpenAI(base_url=run.url, api_key="none", max_retries=0, timeout=300)

        async def one(k):
            s = await a.completions.create(model="semanticspec", prompt=prompts[k], max_tokens=96, seed=50 + k,
                                           stream=True)
            return "".join([ch.choices[0].text async for ch in s if ch.choices])

        return await asyncio.gather(*(one(k) for k in range(4)))

    assert asyncio.run(together()) == want
    chat = c.chat.completions.create(model="semanticspec", max_tokens=96, seed=51, messages=[
        {"role": "user", "content": TASK.problems(2, seed=31)[1]["problem"]}])  # the world's task format
    assert chat.choices[0].message.content == want[1] and chat.usage.prompt_tokens > 0
    if shutil.which("curl"):  # curl too: server-sent events ending with [DONE]
        body = json.dumps({"model": "semanticspec", "prompt": prompts[1], "max_tokens": 96, "seed": 51,
                           "stream": True})
        out = subprocess.run(["curl", "-sN", run.url + "/completions", "-H", "Content-Type: application/json", "-d",
                              body], capture_output=True, text=True, timeout=300, check=True).stdout
        events = [line[6:] for line in out.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == want[1]
    with urllib.request.urlopen(run.url[:-3] + "/health", timeout=30) as h:
        assert json.loads(h.read())["status"] == "ok"


def test_a_lone_surrogate_gets_a_400_naming_prompt_and_the_servers_go_on(served):
    import httpx2

    run = served["run"]
    r = httpx2.post(run.url + "/completions", content='{"prompt": "hi \\ud800", "max_tokens": 4}',
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    ok = run.client().completions.create(model="semanticspec", prompt=_prompt(0), max_tokens=8, seed=1)
    assert ok.choices[0].text
    assert httpx2.get(run.url[:-3] + "/health", timeout=30).json()["status"] == "ok"


def test_a_prompt_past_the_servers_context_gets_its_message_as_a_400_not_retried(served):
    with pytest.raises(openai.BadRequestError) as e:  # the world's llama.cpp servers hold 256 tokens
        served["run"].client().completions.create(model="semanticspec", prompt="3 " * 400, max_tokens=4, seed=1)
    message = e.value.body["message"]
    assert "maximum context length is 256 tokens" in message and "attempt" not in message
    assert e.value.body["param"] == "prompt"


def test_swapped_servers_are_refused(served):
    from semanticspec.serve.cli import ServeOptions, build

    with pytest.raises(ValueError, match="swapped"):
        build(ServeOptions(target_url=served["draft"].url, draft_url=served["target"].url, target_model="draft",
                           draft_model="target"))


def test_probes_the_servers_cannot_serve_are_refused_at_start_up(served):
    """The in-process probes read hidden states, which llama.cpp's server does not return: refused when the endpoint
    starts (one line, exit 2 on the command line), not as a 400 blaming every request's prompt."""
    from semanticspec.serve.cli import ServeOptions, build

    with pytest.raises(ValueError, match="these servers cannot run this decode: .*hidden"):
        build(ServeOptions(target_url=served["target"].url, draft_url=served["draft"].url, target_model="target",
                           draft_model="draft", target_probe="checkpoints/arithmetic/probes/target",
                           draft_probe="checkpoints/arithmetic/probes/draft"))


def test_chat_works_with_the_worlds_probes_named_and_without_a_tokenizer_the_400_names_tokenizer(served):
    from datamodules.tasks.worlds import default_world
    from semanticspec.serve.app import Settings, build_app
    from semanticspec.serve.cli import ServeOptions, build

    probes = default_world().model_root() / "probes-topk"
    app = build(ServeOptions(target_url=served["target"].url, draft_url=served["draft"].url, target_model="target",
                             draft_model="draft", target_probe=str(probes / "target"),
                             draft_probe=str(probes / "draft")))
    bare = build_app(app.state.scheduler.dec, Settings())
    messages = [{"role": "user", "content": TASK.problems(1, seed=31)[0]["problem"]}]
    runs = [Running(app), Running(bare)]
    try:
        chat = runs[0].client().chat.completions.create(model="semanticspec", max_tokens=96, seed=1,
                                                        messages=messages)
        assert chat.choices[0].message.content and chat.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.BadRequestError) as e:
            runs[1].client().chat.completions.create(model="semanticspec", max_tokens=8, messages=messages)
        assert "--tokenizer" in e.value.body["message"]
    finally:
        for run, a in zip(runs, (app, bare)):
            run.stop()
            a.state.scheduler.stop(0)


def test_a_backend_killed_mid_stream_ends_the_stream_with_an_error_naming_it(served, capfd):
    run, draft = served["run"], served["draft"]
    url = draft.url.removesuffix("/v1")
    c = run.client(timeout=300)
    stream = c.completions.create(model="semanticspec", prompt=_prompt(5), max_tokens=96, seed=1, stream=True,
                                  extra_body={"lookahead": 1})
    chunks = iter(stream)
    next(chunks)
    draft.stop()  # the draft's server dies while the stream is open
    with pytest.raises(openai.APIError) as e:
        for _ in chunks:
            pass
    assert url in str(e.value) and SECRET not in str(e.value)
    with pytest.raises(urllib.error.HTTPError) as h:
        urllib.request.urlopen(run.url[:-3] + "/health", timeout=30)
    body = json.loads(h.value.read())
    assert h.value.code == 503 and body["backends_down"] == [url]
    assert [m.id for m in c.models.list()] == ["semanticspec"]  # the endpoint goes on answering
    with pytest.raises(openai.APIStatusError) as later:  # a new request fails with the server named, as a 502
        c.completions.create(model="semanticspec", prompt=_prompt(6), max_tokens=32, seed=2)
    assert later.value.status_code == 502 and url in later.value.message
    out, err = capfd.readouterr()
    assert SECRET not in out + err
