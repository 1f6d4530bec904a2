"""`ServedDecoder`: SemanticSpec's step loop over two served models (any :class:`~generation.engines.base.Engine`).

Each prompt runs its own loop, and the servers batch the requests of concurrent prompts
(``concurrency`` bounds the prompts, hence the requests, in flight). One round of a prompt:

1. **propose**: the draft's server writes a step (``write(context, step=StepSpec, max_tokens=cap)``:
   it stops at the step's delimiters; ``top_k`` when the policy wants the draft probe's ``p``);
2. **verify**: the target's server reads context + step in one request (``read``): the step's top-k
   log-probabilities, its hidden rows when the target probe reads them, and the token after it;
3. **decide**: in-process, the probes turn what the server returned into
   :class:`~probes.decoding.scores.Scores` (:func:`~generation.features.rows_features`, then the probe)
   and the method's :class:`~probes.decoding.policies.AcceptancePolicy` decides, unchanged;
4. a kept step and the target's *bonus* token (when ``options.bonus_token``) join the context; a
   refused one is written by the target's server (``write`` with the step spec), with its own
   token-level speculation if it runs one.

A prompt stops at EOS, a completed answer-marker line (:func:`~probes.decoding.rows.answer_complete`),
the token budget (counted from the servers' usage) or the context end (engines that report a
``context_length``). Requests per step: 2 for a kept step (write, read), 3 for a refused one.

``target_only`` and ``draft_only`` are one ``write(prompt, step=None, max_tokens=budget)`` per prompt: what
a user of the server would run, so a speedup against it is against the server's own decode. With an
answer marker the text is then cut where the step loop would stop (:func:`answer_cut`), so greedy
``always_reject`` equals ``target_only`` text for text whenever the server tokenizes a written text as
it wrote it (tests/test_served_decoder.py checks it on the world).

Known difference from in-process decoding: a step the draft ends with EOS is read without its EOS
(text carries no end-of-sequence), so the target probe pools one row fewer on such a last step.

A prompt whose request fails (a dead server, a malformed answer) ends with ``stop_reason="error"``,
``text=""`` and the message (the server's URL, never a key) in ``error``; the other prompts finish.
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch

from generation.engines.base import TokenLogprobs
from generation.engines.checks import missing, servable_groups
from generation.engines.connection import redact
from generation.features import FeatureSpec, probe_input, rows_features
from generation.sampling import StreamKey, stream_keys, stream_seed
from generation.specs import SamplingSpec, StepSpec, is_count
from generation.steps import ends_step
from probes.decoding import setup
from probes.decoding.config import DecodeConfig
from probes.decoding.methods import METHODS, MethodArgs
from probes.decoding.options import LoopOptions
from probes.decoding.policies import AcceptancePolicy, FastPath, ProbePolicy, default_policy
from probes.decoding.proposer import run_probe
from probes.decoding.results import DecodeResult, DecodeStats, Decision, StepEvent, StepTrace, collect, step_events
from probes.decoding.rows import answer_complete
from probes.decoding.scores import Scores

ALONE = {"target_only": "target", "draft_only": "draft"}
"""Methods where one server writes the whole output in one request."""
SERVED_METHODS = ("target_only", "semanticspec", "draft_only", "always_reject", "always_accept", "random_accept",
                  "oracle_accept")
"""``method=`` names :meth:`ServedDecoder.generate` runs (SpecReason's judge turn is not served)."""
SPARE = 1
"""Context room kept for the bonus token."""


class ServedDecoder:
    """Step-level speculative decoding with semantic probes, over a served target and a served draft.

    Args:
        target: the target's engine client (reads steps, writes refused ones).
        draft: the draft's engine client (writes steps).
        target_probe: exported probe directory or ``SemanticProbe`` reading the target server's features, or None.
        draft_probe: same for the draft (the ratio rule's ``p``, from the draft server's top-k), or None.
        policy: SemanticSpec's acceptance (:class:`ProbePolicy`); None =
            :func:`~probes.decoding.policies.default_policy`, the threshold rule after the gated top-1 fast path (the
            target server reads the step in its own tokens, so the fast path needs no shared tokenizer here).
        options: loop options (:class:`LoopOptions`: first step, step spec, answer marker, bonus token;
            token-level speculation inside refused steps is the target server's own); None = ``LoopOptions()``.
        concurrency: prompts decoded at once (each has at most one request in flight).
        task: the task whose problems are decoded: its ``answer_marker`` ends a decode unless
            ``options.answer_marker`` says so (as :class:`~probes.decoder.SemanticSpecDecoder`'s ``task``).
        probe_dtype: the dtype the probes' MLPs run in, as :class:`~probes.decoder.SemanticSpecDecoder`'s
            (``"auto"``: float16 where it is fast, :func:`~probes.decoding.options.resolve_probe_dtype`), so a probe
            gives the same ``q`` served and in-process.

    Raises:
        ValueError: ``concurrency`` below 1, a probe for the other role, probes that disagree on their
            step or sampling, a step spec that differs from the probes', a bad ``probe_dtype``, or a task whose
            answer marker differs from ``options.answer_marker``.
    """

    def __init__(self, target, draft, target_probe=None, draft_probe=None, policy: ProbePolicy | None = None,
                 options: LoopOptions | None = None, *, concurrency: int = 4, probe_dtype: str = "auto",
                 task=None) -> None:
        if not is_count(concurrency):
            raise ValueError(f"concurrency={concurrency!r}: expected an integer >= 1 (prompts decoded at once)")
        self.target, self.draft, self.concurrency = target, draft, concurrency
        self.policy, self.options = policy or default_policy(), setup.with_task(options, task)
        self.target_probe, self.draft_probe = (
            setup.in_dtype(p, probe_dtype, p.input_mean.device if p is not None else torch.device("cpu"))
            for p in (_load_probe(target_probe, "target"), _load_probe(draft_probe, "draft")))
        probes = (self.target_probe, self.draft_probe)
        self.step: StepSpec = setup.step_spec(probes, self.options.step)
        """What a step is: the probes' :class:`StepSpec`, unless ``options.step`` says (a differing one is refused)."""
        self._recorded_sampling = setup.sampling_spec(probes)
        self.target_spec = FeatureSpec.of(self.target_probe.config) if self.target_probe is not None else None
        self.draft_spec = FeatureSpec.of(self.draft_probe.config) if self.draft_probe is not None else None
        self.last_wall_s = 0.0
        """Wall time of the last :meth:`generate` call (all prompts; per-prompt times overlap when concurrent)."""

    def generate(self, prompts: Sequence[str], config: DecodeConfig | None = None, **overrides: Any
                 ) -> list[DecodeResult]:
        """Decode every prompt (text; the servers tokenize it) with ``config``, prompts concurrently.

        Args:
            prompts: non-empty prompt strings.
            config: a :class:`~probes.decoding.config.DecodeConfig`, as
                :meth:`~probes.decoder.SemanticSpecDecoder.generate` takes it (the budget is counted from the
                servers' usage; ``method`` is a name of :data:`SERVED_METHODS` or an acceptance policy; with one
                integer ``seed``, prompt ``k``'s request seeds and coins derive from ``(seed, k, step)``, so it
                decodes the same whatever ``concurrency``). ``batch_size`` is refused: prompts run concurrently
                (``concurrency``).
            **overrides: config fields that change ``config`` for this call.

        Returns:
            One :class:`DecodeResult` per prompt, in order; a failed one has ``stop_reason="error"``.

        Raises:
            ValueError: before any request: no prompts, an empty or non-text prompt, a bad config field, a bad
                method or argument, or a server that cannot serve what the probes read (naming it, what is
                missing and the fix).
        """
        runs, how, cfg = self._plan(prompts, DecodeConfig.of(config, overrides))
        return collect(self._events(runs, how, cfg), len(runs))

    def stream(self, prompts: Sequence[str], config: DecodeConfig | None = None, **overrides: Any
               ) -> Iterator[StepEvent]:
        """:meth:`generate`, yielding each prompt's steps as its loop tries them, then its end event with its
        :class:`DecodeResult` (:class:`~probes.decoding.results.StepEvent`); concurrent prompts interleave.
        Everything :meth:`generate` refuses is refused here, when called, before any request."""
        return self._events(*self._plan(prompts, DecodeConfig.of(config, overrides)))

    def _plan(self, prompts, cfg: DecodeConfig) -> tuple[list[PromptDecode], str | AcceptancePolicy, DecodeConfig]:
        """Every prompt's run, what it runs (a policy, or a method of :data:`ALONE`) and ``cfg``, every check done."""
        policy, problems = self._method(cfg.method, cfg.accept_rate, cfg.oracle)
        sampling = setup.resolve_sampling(self._recorded_sampling, cfg.temperature, cfg.top_p,
                                          enforce=policy is not None and policy.decides_with_probes,
                                          allow_mismatch=cfg.allow_sampling_mismatch)
        if cfg.batch_size is not None:
            problems.append(f"batch_size={cfg.batch_size}: the served decoder runs prompts concurrently, not in "
                            f"batches; set ServedDecoder(concurrency=...) (now {self.concurrency})")
        if problems:
            raise ValueError("; ".join(problems))
        prompts = _read_prompts(prompts)
        self._check_servers(policy, cfg.method)
        keys = stream_keys(cfg.seed, len(prompts))
        runs = [PromptDecode(self, key, p, cfg.max_new_tokens, sampling, k)
                for k, (key, p) in enumerate(zip(keys, prompts))]
        return runs, cfg.method if policy is None else policy, cfg

    def _events(self, runs: list[PromptDecode], how, cfg: DecodeConfig) -> Iterator[StepEvent]:
        """The runs' events as their threads emit them (at most ``concurrency`` prompts in flight)."""
        events: queue.Queue[StepEvent] = queue.Queue()
        bar = None
        if cfg.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(runs), desc=str(cfg.method), unit="prompt")
        t0, ended = time.perf_counter(), 0
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(runs))) as pool:
            for r in runs:
                pool.submit(r.run, how, events.put)
            while ended < len(runs):
                e = events.get()
                ended += e.end
                if bar is not None and e.end:
                    bar.update()
                yield e
        self.last_wall_s = time.perf_counter() - t0

    def read_top_k(self, policy: AcceptancePolicy) -> int:
        """The top-k a verifying read asks for: what the target probe and the fast path read (at least 1)."""
        ks = [1]
        if policy.needs.q and self.target_spec.needs_topk:
            ks.append(self.target_spec.top_k)
        if policy.needs.fast_path is not None:
            ks.append(policy.needs.fast_path.top_k)
        return max(ks)

    def _method(self, method, accept_rate, oracle) -> tuple[AcceptancePolicy | None, list[str]]:
        """The method's policy (None: one server alone) and what is missing for it."""
        if isinstance(method, str) and method in ALONE:
            return None, []
        try:
            policy = served_policy(method, MethodArgs(self.policy, accept_rate, oracle))
        except ValueError as e:
            return None, [str(e)]
        problems = []
        if policy.needs.q and self.target_probe is None:
            problems.append(f"method={method!r} needs target_probe (an exported probe directory)")
        if policy.needs.p and self.draft_probe is None:
            problems.append("rule='ratio' needs draft_probe for p; give one or use rule='threshold'")
        return policy, problems

    def _check_servers(self, policy: AcceptancePolicy | None, method) -> None:
        """Refuse servers that cannot serve the method's reads, before any request that decodes."""
        if policy is None:
            return
        needs, problems = policy.needs, []
        caps = self.target.capabilities()
        if not caps.prompt_logprobs:
            problems.append(f"the target server {self.target.url} ({self.target.name}) returns no prompt log-probs, "
                            f"which method={method!r} reads every drafted step with; serve the target with an engine "
                            "that does (llama-cpp-python, vLLM, SGLang; not the C++ llama-server)")
        if needs.q:
            problems += serving_problems(self.target, self.target_spec, "target")
        if needs.fast_path is not None and caps.max_top_k is not None and caps.max_top_k < needs.fast_path.top_k:
            problems.append(f"the fast path reads the target's top-{needs.fast_path.top_k} but {self.target.url} "
                            f"returns at most {caps.max_top_k}; lower ProbePolicy.top_k or raise the server's limit")
        if needs.p:
            problems += serving_problems(self.draft, self.draft_spec, "draft")
        if problems:
            raise ValueError("these servers cannot run this decode: " + "; ".join(problems))


def served_policy(method: str | AcceptancePolicy, args: MethodArgs) -> AcceptancePolicy:
    """The acceptance policy of a speculative served method: the one method table's, unchanged.

    Raises:
        ValueError: an unknown name, a method the served decoder does not run, or a missing argument.
    """
    if isinstance(method, AcceptancePolicy):
        policy = method
    elif method in SERVED_METHODS:
        policy = METHODS[method](args).policy
    else:
        raise ValueError(f"method={method!r}: the served decoder runs {SERVED_METHODS} or an acceptance policy")
    if policy.needs.judge:
        raise ValueError(f"method={method!r} scores steps after a judge turn from the target's digit logits, "
                         "which the served decoder does not read; use it in-process (SemanticSpecDecoder)")
    return policy


def serving_problems(engine, spec: FeatureSpec, role: str) -> list[str]:
    """What ``engine`` cannot serve of what the ``role`` probe reads (:func:`generation.engines.checks.missing`; a
    server writing a step returns no hidden rows, so a draft probe cannot read them either)."""
    out = [f"the {role} server {engine.url} ({engine.name}) cannot give {m}" for m in missing(engine, spec)]
    if role == "draft" and spec.needs_hidden:
        out.append("the draft probe reads hidden, but a server writing a step returns no hidden rows; use "
                   "rule='threshold' or a draft probe without hidden")
    if out:
        can = [g for g in servable_groups(engine.capabilities()) if role == "target" or g != "hidden"]
        out[-1] += f" (groups it can serve: {can})"
    return out


def _load_probe(probe, role: str):
    """A probe directory (loaded without a model: a server's weights cannot be fingerprinted here) or a probe."""
    if probe is None:
        return None
    if isinstance(probe, (str, os.PathLike)):
        from probes.export import load_probe

        return load_probe(probe, role=role)
    if not isinstance(probe, torch.nn.Module) or not hasattr(probe, "config"):
        raise TypeError(f"{role}_probe must be a path, a SemanticProbe or None, got {type(probe).__name__}")
    from probes.export import check_role

    check_role(probe.config, role, where=f"the {role} probe")
    return probe.eval()


def _read_prompts(prompts) -> list[str]:
    """The prompts as a non-empty list of non-empty strings, or a ValueError naming the first bad one."""
    if prompts is None or isinstance(prompts, str):
        raise ValueError(f"prompts={prompts!r}: expected a list of prompt strings")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt string")
    for i, p in enumerate(prompts):
        if not isinstance(p, str) or not p:
            raise ValueError(f"prompt {i} is {p!r}: the served decoder sends text (the servers tokenize it); "
                             "give a non-empty string (Task.prompt_text formats one)")
    return prompts


def answer_cut(tokens: TokenLogprobs | None, step: StepSpec, marker: str | None) -> tuple[str, int] | None:
    """Where the step loop would stop a text written in one request: the end of the first step (cut at
    ``step``'s delimiters and cap, token by token) after which the answer line is complete.

    Returns:
        ``(text, n_tokens)`` up to that step's end, or None when the answer never completes.
    """
    if tokens is None or not marker:
        return None
    text, cur, n = "", "", 0
    for i, piece in enumerate(tokens.tokens):
        cur, n = cur + piece, n + 1
        if ends_step(cur, step.delimiters) or n >= step.max_step_tokens:
            text, cur, n = text + cur, "", 0
            if answer_complete(text, marker):
                return text, i + 1
    return None


def fast_keeps(step: TokenLogprobs, n_forced: int, fp: FastPath) -> bool:
    """:func:`~probes.decoding.policies.fast_path_keeps` from a server's top-k: every drafted token is in the
    target's top-``fp.top_k`` and has at least ``fp.min_logprob``."""
    lp, top = step.logprobs[n_forced:], step.top[n_forced:, : fp.top_k]
    if len(lp) == 0:
        return False
    rank = (top > lp[:, None]).sum(-1)
    return bool(((rank < fp.top_k) & (lp >= fp.min_logprob)).all())


def features(spec: FeatureSpec, step: TokenLogprobs, hidden: torch.Tensor | None) -> torch.Tensor:
    """A probe's (1, W) input from what a server returned for a step (its top-k, its hidden rows)."""
    tokens = [step.ids if step.ids is not None else step.tokens]  # only their number matters without token_stats
    kw = {}
    if spec.needs_hidden:
        kw["hidden"] = [hidden[None]]  # (1, k, D): the last layer
    if spec.needs_topk:
        kw["topk"] = [(step.logprobs, step.top)]
    return probe_input(rows_features(spec, tokens, **kw), spec.groups)


class PromptDecode:
    """One prompt's loop and its counters (the unit :meth:`ServedDecoder.generate` runs concurrently).

    Args:
        dec: the decoder (engines, probes, step spec, options).
        key: what the prompt's seeds derive from (:data:`~generation.sampling.StreamKey`: ``(seed, k)``).
        prompt: the prompt text.
        budget: output token budget.
        sampling: temperature and top-p of both servers.
        index: the prompt's index in the call (its events carry it).
    """

    def __init__(self, dec: ServedDecoder, key: StreamKey, prompt: str, budget: int, sampling: SamplingSpec,
                 index: int = 0) -> None:
        self.dec, self.key, self.prompt, self.budget, self.sampling = dec, key, prompt, budget, sampling
        self.index, self.sent = index, 0  # the prompt's index in the call; trace entries emitted
        self.emit: Callable[[StepEvent], Any] = lambda e: None
        # committed text (prompt included); the bonus token opening the next step
        self.context, self.forced = prompt, ""
        self.pieces: list[str] = []
        self.trace: list[StepTrace] = []
        self.stats = DecodeStats()
        self.done, self.reason = False, None
        self.used = 0  # tokens in the servers' context, from their last usage
        self.coins = torch.Generator().manual_seed(stream_seed(*key, "coins"))

    @property
    def output(self) -> str:
        return "".join(self.pieces)

    def run(self, how: str | AcceptancePolicy, emit: Callable[[StepEvent], Any] = lambda e: None) -> DecodeResult:
        """Decode to the end (``how``: a policy, or a method of :data:`ALONE`), passing ``emit`` an event per step
        tried and one end event with the result; a failure ends this prompt only."""
        t0 = time.perf_counter()
        self.emit = emit
        try:
            with torch.inference_mode():
                if isinstance(how, str):
                    self.alone(ALONE[how])
                    self.flush()
                else:
                    self.loop(how)
        except Exception as e:  # noqa: BLE001 (a dead server or a bad answer fails this prompt, not the decode)
            self.flush()
            self.stats.wall_s = time.perf_counter() - t0
            result = DecodeResult("", self.trace, self.stats, "error", redact(str(e)))
        else:
            self.stats.wall_s = time.perf_counter() - t0
            result = DecodeResult(self.output, self.trace, self.stats, self.reason)
        emit(StepEvent(self.index, None, result.text, result))
        return result

    def flush(self) -> None:
        """Emit the steps tried since the last flush."""
        for e in step_events(self.index, self.trace, self.pieces, self.sent):
            self.emit(e)
        self.sent = len(self.trace)

    def loop(self, policy: AcceptancePolicy) -> None:
        while not self.done:
            lim = self.limit()
            if lim <= 0:
                self.close()
            elif self.dec.options.target_first_step and not self.trace:
                self.target_step(lim, first=True)
            else:
                self.speculate(lim, policy)
            self.flush()

    def limit(self) -> int:
        """Tokens the next step may add: the budget left, and the room left in the servers' contexts."""
        left = self.budget - self.stats.output_tokens
        for engine in (self.dec.target, self.dec.draft):
            ctx = getattr(engine, "context_length", None)
            if ctx is not None:
                left = min(left, ctx - self.used - SPARE)
        return left

    def request(self, role: str, kind: str, *args, **kw):
        """One request to the ``role`` server (``kind``: read or write), counted; a failure names the server."""
        engine = getattr(self.dec, role)
        kw.update(sampling=self.sampling, seed=stream_seed(*self.key, f"{role}:{kind}:{len(self.trace)}"))
        t0 = time.perf_counter()
        try:
            answer = getattr(engine, kind)(*args, **kw)
        except Exception as e:
            raise RuntimeError(f"the {role} server {engine.url} failed a {kind} request: "
                               f"{type(e).__name__}: {e}") from e
        u, s = answer.usage, self.stats
        s.requests += 1
        s.http_s += time.perf_counter() - t0
        s.prefill_tokens += u.prefill_tokens if u.prefill_tokens is not None else u.prompt_tokens - (u.cached_tokens
                                                                                                     or 0)
        self.used = max(self.used, u.prompt_tokens + u.completion_tokens)
        return answer

    def speculate(self, lim: int, policy: AcceptancePolicy) -> None:
        """The draft's server writes a step, the target's reads it, the policy keeps it or the target rewrites it."""
        dec, n_forced = self.dec, int(bool(self.forced))
        cap = min(dec.step.max_step_tokens - n_forced, lim)
        if cap < 1:  # the step is the bonus token alone
            return self.commit_forced()
        t0 = time.perf_counter()
        top_k = dec.draft_spec.top_k if policy.needs.p and dec.draft_spec.needs_topk else None
        w = self.request("draft", "write", self.context + self.forced, step=dec.step, max_tokens=cap, top_k=top_k)
        self.stats.draft_s += time.perf_counter() - t0
        self.stats.draft_steps_proposed += 1
        self.stats.drafted_tokens += w.usage.completion_tokens
        step = self.forced + w.text
        reading, scores = self.score(step, w, policy, n_forced)
        decision = policy.decide({0: scores})[0] if scores is not None else Decision.REJECT  # nothing read: not kept
        s = scores or Scores(text=step, output=self.output)
        self.trace.append(StepTrace("draft", step, n_forced + w.usage.completion_tokens, s.q, s.p, decision,
                                    time.perf_counter() - t0))
        if decision == Decision.REJECT:
            return self.target_step(lim, first=False)
        self.stats.draft_steps_accepted += 1
        before = self.context
        self.commit(step, w.usage.completion_tokens, True, w.stop == "eos")
        if not self.done and dec.options.bonus_token and self.limit() > 0:
            if reading is None:  # the policy read nothing: the read brings the bonus token only
                reading = self.request("target", "read", before, step, top_k=1, hidden=False)
            self.stats.output_tokens += 1
            if reading.next_eos:
                self.finish("eos")
            else:
                self.forced = reading.next_text

    def score(self, step: str, w, policy: AcceptancePolicy, n_forced: int):
        """``(reading, Scores)``: the target's read when the policy needs it, the probes, the coin and ``p``."""
        dec, needs = self.dec, policy.needs
        if not step:
            return None, None
        reading, fast, q, x = None, False, None, None
        if needs.q or needs.fast_path is not None:
            t0 = time.perf_counter()
            hidden = needs.q and dec.target_spec.needs_hidden
            reading = self.request("target", "read", self.context, step, top_k=dec.read_top_k(policy), hidden=hidden)
            self.stats.verify_s += time.perf_counter() - t0
        if needs.fast_path is not None:
            fast = fast_keeps(reading.step, n_forced, needs.fast_path)
        if needs.q and not fast:
            t0 = time.perf_counter()
            x = features(dec.target_spec, reading.step, reading.hidden)
            q = run_probe(dec.target_probe, x)[0]
            self.stats.probe_s += time.perf_counter() - t0
        coin = float(torch.rand((), generator=self.coins)) if needs.coin and not fast else None
        scores = Scores(text=step, output=self.output, features=x, fast=fast, q=q, coin=coin)
        if needs.p and policy.wants_p(scores):
            t0 = time.perf_counter()
            if w.tokens is None:
                raise RuntimeError(f"the draft server {dec.draft.url} returned no log-probs for a written step "
                                   "though top_k was asked (the draft probe's p reads them)")
            scores = replace(scores, p=run_probe(dec.draft_probe, features(dec.draft_spec, w.tokens, None))[0])
            self.stats.probe_s += time.perf_counter() - t0
        return reading, scores

    def target_step(self, lim: int, first: bool) -> None:
        """The target's server writes the step (the first one, or the one it refused)."""
        n_forced = int(bool(self.forced))
        cap = min(self.dec.step.max_step_tokens - n_forced, lim)
        if cap < 1:
            return self.commit_forced()
        t0 = time.perf_counter()
        w = self.request("target", "write", self.context + self.forced, step=self.dec.step, max_tokens=cap)
        dt = time.perf_counter() - t0
        if first:
            self.stats.first_step_s += dt
        else:
            self.stats.rewrite_s += dt
        text = self.forced + w.text
        self.trace.append(StepTrace("target", text, n_forced + w.usage.completion_tokens, decision=Decision.TARGET,
                                    seconds=dt))
        self.commit(text, w.usage.completion_tokens, False, w.stop == "eos")

    def commit(self, text: str, n_new: int, by_draft: bool, eos: bool) -> None:
        """A kept step joins the output (its bonus token was counted when drawn); is the prompt done?"""
        s = self.stats
        s.steps += 1
        s.output_tokens += n_new
        s.draft_tokens += n_new if by_draft else 0
        self.pieces.append(text)
        self.context += text
        self.forced = ""
        if eos:
            self.finish("eos")
        elif answer_complete(self.output, self.dec.options.answer_marker):
            self.finish("answer")

    def commit_forced(self) -> None:
        """A step that holds only the pending bonus token (the step cap or the budget leaves no more)."""
        text = self.forced
        self.trace.append(StepTrace("target", text, 1, decision=Decision.TARGET))
        self.commit(text, 0, False, False)

    def finish(self, reason: str) -> None:
        self.done, self.reason = True, reason

    def close(self) -> None:
        """Finish at the budget or the context end; a pending bonus token becomes a last one-token step."""
        self.finish("budget" if self.stats.output_tokens >= self.budget else "context")
        if self.forced:
            self.trace.append(StepTrace("target", self.forced, 1, decision=Decision.TARGET))
            self.pieces.append(self.forced)
            self.stats.steps += 1
            self.forced = ""

    def alone(self, role: str) -> None:
        """One server writes the whole output in one request, cut where the step loop would stop at the answer."""
        marker, t0 = self.dec.options.answer_marker, time.perf_counter()
        lim = self.limit()
        if lim < 1:
            return self.close()
        w = self.request(role, "write", self.prompt, step=None, max_tokens=lim, top_k=1 if marker else None)
        text, n = w.text, w.usage.completion_tokens
        self.finish("eos" if w.stop == "eos" else "budget" if n >= self.budget else "context")
        cut = answer_cut(w.tokens, self.dec.step, marker)
        if cut is not None:
            text = w.text[: len(cut[0])] if w.text.startswith(cut[0]) else cut[0]
            n = cut[1]
            self.finish("answer")
        s = self.stats
        s.steps, s.output_tokens = 1, n
        if role == "draft":
            s.draft_steps_proposed = s.draft_steps_accepted = 1
            s.draft_tokens = s.drafted_tokens = n
        decision = Decision.TARGET if role == "target" else Decision.ACCEPT
        self.trace.append(StepTrace(role, text, n, decision=decision, seconds=time.perf_counter() - t0))
        self.pieces.append(text)
