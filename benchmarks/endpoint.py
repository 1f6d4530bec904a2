"""Endpoint benchmark: SemanticSpec against target-only through `python -m semanticspec.serve`, at concurrency 1, 8
and 32.

The endpoint runs as its own process (the embedded world in-process, or with ``--served`` in front of the world's
two llama.cpp servers); clients stream completions with the ``openai`` package's async client, each of ``c`` workers
sending its next request when its last one ends. Per method and concurrency it reports tokens/s (completion tokens
over the wave's wall time) and p50/p95 of time-to-first-token and end-to-end latency. At concurrency 1 it compares
the endpoint's wall time with the Python API's (``generate``, one prompt at a time, the same prompts and seeds, in
this process with the same torch threads), interleaved: the endpoint's overhead.

Then a chaos run (``chaos`` in the JSON): ``--chaos_clients`` streaming clients (32) for ``--chaos_seconds`` (60), of
whose requests 10% disconnect after their first chunk and 5% send a bad body (a lone surrogate, NaN, a wrong type,
broken JSON...). Every other request must stream the text the Python API decodes for its prompt and seed alone; every
bad body must get OpenAI's error JSON; ``/health`` must stay ok; and the steps decoded for abandoned requests after
their cancel (the endpoint's ``semanticspec_max_steps_after_cancel``) must stay within one round (a window: at most
the shipped window's steps).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import harness
from generation.paths import folder_problem

METHODS = ("semanticspec", "target_only")


@contextlib.contextmanager
def endpoint(args: list[str], threads: int, log: Path):
    """``python -m semanticspec.serve`` on a free port with ``args``, until the block ends (then SIGTERM)."""
    import openai

    port, = harness.free_ports(1)
    cmd = [sys.executable, "-m", "semanticspec.serve", "--port", str(port), "--threads", str(threads), *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=harness.REPO)
    url = f"http://127.0.0.1:{port}/v1"
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=5)
    try:
        for _ in range(1200):
            if proc.poll() is not None:
                raise RuntimeError(f"the endpoint exited ({proc.returncode}); see {log}")
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


async def wave(url: str, prompts: list[str], seeds: list[int], method: str, c: int, max_tokens: int,
               stream: bool = True) -> dict:
    """Every prompt through the endpoint with ``c`` workers, streamed (or not); the wave's figures (without
    streaming the time to the first token is the whole answer's)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    todo = list(range(len(prompts)))
    rows: list[tuple[float, float, int]] = []  # ttft, e2e, completion tokens

    async def worker():
        while todo:
            k = todo.pop(0)
            t0 = time.perf_counter()
            first, tokens = None, 0
            kw = dict(model="semanticspec", prompt=prompts[k], max_tokens=max_tokens, seed=seeds[k],
                      extra_body={"method": method})
            if not stream:
                tokens = (await client.completions.create(**kw)).usage.completion_tokens
            else:
                async for ch in await client.completions.create(**kw, stream=True,
                                                                stream_options={"include_usage": True}):
                    if ch.choices and ch.choices[0].text and first is None:
                        first = time.perf_counter() - t0
                    if ch.usage is not None:
                        tokens = ch.usage.completion_tokens
            rows.append((first if first is not None else time.perf_counter() - t0, time.perf_counter() - t0, tokens))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(c)))
    wall = time.perf_counter() - t0
    await client.close()
    ttft, e2e = sorted(r[0] for r in rows), sorted(r[1] for r in rows)
    return {"requests": len(rows), "wall_s": round(wall, 3), "completion_tokens": sum(r[2] for r in rows),
            "tokens_per_s": round(sum(r[2] for r in rows) / wall, 1),
            "ttft_p50_s": round(_q(ttft, 0.5), 4), "ttft_p95_s": round(_q(ttft, 0.95), 4),
            "e2e_p50_s": round(_q(e2e, 0.5), 4), "e2e_p95_s": round(_q(e2e, 0.95), 4)}


def _q(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1] if len(xs) > 1 else xs[0]


def overhead(dec, url: str, prompts: list[str], seeds: list[int], max_tokens: int, reps: int):
    """Seconds per pass of the prompts one at a time through the Python API, the endpoint and the endpoint streaming
    (one client, its connection kept), interleaved prompt by prompt (the machine's drift touches the three alike)."""
    import openai

    from semanticspec.config import DecodeConfig

    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    api, whole, streamed = ([0.0] * reps for _ in range(3))
    for r in range(reps):
        for p, s in zip(prompts, seeds):
            kw = dict(model="semanticspec", prompt=p, max_tokens=max_tokens, seed=s)
            t0 = time.perf_counter()
            dec.generate([p], DecodeConfig(max_new_tokens=max_tokens, seed=s))  # what a user without the endpoint runs
            t1 = time.perf_counter()
            client.completions.create(**kw)
            t2 = time.perf_counter()
            for _ in client.completions.create(**kw, stream=True):
                pass
            api[r] += t1 - t0
            whole[r] += t2 - t1
            streamed[r] += time.perf_counter() - t2
    client.close()
    return ([round(x, 3) for x in xs] for xs in (api, whole, streamed))


def run(url: str, prompts, seeds, concurrencies, max_tokens: int) -> dict:
    out: dict = {m: {} for m in METHODS}
    for c in concurrencies:
        for m in METHODS:  # interleaved: the machine's drift touches both methods alike
            out[m][f"c{c}"] = asyncio.run(wave(url, prompts, seeds, m, c, max_tokens))
            print(f"  {m} c={c}: {out[m][f'c{c}']}", flush=True)
    out["speedup"] = {f"c{c}": round(out["semanticspec"][f"c{c}"]["tokens_per_s"]
                                     / out["target_only"][f"c{c}"]["tokens_per_s"], 3) for c in concurrencies}
    return out


def in_process(args, prompts, seeds) -> dict:
    import torch

    from semanticspec.serve.cli import ServeOptions, build

    torch.set_num_threads(args.threads)
    app = build(ServeOptions())
    dec = app.state.scheduler.dec
    log = Path(args.log_dir) / "endpoint-in-process.log"
    with endpoint([], args.threads, log) as url:
        report = run(url, prompts, seeds, args.concurrency, args.max_tokens)
        api, whole, streamed = overhead(dec, url, prompts, seeds, args.max_tokens, args.overhead_reps)
    app.state.scheduler.stop(0)
    report["_dec"] = dec
    report["overhead_c1"] = {"api_wall_s": api, "endpoint_wall_s": whole, "endpoint_stream_wall_s": streamed,
                             "ratio": round(sum(whole) / sum(api), 4),
                             "stream_ratio": round(sum(streamed) / sum(api), 4)}
    return report


def served(args, prompts, seeds) -> dict:
    from arithmetic_world.serve import world_server

    logs = Path(args.log_dir)
    t_port, d_port = harness.free_ports(2)
    with world_server("target", t_port, log=logs / "target.log") as t, \
            world_server("draft", d_port, log=logs / "draft.log") as d:
        with endpoint(["--target_url", t.url, "--draft_url", d.url, "--target_model", "target", "--draft_model",
                       "draft", "--concurrency", str(max(args.concurrency))], args.threads,
                      logs / "endpoint-served.log") as url:
            return run(url, prompts, seeds, args.concurrency, args.max_tokens)


BAD_BODIES = ['{"prompt": "hi \\ud800", "max_tokens": 4}', '{"prompt": "x", "threshold": NaN}', '{"prompt": 7}',
              '{"prompt": "x", "max_tokens": "many"}', '{"prompt": ', '[]', '{"prompt": "x", "logit_bias": {"1": 5}}',
              '{"messages": [{"role": "user", "content": "hi \\udfff"}]}', '{"prompt": "x", "temperature": -1}']
"""Bodies a chaos run sends as its bad requests (each must get a 4xx with OpenAI's error JSON)."""


async def chaos_wave(url: str, prompts: list[str], seeds: list[int], want: list[str], clients: int, seconds: float,
                     max_tokens: int, seed: int = 0) -> dict:
    """``clients`` streaming workers for ``seconds``: 10% of requests disconnect after the first chunk, 5% send a
    bad body, the rest must stream ``want[k]`` for prompt ``k``; what each kind got."""
    import json
    import random

    import httpx
    import openai

    rng = random.Random(seed)
    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    raw = httpx.AsyncClient(timeout=60)
    counts = {"completed": 0, "mismatched": 0, "abandoned": 0, "bad_bodies": 0, "bad_answered": 0, "failed": 0}
    wrong: list[str] = []
    deadline, nxt = time.perf_counter() + seconds, [0]

    async def one():
        k, r = nxt[0] % len(prompts), rng.random()
        nxt[0] += 1
        if r < 0.05:
            counts["bad_bodies"] += 1
            route = "/chat/completions" if "messages" in (body := rng.choice(BAD_BODIES)) else "/completions"
            resp = await raw.post(url + route, content=body.encode("utf-8", "surrogatepass"),
                                  headers={"Content-Type": "application/json"})
            err = resp.json().get("error", {}) if resp.headers.get("content-type", "").startswith("application/json") \
                else {}
            ok = 400 <= resp.status_code < 500 and set(err) == {"message", "type", "param", "code"}
            counts["bad_answered"] += ok
            return None if ok else wrong.append(f"bad body {body!r}: {resp.status_code} {resp.text[:100]}")
        stream = await client.completions.create(model="semanticspec", prompt=prompts[k], max_tokens=max_tokens,
                                                 seed=seeds[k], stream=True)
        if r < 0.15:
            async for _ in stream:
                break
            await stream.close()  # the client goes away mid-request
            counts["abandoned"] += 1
            return None
        text = "".join([ch.choices[0].text async for ch in stream if ch.choices])
        counts["completed"] += 1
        if text != want[k]:
            counts["mismatched"] += 1
            wrong.append(f"prompt {k}: {text!r} != {want[k]!r}")
        return None

    async def worker():
        while time.perf_counter() < deadline:
            try:
                await one()
            except (openai.OpenAIError, httpx.HTTPError, json.JSONDecodeError) as e:
                counts["failed"] += 1
                wrong.append(f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - t0
    await client.close()
    await raw.aclose()
    return {**counts, "requests": sum(counts[k] for k in ("completed", "abandoned", "bad_bodies")) + counts["failed"],
            "wall_s": round(wall, 1), "problems": wrong[:10]}


def chaos(args, prompts, seeds, want) -> dict:
    """The chaos run against a fresh endpoint process, then its health and its cancel figures."""
    import json
    import urllib.request

    from semanticspec.parts import SHIPPED_WINDOW

    log = Path(args.log_dir) / "endpoint-chaos.log"
    with endpoint([], args.threads, log) as url:
        out = asyncio.run(chaos_wave(url, prompts, seeds, want, args.chaos_clients, args.chaos_seconds,
                                     args.max_tokens))
        root = url.removesuffix("/v1")
        for _ in range(600):  # the abandoned rows' loops drain
            with urllib.request.urlopen(root + "/health", timeout=30) as h:
                health = json.loads(h.read())
            if health.get("running") == 0 and health.get("queued") == 0:
                break
            time.sleep(0.1)
        with urllib.request.urlopen(root + "/metrics", timeout=30) as m:
            metrics = {line.split()[0]: float(line.split()[1]) for line in m.read().decode().splitlines()
                       if line.startswith("semanticspec_") and " " in line}
    out.update(health=health.get("status"), cancelled_rows=int(metrics.get("semanticspec_cancelled_rows_total", 0)),
               steps_after_cancel=int(metrics.get("semanticspec_steps_after_cancel_total", 0)),
               max_steps_after_cancel=int(metrics.get("semanticspec_max_steps_after_cancel", 0)),
               one_round_steps=SHIPPED_WINDOW.size, clients=args.chaos_clients, seconds=args.chaos_seconds)
    out["goal_met"] = (out["mismatched"] == 0 and out["failed"] == 0 and out["bad_answered"] == out["bad_bodies"]
                       and out["health"] == "ok" and out["max_steps_after_cancel"] <= out["one_round_steps"])
    return out


def expected_texts(dec, prompts: list[str], seeds: list[int], max_tokens: int) -> list[str]:
    """What the Python API decodes for each prompt alone with its seed (the endpoint's streams must add up to it)."""
    from semanticspec.config import DecodeConfig

    return [list(dec.stream([p], DecodeConfig(max_new_tokens=max_tokens, seed=s)))[-1].text
            for p, s in zip(prompts, seeds)]


def table(report: dict) -> str:
    """The figures as markdown: a row per setting, method and concurrency, the speedups, chaos and overhead."""
    rows = []
    for setting in ("in_process", "served"):
        r = report.get(setting)
        if not r:
            continue
        rows += [[setting, m, c[1:], str(f["tokens_per_s"]), f"{f['ttft_p50_s']} / {f['ttft_p95_s']}",
                  f"{f['e2e_p50_s']} / {f['e2e_p95_s']}"] for m in METHODS for c, f in r[m].items()]
        rows.append([setting, "speedup (tokens/s)", "", ", ".join(f"{c[1:]}: {v}x" for c, v in r["speedup"].items()),
                     "", ""])
    lines = [harness.table(["setting", "method", "concurrency", "tokens/s", "TTFT p50 / p95 (s)",
                            "end-to-end p50 / p95 (s)"], rows)]
    ch = report.get("chaos")
    if ch:
        lines.append(f"\nchaos ({ch['clients']} streaming clients, {ch['seconds']} s): {ch['requests']} requests, "
                     f"{ch['completed']} completed ({ch['mismatched']} not their seeded text), {ch['abandoned']} "
                     f"abandoned mid-request, {ch['bad_bodies']} bad bodies ({ch['bad_answered']} answered with "
                     f"OpenAI's error JSON), {ch['failed']} failed; /health {ch['health']}; {ch['cancelled_rows']} "
                     f"rows cancelled, at most {ch['max_steps_after_cancel']} step(s) of one decoded after its cancel "
                     f"(one round: up to {ch['one_round_steps']}); goal met: {ch['goal_met']}")
    o = report.get("in_process", {}).get("overhead_c1")
    if o:
        lines.append(f"\nendpoint / Python API wall time at concurrency 1: {o['ratio']} without streaming, "
                     f"{o['stream_ratio']} streaming (API {o['api_wall_s']} s, endpoint {o['endpoint_wall_s']} s, "
                     f"streaming {o['endpoint_stream_wall_s']} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__, quick="16 prompts at concurrency 1 and 8, in-process only; writes "
                        "endpoint-quick.json", threads=2, threads_help="torch CPU threads of the endpoint and the "
                        "Python API", name="endpoint")
    ap.add_argument("--requests", type=harness.count, default=None, help="prompts per wave (default 64; --quick 16)")
    ap.add_argument("--served", action="store_true", help="also in front of the world's llama.cpp servers")
    ap.add_argument("--max_tokens", type=harness.count, default=96, help="max_tokens per request (default %(default)s)")
    ap.add_argument("--overhead_reps", type=harness.count, default=None,
                    help="interleaved API/endpoint passes at concurrency 1 (default 3; --quick 1)")
    ap.add_argument("--log_dir", default="runs/benchmarks/endpoint", help="server logs")
    ap.add_argument("--chaos_clients", type=harness.non_negative, default=None,
                    help="streaming clients of the chaos run (default 32; --quick 8; 0 skips it)")
    ap.add_argument("--chaos_seconds", type=float, default=None, help="seconds of the chaos run (default 60; "
                    "--quick 15)")
    args = ap.parse_args(argv)
    if problem := folder_problem(args.log_dir, "--log_dir"):
        ap.error(problem)
    from generation.threads import set_wait_policy

    set_wait_policy()  # as the endpoint's command does: the Python API runs under the same thread settings
    n = args.requests or (16 if args.quick else 64)
    args.concurrency = (1, 8) if args.quick else (1, 8, 32)
    if args.overhead_reps is None:
        args.overhead_reps = 1 if args.quick else 3
    if args.chaos_clients is None:
        args.chaos_clients = 8 if args.quick else 32
    if args.chaos_seconds is None:
        args.chaos_seconds = 15.0 if args.quick else 60.0
    os.makedirs(args.log_dir, exist_ok=True)
    from arithmetic_world.models import load_tokenizer
    from arithmetic_world.task import ArithmeticTask

    task, tok = ArithmeticTask(), load_tokenizer()
    prompts = [task.prompt_text(tok, p["problem"]) for p in task.problems(n, seed=5)]
    seeds = list(range(n))
    report = {"n_requests": n, "max_tokens": args.max_tokens, "threads": args.threads,
              "load_average": os.getloadavg()[0], "in_process": in_process(args, prompts, seeds)}
    if args.served:
        report["served"] = served(args, prompts, seeds)
    dec = report["in_process"].pop("_dec")
    if args.chaos_clients:
        report["chaos"] = chaos(args, prompts, seeds, expected_texts(dec, prompts, seeds, args.max_tokens))
    harness.write(report, harness.results_path("endpoint", args.quick, args.out), table(report), save_table=True)
    return report


if __name__ == "__main__":
    main()
