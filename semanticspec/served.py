"""`ServedDecoder`: SemanticSpec's step loop over two served models (any :class:`~generation.engines.base.Engine`),
and the two parts it gives the loop.

The loop is :class:`~semanticspec.loop.StepLoop`, the one the in-process decoder runs; only its parts differ:
:class:`EngineProposer` (the draft's server) and :class:`EngineVerifier` (the target's), so served decoding runs the
same rounds, decisions and bookkeeping. Its prompts are text (the servers tokenize them), and all of a call's
prompts are rows of one loop. A part sends one request per row of a phase, the rows' requests in flight together
(at most ``concurrency``); the servers batch them. A round:

1. **propose**: the draft's server writes a step (``write(context, step=StepSpec, max_tokens=cap)``: it
   stops at the step's delimiters; ``top_k`` when the policy wants the draft probe's ``p``);
2. **verify**: the target's server reads context + step in one request (``read``): the step's top-k
   log-probabilities, its hidden rows when the target probe reads them, and the token after it; the
   probes turn that into :class:`~semanticspec.scores.Scores` in-process
   (:func:`~generation.features.rows_features`, then the probe), and the policy decides;
3. a kept step and the target's *bonus* token (the read's next token; a read of its own when the
   policy read nothing) join the context; a refused one is written by the target's server (``write``
   with the step spec), with its own token-level speculation if it runs one.

Requests per step: 2 for a kept step (write, read), 3 for a refused one. The parts keep no model
state: a row's context is its prompt and its committed text, which the servers' prefix caches hold.

The baselines (``target_only``, ``draft_only``) are one ``write(prompt, step=None, max_tokens=budget)`` per
prompt: what a user of the server would run, so a speedup against it is against the server's own decode.
With an answer marker the text is then cut where the step loop would stop (:func:`answer_cut`), so greedy
``always_reject`` equals ``target_only`` whenever the server tokenizes a written text as it wrote it.

Known difference from in-process decoding: a step the draft ends with EOS is read without its EOS (text
carries no end-of-sequence), so the target probe pools one row fewer on such a last step.

A row whose request fails (a dead server, a malformed answer) ends with ``stop_reason="error"``, ``text=""``
and the message (the server's URL, never a key) in ``error``; the other rows go on.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import accumulate

import torch

from generation.engines.base import TokenLogprobs, spell
from generation.engines.checks import model_names, serving_problems, swapped_roles
from generation.engines.connection import redact
from generation.features import FeatureSpec, probe_features
from generation.sampling import StreamKey, key_stream, stream_keys, stream_seed
from generation.specs import SamplingSpec, StepSpec, is_count
from generation.steps import ends_step
from probes.model import load_probes, run_probe
from semanticspec.base import Plan, StepDecoder
from semanticspec.config import DecodeConfig
from semanticspec.hf import TransformersLoop
from semanticspec.loop import StepLoop
from semanticspec.meter import Meter
from semanticspec.parts import (NOTHING_FORCED, ONE_STEP, Commit, Forced, Proposal, RoomAfter, RowState, Window,
                                grow_windows)
from semanticspec.policies import FastPath, Needs, ProbePolicy, check_policy, default_policy, stored_tau
from semanticspec.prompts import read_prompt_texts
from semanticspec.rows import Row, answer_complete
from semanticspec.scores import Scores


class ServedDecoder(StepDecoder):
    """Step-level speculative decoding with semantic probes, over a served target and a served draft.

    ``generate(prompts, config)`` and ``stream`` are :class:`~semanticspec.decoder.SemanticSpecDecoder`'s, with text
    prompts; every method of :data:`~semanticspec.methods.METHODS` runs but transformers' own loops
    (``hf_target_only``, ``token_sd``) and SpecReason's judge turn. ``target_only`` and ``draft_only`` write each
    output in one request, as a user of the server would; the budget is counted from the servers' usage.

    Args:
        target: the target's engine client (reads steps, writes refused ones).
        draft: the draft's engine client (writes steps).
        target_probe: exported probe directory or ``SemanticProbe`` reading the target server's features, or None.
        draft_probe: same for the draft (the ratio rule's ``p``, from the draft server's top-k), or None.
        policy: SemanticSpec's acceptance; None = :func:`~semanticspec.policies.default_policy`, the threshold
            rule (at the ``threshold.json`` beside the target probe when there is one, else 0.5) after the gated
            top-1 fast path (the target server reads the step in its own tokens).
        config: the decoder's default :class:`~semanticspec.config.DecodeConfig` (a ``generate`` call without one
            starts from it; token-level speculation inside refused steps is the target server's own, so
            ``token_sd=True`` is refused); None = ``DecodeConfig()``.
        concurrency: requests in flight at once per server (each row has at most one).
        task: the task whose problems are decoded: its ``answer_marker`` ends a decode, as the in-process
            decoder's ``task``, and :meth:`prompts` formats problems as it does.
        tokenizer: the target's tokenizer, whose chat template :meth:`prompts` applies (the servers read text); None:
            the task's plain format (the problem and its prompt suffix).
        probe_dtype: the dtype the probes' MLPs run in, as the in-process decoder's, so a probe gives the same ``q``.

    Raises:
        ValueError: ``concurrency`` below 1, a probe for the other role, probes that disagree on their step or
            sampling, a step spec that differs from the probes', a bad ``probe_dtype``, or a task whose answer
            marker differs from ``config.answer_marker``, or a ``config`` every call would be refused with (a
            ``batch_size``, a method that runs transformers' own loop or reads a judge turn).
        TypeError: a ``policy`` that is not a ``ProbePolicy`` (other methods are named per call, ``method=``).
    """

    def __init__(self, target, draft, target_probe=None, draft_probe=None, policy: ProbePolicy | None = None,
                 config: DecodeConfig | None = None, *, concurrency: int = 4, probe_dtype: str = "auto",
                 task=None, tokenizer=None) -> None:
        for name, engine in (("target", target), ("draft", draft)):
            if not hasattr(engine, "url"):  # a URL string, a model, None
                raise TypeError(f"{name}={engine!r}: expected an engine client (generation.engines.make_engine(kind, "
                                "url, role)); in-process models decode with SemanticSpecDecoder")
        if not is_count(concurrency):
            raise ValueError(f"concurrency={concurrency!r}: expected an integer >= 1 (requests in flight at once)")
        check_policy(policy)
        self.target, self.draft, self.concurrency = target, draft, concurrency
        self.policy = policy or default_policy(tau=stored_tau(target_probe))  # the evaluation's pick, if any
        self.config, self.task = DecodeConfig.of(config), task
        self.tokenizer = tokenizer
        self.target_probe, self.draft_probe, self._labelled_with = load_probes((target_probe, draft_probe),
                                                                               (None, None), (None, None), probe_dtype)
        self.step = self._checked_default()
        if (why := swapped(target, draft, self.target_probe, self.draft_probe)) is not None:
            raise ValueError(why)

    def _refusals(self, cfg: DecodeConfig, method) -> list[str]:
        problems = []
        if isinstance(method, TransformersLoop):
            problems.append(f"method={cfg.method!r} runs transformers' own loop on in-process models; use it with "
                            "SemanticSpecDecoder")
        elif method is not None and method.policy is not None and method.policy.needs.judge:
            problems.append(f"method={cfg.method!r} scores steps after a judge turn from the target's digit logits, "
                            "which the served decoder does not read; use it in-process (SemanticSpecDecoder)")
        if cfg.batch_size is not None:
            problems.append(f"batch_size={cfg.batch_size}: the served decoder runs prompts concurrently, not in "
                            f"batches; set ServedDecoder(concurrency=...) (now {self.concurrency})")
        return problems

    def _inputs(self, prompts, cfg: DecodeConfig, method) -> tuple[list[ServedPrompt], list[ServedPrompt]]:
        """The prompts as the target's server reads them, then as the draft's: their texts, counted in the server's
        tokenizer where it states its context; the servers checked for ``method`` (ValueError: what they cannot give
        it, or a prompt that fills a server's context)."""
        texts = read_prompt_texts(prompts)
        stream_keys(cfg.seed, len(texts))  # a seed list of another length, refused before the requests below
        self._check_servers(method.policy, cfg.method)
        return self._counted(texts, self.target, "target"), self._counted(texts, self.draft, "draft")

    @staticmethod
    def _counted(texts: list[str], engine, role: str) -> list[ServedPrompt]:
        """``texts`` as ``engine`` reads them: counted by its tokenizer (one tokenize request) where it states its
        context, and refused when one fills it (as in-process prompts are)."""
        ctx = getattr(engine, "context_length", None)
        counts = engine.prompt_tokens(texts) if ctx is not None else None
        if counts is None:
            return [ServedPrompt(t) for t in texts]
        for i, n in enumerate(counts):
            if n >= ctx:
                raise ValueError(f"prompt {i} has {n} tokens in the {role} server's tokenizer but its context "
                                 f"holds {ctx} (as the server states it, or as n_ctx gives it); shorten the prompt")
        return [ServedPrompt(t, n) for t, n in zip(texts, counts)]

    def prompt_room(self, plan: Plan) -> int | None:
        """New tokens the first prompt of ``plan`` leaves in the servers' contexts (None: no server counted it)."""
        rooms = [ctx - p[0].tokens - plan.spare for ctx, p in zip(self.contexts(), plan.inputs)
                 if ctx is not None and p[0].tokens is not None]
        return min(rooms, default=None)

    def contexts(self) -> tuple[int | None, int | None]:
        """As the engines state them (``Engine.context_length``: vLLM's and SGLang's ``/v1/models``, a
        ``LocalEngine``'s model; None for llama-cpp-python)."""
        return tuple(getattr(e, "context_length", None) for e in (self.target, self.draft))

    def _batch_size(self, cfg: DecodeConfig, n: int) -> int:
        """All prompts are rows of one loop, their requests in flight together; at ``concurrency=1`` nothing runs
        together, so prompts run one after another, each keeping a one-sequence server's prefix cache
        (llama-cpp-python keeps one) instead of evicting the others' round after round."""
        return max(n, 1) if self.concurrency > 1 else 1

    def _prompt(self, problem: str) -> str:
        return self.task.prompt_text(self.tokenizer, problem)

    def _token_sd(self, cfg: DecodeConfig) -> tuple[bool, bool]:
        if cfg.token_sd:
            raise ValueError("token_sd=True: the served decoder's target server writes refused steps with its own "
                             "speculation, if it runs one; leave token_sd unset")
        return False, cfg.bonus_token

    def spare(self, cfg: DecodeConfig) -> int:
        return SPARE  # the bonus token's position (no judge turn is served)

    def step_loop(self, plan: Plan, batch: tuple, keys) -> StepLoop:
        """The loop of one batch of text prompts of ``plan`` over the two servers."""
        for_target, for_draft = batch
        rows = [Row(plan.cfg.max_new_tokens, plan.loop.answer_marker) for _ in for_target]
        kw = dict(rows=rows, keys=keys, sampling=plan.sampling, step=plan.step, concurrency=self.concurrency)
        coins = [key_stream(k, "coins") for k in keys]  # as in-process
        proposer = EngineProposer(self.draft, self.draft_probe, prompts=for_draft, **kw)
        verifier = EngineVerifier(self.target, self.target_probe, coins, prompts=for_target, **kw)
        return StepLoop(proposer, verifier, rows, plan.loop, Meter(rows, verifier, proposer))

    def check_servers(self, config: DecodeConfig | None = None) -> None:
        """Refuse servers that cannot run ``config``'s method (default: the decoder's own config) with these probes:
        a ValueError naming what each lacks. :meth:`~semanticspec.base.StepDecoder.generate` checks the same before
        its first request; the endpoint calls this at start-up, so its default requests are not refused one by one
        as the caller's error."""
        cfg = self.config if config is None else config
        method, problems = self._method(cfg)
        if problems:  # a probe the method needs (read below), an unknown method: as a call refuses them
            raise ValueError("; ".join(problems))
        self._check_servers(getattr(method, "policy", None), cfg.method)

    def _check_servers(self, policy, method) -> None:
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
            problems += serving_problems(self.target, self.target_probe.config.features, "target")
        if needs.fast_path is not None and caps.max_top_k is not None and caps.max_top_k < needs.fast_path.top_k:
            problems.append(f"the fast path reads the target's top-{needs.fast_path.top_k} but {self.target.url} "
                            f"returns at most {caps.max_top_k}; lower ProbePolicy.top_k or raise the server's limit")
        if needs.p:
            problems += serving_problems(self.draft, self.draft_probe.config.features, "draft")
        if problems:
            raise ValueError("these servers cannot run this decode: " + "; ".join(problems))


def swapped(target, draft, target_probe, draft_probe) -> str | None:
    """Why the two servers look swapped, or None: the model a server serves is named as the other role's probe
    reads it (its ``config.json``'s ``reads.name_or_path``, or that path's last part) and not as its own role's probe
    reads it (:func:`~generation.engines.checks.swapped_roles`)."""
    def names(probe) -> set[str]:
        return model_names(((probe.config.reads or {}) if probe is not None else {}).get("name_or_path"))

    served = {role: (e.url, _served_name(e)) for role, e in (("target", target), ("draft", draft))}
    own = {"target": names(target_probe), "draft": names(draft_probe)}
    return swapped_roles(served, own, "model, as its probe records it")


def _served_name(engine) -> str | None:
    """The model name ``engine`` serves: a server client's ``model``, or an in-process engine's model's
    ``name_or_path`` (:class:`~generation.engines.local.LocalEngine` holds the model itself)."""
    model = getattr(engine, "model", None)
    return model if isinstance(model, str) or model is None else getattr(getattr(model, "config", None),
                                                                        "name_or_path", None)


SPARE = 1
"""Context room kept for the bonus token."""


@dataclasses.dataclass(frozen=True)
class ServedPrompt:
    """A row's prompt as one server reads it: its text, and how many tokens that server's tokenizer makes of it where
    the server states its context (``Engine.prompt_tokens``; None: not counted), so that the row's first request is
    capped at the room the prompt leaves."""

    text: str
    tokens: int | None = None


class EnginePart:
    """Requests to one server for the rows of a loop: their seeds, counters and concurrency, and their failures.

    Args:
        engine: the server's client.
        role: ``"target"`` or ``"draft"`` (request seeds and messages name it).
        rows: the loop's rows (a request counts into its row's stats; a failure fails its row).
        prompts: each row's prompt as this server reads it.
        keys: each row's :data:`~generation.sampling.StreamKey` (request ``k`` of a row's step ``s`` is seeded from
            ``(key, role:kind:s)``, so a row decodes the same whatever else runs).
        sampling: temperature and top-p of both servers.
        step: what a step is (the delimiters and cap a written step stops at).
        concurrency: requests in flight at once.
    """

    def __init__(self, engine, role: str, rows: list[Row], prompts: Sequence[ServedPrompt],
                 keys: Sequence[StreamKey], sampling: SamplingSpec, step: StepSpec, concurrency: int) -> None:
        self.engine, self.role, self.rows, self.keys = engine, role, rows, list(keys)
        self.prompts = [p.text for p in prompts]
        self.sampling, self.step_spec, self.concurrency = sampling, step, concurrency
        n = len(rows)
        self.passes, self.served_s, self.forward_s = [0] * n, [0.0] * n, 0.0
        self.counted = [[_Counted(p.text, p.tokens or 0)] for p in prompts]  # per row: texts the server counted
        self.probe_s = 0.0  # seconds in the probe so far

    def room(self, row: int) -> int | None:
        ctx = getattr(self.engine, "context_length", None)
        return None if ctx is None else ctx - self.used(row) - SPARE

    def used(self, row: int) -> int:
        """Tokens of the row's committed text in the server's context: the longest part of it a request's answer
        counted (its prompt, or a prompt and the tokens read or written after it), and one token a byte for the rest
        (a bound: no tokenizer makes more). Text the row did not keep (a refused step, the rest of a window) counts
        nothing; the counts it cannot extend are dropped (the committed text only grows)."""
        committed = self.context(row)
        self.counted[row] = [c for c in self.counted[row] if committed.startswith(c.text)]
        at, tokens = max((c.covers(committed) for c in self.counted[row]), default=(0, 0))
        return tokens + len(committed[at:].encode())

    def retire(self, rows: Sequence[int]) -> None:
        """Finished rows send no more requests: their prompts are dropped (a server keeps no row; the endpoint's
        long-lived loops admit hundreds)."""
        for i in rows:
            self.prompts[i] = ""

    def admit(self, prompt: ServedPrompt, key: StreamKey) -> None:
        """A new row (the loop has added it to the shared rows): its prompt and stream key."""
        self.prompts.append(prompt.text)
        self.keys.append(key)
        self.passes.append(0)
        self.served_s.append(0.0)
        self.counted.append([_Counted(prompt.text, prompt.tokens or 0)])

    def context(self, row: int) -> str:
        """The row's committed text, its prompt first."""
        return self.prompts[row] + self.rows[row].text

    def each(self, kind: str, calls: Mapping[int, tuple[tuple, dict]]) -> dict:
        """One ``kind`` request per row (``calls``: its positional and keyword arguments), in flight together; a
        row whose request fails is failed (:meth:`Row.fail`) and left out of the answers."""
        t0, out = time.perf_counter(), {}
        if not calls:
            return out
        if self.concurrency == 1 or len(calls) == 1:
            results = {i: _Outcome.of(self._one, i, kind, args, kw) for i, (args, kw) in calls.items()}
        else:
            with ThreadPoolExecutor(max_workers=min(self.concurrency, len(calls))) as pool:
                futures = {i: pool.submit(_Outcome.of, self._one, i, kind, args, kw)
                           for i, (args, kw) in calls.items()}
                results = {i: f.result() for i, f in futures.items()}
        for i, r in results.items():
            if r.error is not None:
                self.rows[i].fail(redact(str(r.error)), r.error.__cause__ or r.error)  # the engine's own error
            else:
                out[i] = r.value
        self.forward_s += time.perf_counter() - t0
        return out

    def _one(self, i: int, kind: str, args: tuple, kw: dict):
        """One request for row ``i``, counted in its stats; a failure names the server."""
        answer, dt = self._send(kind, args, kw, self.seed(i, kind))
        self._count(i, answer, dt, args)
        return answer

    def seed(self, i: int, tag: str) -> int:
        """The seed of row ``i``'s ``tag`` request at its current step (from its key: the same in any batch)."""
        return stream_seed(*self.keys[i], f"{self.role}:{tag}:{len(self.rows[i].trace)}")

    def _send(self, kind: str, args: tuple, kw: dict, seed: int):
        """One request and its seconds; a failure names the server."""
        kw = dict(kw, sampling=self.sampling, seed=seed)
        t0 = time.perf_counter()
        try:
            answer = getattr(self.engine, kind)(*args, **kw)
        except Exception as e:
            raise RuntimeError(f"the {self.role} server {self.engine.url} failed a {kind} request: "
                               f"{type(e).__name__}: {e}") from e
        return answer, time.perf_counter() - t0

    def _count(self, i: int, answer, dt: float, args: tuple) -> None:
        """Count a request's answer and seconds in row ``i``'s stats, and the tokens it counted of the texts it was
        sent (``args``: a write's context, a read's context and step) and wrote."""
        u, s = answer.usage, self.rows[i].stats
        s.requests += 1
        s.http_s += dt
        s.prefill_tokens += u.prefill_tokens if u.prefill_tokens is not None else u.prompt_tokens - (u.cached_tokens
                                                                                                     or 0)
        self.counted[i] += _counted(args, answer)
        self.passes[i] += 1
        self.served_s[i] += dt

    def write_steps(self, forced: Mapping[int, Forced], limits: Mapping[int, int], top_k: int | None = None,
                    after: Mapping[int, str] | None = None) -> tuple[dict[int, Proposal], dict]:
        """One step per row after its forced tokens (at most ``limits[i]`` tokens, forced ones included), and the
        servers' answers; a row whose step can hold nothing past its forced tokens sends no request. ``after``: text
        a row's step follows beyond its committed text (the steps of its window before it)."""
        calls, steps, after = {}, {}, after or {}
        for i, f in forced.items():
            if forced_ends_step(f, self.step_spec, limits[i]):  # sent as context, the server's stop would not see it
                steps[i] = Proposal((), len(f), f.text, n_new=0, forced_texts=f.texts)
            else:
                context = self.context(i) + after.get(i, "") + f.text
                cap = min(self.step_spec.max_step_tokens, limits[i]) - len(f)
                calls[i] = ((context,), dict(step=self.step_spec, max_tokens=cap, top_k=top_k))
        answers = self.each("write", calls)
        for i, w in answers.items():
            f = forced[i]
            conf = float(w.tokens.logprobs.min()) if w.tokens is not None and len(w.tokens.logprobs) else None
            steps[i] = Proposal((), len(f), f.text + w.text, n_new=w.usage.completion_tokens, eos=w.stop == "eos",
                                confidence=conf, forced_texts=f.texts)
        return steps, answers

    def write(self, rows: Sequence[int], limits: Mapping[int, int], forced: Mapping[int, Forced] | None = None,
              alone: bool = False) -> dict[int, Proposal]:
        """The server writes one step per row (the first one, or a refused one), or with ``alone`` (the baselines)
        each row's whole output in one request, cut where the step loop would stop at the answer
        (:func:`answer_cut`)."""
        if not alone:
            return self.write_steps(forced, limits)[0]
        calls = {i: ((self.context(i),), dict(step=None, max_tokens=limits[i],
                                              top_k=1 if self.rows[i].answer_marker else None)) for i in rows}
        out = {}
        for i, w in self.each("write", calls).items():
            text, n, row = w.text, w.usage.completion_tokens, self.rows[i]
            cut = answer_cut(w.tokens, self.step_spec, row.answer_marker, w.text)
            if cut is not None:
                text, n = (w.text[: len(cut[0])] if w.text.startswith(cut[0]) else cut[0]), cut[1]
            eos = w.stop == "eos" and cut is None
            end = None if eos or cut is not None else "budget" if n >= row.budget else "context"
            out[i] = Proposal([], 0, text, n_new=n, eos=eos, end=end)
        return out

    def sync(self, row: int, commit: Commit) -> None:
        """Nothing to sync: a served part holds no context between requests; the server reads the row's committed text
        with the next one (a refused step never joins it)."""


class _Outcome:
    """A request's answer or its exception (a failure fails one row, not the phase)."""

    def __init__(self, value=None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error

    @classmethod
    def of(cls, fn, *args) -> _Outcome:
        try:
            return cls(fn(*args))
        except Exception as e:  # noqa: BLE001 (a dead server or a bad answer fails this row, not the decode)
            return cls(error=e)


class EngineProposer(EnginePart):
    """The draft's server writing steps; the draft probe reads the written tokens' top-k (its ``p``).

    Args:
        probe: the draft probe, or None.
        **kw: :class:`EnginePart`'s arguments (role ``"draft"``).
    """

    def __init__(self, engine, probe, **kw) -> None:
        super().__init__(engine, "draft", **kw)
        self.probe, self.spec = probe, probe.config.features if probe is not None else None
        self.written: dict = {}  # per row: the server's answer for the first step of its window
        self.opened: dict[int, tuple[str, Forced]] = {}  # per row: that step's context and its forced tokens
        self.window: dict[int, str] = {}  # per row: the text of its window's steps so far
        self.ahead: dict[int, list[Proposal]] = {}  # per row: the window's next steps, written with its first one
        self.prefetch: dict[int, tuple[str, Future]] = {}  # per row: the next window drafted ahead, and its context
        self._pool: ThreadPoolExecutor | None = None

    def retire(self, rows: Sequence[int]) -> None:
        """:meth:`EnginePart.retire`; a window drafted ahead for a finished row is cancelled if it has not started,
        else waited for and counted in the row's stats (its request was sent)."""
        for i in rows:
            if (pending := self.prefetch.pop(i, None)) is not None and not pending[1].cancel():
                if (got := pending[1].result()).error is None:
                    self._count(i, *got.value, (pending[0],))
                    self.rows[i].stats.ahead_windows += 1
        super().retire(rows)

    def propose(self, rows: Mapping[int, RowState], *, for_p: bool, window: Window = ONE_STEP,
                room_after: RoomAfter | None = None) -> dict[int, list[Proposal]]:
        """A window of steps per row. A window above one step is written in one request and cut into its steps here
        (a step the window's request did not hold is written on its own); with ``window.overlap`` each row's next
        window is then drafted ahead, while the target reads this one (:meth:`_draft_ahead`)."""
        if (window.size > 1 or self.prefetch) and not for_p:
            first = self._write_window(rows, window.size)
        else:
            first = self._write(rows, for_p, more=False)
        self.window = {i: d.text for i, d in first.items()}
        windows = {i: [d] for i, d in first.items()}
        if room_after is not None:
            grow_windows(windows, rows, window, self._more, room_after)
        if window.overlap:
            self._draft_ahead({i: w for i, w in windows.items() if not rows[i].rewrite}, window.size)
        return windows

    def _more(self, rows: Mapping[int, RowState]) -> dict[int, Proposal]:
        """The next step of each row's window: written with its first one, else in a request of its own."""
        steps = {i: self.ahead[i].pop(0) for i in rows if self.ahead.get(i)}
        steps.update(self._write({i: s for i, s in rows.items() if i not in steps}, False, more=True))
        for i, d in steps.items():
            self.window[i] = self.window.get(i, "") + d.text
        return steps

    def _write(self, rows: Mapping[int, RowState], for_p: bool, more: bool) -> dict[int, Proposal]:
        """One step per row, one request each."""
        top_k = self.spec.top_k if for_p and self.spec is not None and self.spec.needs_topk else None
        steps, written = self.write_steps({i: s.forced for i, s in rows.items()},
                                          {i: s.limit for i, s in rows.items()}, top_k,
                                          after=self.window if more else None)
        if not more:
            self.written, self.window, self.ahead = written, {}, {}
            self.opened = {i: (self.context(i), s.forced) for i, s in rows.items() if s.forced}
        return steps

    def _write_window(self, rows: Mapping[int, RowState], window: int) -> dict[int, Proposal]:
        """Up to ``window`` steps per row in one request (``step=None``, its tokens cut at the step's delimiters and
        cap as the server's stop would cut them), or the window drafted ahead for the row when it still holds; the
        first step of each row is returned."""
        self.written, self.opened, self.window, self.ahead, calls, out = {}, {}, {}, {}, {}, {}
        cap = self.step_spec.max_step_tokens
        answers = self._drafted_ahead(rows)
        for i, s in rows.items():
            room = s.limit - len(s.forced)
            if room < 1:
                out[i] = Proposal((), len(s.forced), s.forced.text, n_new=0, forced_texts=s.forced.texts)
            elif i not in answers:
                calls[i] = ((self.context(i) + s.forced.text,),
                            dict(step=None, max_tokens=min(room, window * cap), top_k=1))
        answers.update(self.each("write", calls))
        for i, w in answers.items():
            steps = cut_steps(w, rows[i].forced, self.step_spec, rows[i].limit - len(rows[i].forced))
            if steps is None:
                self.rows[i].fail(f"the draft server {self.engine.url} returned token texts that do not spell its "
                                  "text; a window of steps is cut at their boundaries")
                continue
            if not steps:
                self.rows[i].fail(f"the draft server {self.engine.url} stopped after {len(w.tokens.tokens)} token(s) "
                                  f"without finishing a step: its context is full. {_context_fix(self.engine)}")
                continue
            out[i], self.ahead[i] = steps[0], steps[1:window]
        return out

    def score(self, rows: Sequence[int]) -> dict[int, float]:
        """The draft probe's ``p`` of each row's last step, from the top-k its server returned with it; a step opened
        by forced tokens (the target's bonus token, which the write took as context) reads their top-k first, in one
        more request, so that ``p`` reads the whole step as in-process and in the label build."""
        forced = self.each("read", {i: ((c, f.text), dict(top_k=self.spec.top_k, hidden=False))
                                    for i, (c, f) in self.opened.items() if i in rows and not self.rows[i].done})
        t0, out = time.perf_counter(), {}
        for i in rows:
            w = self.written.get(i)
            if w is None or w.tokens is None:
                self.rows[i].fail(f"the draft server {self.engine.url} returned no log-probs for a written step "
                                  "though top_k was asked (the draft probe's p reads them)")
                continue
            if self.rows[i].done:  # its forced tokens' read failed
                continue
            tokens = w.tokens if i not in forced else forced[i].step.join(w.tokens)
            out[i] = run_probe(self.probe, features(self.spec, tokens, None))[0]
        self.probe_s += time.perf_counter() - t0
        return out

    def _draft_ahead(self, windows: Mapping[int, Sequence[Proposal]], window: int) -> None:
        """Start drafting each row's next window (one request each, in the background) as if every step of this one
        were kept: it runs while the target reads this window."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.concurrency)
        cap = self.step_spec.max_step_tokens
        for i, w in windows.items():
            r, text = self.rows[i], "".join(d.text for d in w)
            room = r.budget - r.stats.output_tokens - sum(d.n_new for d in w) - 1  # the bonus token opens it
            if (context_room := self.room(i)) is not None:  # the server's context, after the window it follows
                held = sum(d.n_new + sum(len(t.encode()) for t in d.forced_texts) for d in w)  # bonus: a byte a token
                room = min(room, context_room - held - 1)
            if r.done or w[-1].eos or room < 1 or answer_complete(r.text + text, r.answer_marker):
                continue
            context = self.context(i) + text
            kw = dict(step=None, max_tokens=min(room + 1, window * cap), top_k=1)
            self.prefetch[i] = (context, self._pool.submit(_Outcome.of, self._send, "write", (context,), kw,
                                                           self.seed(i, "ahead")))

    def _drafted_ahead(self, rows: Mapping[int, RowState]) -> dict:
        """The windows drafted ahead that still hold, as answers to this window's writes: the row kept the whole
        window they followed, and the draft's first token is the target's bonus token (it is cut off; the steps
        after it were drafted after that same token). The others are thrown away (their requests still count)."""
        out = {}
        for i, (context, future) in list(self.prefetch.items()):
            del self.prefetch[i]
            got = future.result()
            if got.error is not None:
                continue  # the row's own write below says what is wrong, if anything
            w, dt = got.value
            self._count(i, w, dt, (context,))
            self.rows[i].stats.ahead_windows += 1
            fit = _after_forced(w, rows[i].forced.text) if i in rows and self.context(i) == context else None
            if fit is not None:
                self.rows[i].stats.ahead_used += 1
                out[i] = fit
        return out


class EngineVerifier(EnginePart):
    """The target's server reading each drafted step; the target probe and the fast path judge its answer.

    Args:
        probe: the target probe, or None.
        coins: per row, the generator of its acceptance coins.
        **kw: :class:`EnginePart`'s arguments (role ``"target"``).
    """

    def __init__(self, engine, probe, coins, **kw) -> None:
        super().__init__(engine, "target", **kw)
        self.probe, self.spec, self.coins = probe, probe.config.features if probe is not None else None, coins
        self.read_at: dict[int, tuple[str, str]] = {}  # per row verified: (context, step) it was read at
        self.readings: dict = {}

    def admit(self, prompt: str, key: StreamKey) -> None:
        super().admit(prompt, key)
        self.coins.append(key_stream(key, "coins"))

    def verify(self, windows: Mapping[int, Sequence[Proposal]], outputs: Mapping[int, str], needs: Needs,
               rewrites: Collection[int] = ()) -> dict[int, list[Scores]]:
        """Read each row's window of steps (when the policy reads anything) in one request and score each step as
        the step-by-step loop would; an empty step is not read and cannot be kept, nor can a step whose tokens the
        server did not split at its start."""
        self.read_at = {i: (self.context(i), "".join(d.text for d in w)) for i, w in windows.items() if w[0].text}
        self.readings = {}
        if needs.q or needs.fast_path is not None:
            kw = dict(top_k=self.read_top_k(needs), hidden=needs.q and self.spec.needs_hidden)
            self.readings = self.each("read", {i: (at, kw) for i, at in self.read_at.items()})
        scores = {}
        for i in self.read_at:
            if self.rows[i].done:  # its read failed
                continue
            reading, w = self.readings.get(i), windows[i]
            parts = split_reading(reading, [d.text for d in w]) if reading is not None else [None] * len(w)
            out = outputs[i]
            scores[i] = []
            for d, part in zip(w, parts):
                if part is False:  # the server's tokens straddle the step's start: nothing to read it from
                    break
                scores[i].append(self._score(d, out, part, needs, self.coins[i]))
                out += d.text
        return scores

    def _score(self, d: Proposal, output: str, read, needs: Needs, coins: torch.Generator) -> Scores:
        """One step's scores from ``read``: its ``(TokenLogprobs, hidden rows)``, or None when nothing was read."""
        step, hidden = read if read is not None else (None, None)
        fast = fast_keeps(step, d.n_forced, needs.fast_path) if needs.fast_path is not None else False
        q = x = None
        if needs.q and not fast:
            t0 = time.perf_counter()
            x = features(self.spec, step, hidden)
            q = run_probe(self.probe, x)[0]
            self.probe_s += time.perf_counter() - t0
        coin = float(torch.rand((), generator=coins)) if needs.coin and not fast else None
        return Scores(text=d.text, output=output, features=x, fast=fast, q=q, coin=coin)

    def read_top_k(self, needs: Needs) -> int:
        """The top-k a verifying read asks for: what the target probe and the fast path read (at least 1)."""
        ks = [1]
        if needs.q and self.spec.needs_topk:
            ks.append(self.spec.top_k)
        if needs.fast_path is not None:
            ks.append(needs.fast_path.top_k)
        return max(ks)

    def bonus(self, rows: list[int]) -> dict[int, Forced]:
        """The target's next token after each row's kept step: from its verifying read, or from a read of its own
        when the policy read nothing (its text, or the end of the sequence, which has none)."""
        got = {i: self.readings[i] for i in rows if i in self.readings}
        got.update(self.each("read", {i: (self.read_at[i], dict(top_k=1, hidden=False))
                                      for i in rows if i not in got}))
        return {i: Forced(eos=True) if r.next_eos else Forced(texts=(r.next_text,) if r.next_text else ())
                for i, r in got.items()}


@dataclasses.dataclass(frozen=True)
class _Counted:
    """Texts a server counted: ``text`` is ``tokens`` tokens, and each of ``pieces`` (token texts) one more."""

    text: str
    tokens: int
    pieces: tuple[str, ...] = ()

    def covers(self, committed: str) -> tuple[int, int]:
        """How much of ``committed`` (which starts with ``text``) this count covers: characters and tokens."""
        at, n = len(self.text), self.tokens
        for piece in self.pieces:
            if not piece or not committed.startswith(piece, at):
                break
            at, n = at + len(piece), n + 1
        return at, n


def _counted(args: tuple, answer) -> list[_Counted]:
    """What a request's answer counted (its usage and token texts): a write's context and what it wrote after it, a
    read's context and step. Token texts that do not spell the text (a server that decodes each id alone, a token
    straddling the step's start) give the whole text's count alone."""
    u = answer.usage
    if len(args) == 2:  # a read: context + step, then the drawn token (not in the text)
        context, step = args
        pieces = spell(list(answer.step.tokens), step) if answer.step is not None else None
        if pieces is None:
            return [_Counted(context + step, u.prompt_tokens)]
        return [_Counted(context, u.prompt_tokens - len(pieces), tuple(pieces))]
    (context,), text = args, answer.text
    tokens = list(answer.tokens.tokens) if answer.tokens is not None else []
    pieces = spell(tokens, text) or spell(tokens[:-1], text)  # the last one may be EOS's
    if pieces is None:
        return [_Counted(context, u.prompt_tokens), _Counted(context + text, u.prompt_tokens + u.completion_tokens)]
    return [_Counted(context, u.prompt_tokens, tuple(pieces))]


def _after_forced(w, forced: str):
    """A continuation drafted ahead with its first token ``forced`` (the target's bonus token) cut off, or None when
    its first token is not that text (no forced text: ``w`` as it is)."""
    if not forced:
        return w
    t = w.tokens
    if t is None or not t.tokens or t.tokens[0] != forced or not w.text.startswith(forced):
        return None
    usage = dataclasses.replace(w.usage, completion_tokens=w.usage.completion_tokens - 1)
    return dataclasses.replace(w, text=w.text[len(forced) :], tokens=t.span(1), usage=usage)


def cut_steps(w, forced: Forced, step: StepSpec, room: int) -> list[Proposal] | None:
    """The steps of a continuation written in one request, cut where a one-step write would stop: at a delimiter, at
    the step cap (the forced tokens count toward the first step's), or at ``room`` new tokens in all; an unfinished
    last step is dropped (the request stopped at its ``max_tokens``) unless EOS ended it. Empty when the server
    stopped before a step was finished (its context full: a write of all it was asked for finishes one); None when
    its token texts cannot be mended to spell its text (:func:`~generation.engines.base.spell`)."""
    if w.tokens is None:
        return None
    pieces = list(w.tokens.tokens)
    without_eos = spell(pieces[:-1], w.text) if w.stop == "eos" and pieces else None
    eos_piece = without_eos is not None  # the last piece is the EOS token's own text
    pieces = without_eos if eos_piece else spell(pieces, w.text)
    if pieces is None:
        return None
    out, a, lp = [], 0, w.tokens.logprobs.tolist()
    for b in step_ends(pieces, step, forced, room):
        f = forced if not out else NOTHING_FORCED
        out.append(Proposal((), len(f), f.text + "".join(pieces[a:b]), n_new=b - a,
                            confidence=min(lp[a:b], default=None), forced_texts=f.texts))
        a = b
        if b >= room:
            return out
    cur, n = "".join(pieces[a:]), len(pieces) - a
    if w.stop == "eos":  # the EOS token ends the last step (counted in it, as a one-step write counts it)
        if cur or not out:
            f = forced if not out else NOTHING_FORCED
            out.append(Proposal((), len(f), f.text + cur, n_new=n + eos_piece, eos=True,
                                confidence=min(lp[a:], default=None), forced_texts=f.texts))
        else:
            out[-1] = dataclasses.replace(out[-1], eos=True, n_new=out[-1].n_new + eos_piece)
    return out


def forced_ends_step(forced: Forced, step: StepSpec, limit: int | None = None) -> bool:
    """Whether the forced tokens opening a step end it alone, as a one-step write stops: they fill the step's cap (or
    ``limit`` tokens), or their text completes a delimiter."""
    cap = step.max_step_tokens if limit is None else min(step.max_step_tokens, limit)
    return len(forced) >= cap or ends_step(forced.text, step.delimiters)


def step_ends(pieces: Sequence[str], step: StepSpec, forced: Forced = NOTHING_FORCED, room: int | None = None
              ) -> Iterator[int]:
    """Where the steps of a run of written tokens (their texts) end, as a one-step write would stop each: at a
    delimiter or at the step cap (the ``forced`` tokens opening the first step count toward its cap, and their text
    toward its delimiter), and at ``room`` tokens in all (its last end). Yields each step's end index (0: the forced
    tokens end the first step alone); an unfinished last step yields none."""
    cur, n, first = forced.text, 0, True
    if forced and forced_ends_step(forced, step):
        yield 0  # as a one-step write returns the forced tokens alone
        cur, first = "", False
    for k, piece in enumerate(pieces, 1):
        cur, n = cur + piece, n + 1
        if ends_step(cur, step.delimiters) or n >= step.max_step_tokens - (len(forced) if first else 0) or \
                (room is not None and k >= room):
            yield k
            if room is not None and k >= room:
                return
            cur, n, first = "", 0, False


def split_reading(reading, texts: Sequence[str]) -> list:
    """A window's reading cut into its steps: ``(TokenLogprobs, hidden rows)`` per step, or False for a step whose
    start falls inside a token (it and the steps after it cannot be read), its tokens' texts mended where the server
    decoded each id alone (:func:`~generation.engines.base.spell`)."""
    tokens = reading.step
    pieces = spell(tokens.tokens, "".join(texts)) or []
    out, a, text_at, k = [], 0, 0, 0
    for end in accumulate(len(t) for t in texts):
        while k < len(pieces) and text_at < end:
            text_at += len(pieces[k])
            k += 1
        if text_at != end:
            return out + [False] * (len(texts) - len(out))
        out.append((tokens.span(a, k), reading.hidden[a:k] if reading.hidden is not None else None))
        a = k
    return out


def answer_cut(tokens: TokenLogprobs | None, step: StepSpec, marker: str | None,
               written: str | None = None) -> tuple[str, int] | None:
    """Where the step loop would stop a text written in one request: the end of the first step (cut at
    ``step``'s delimiters and cap, token by token) after which the answer line is complete. ``written``: the text the
    server decoded whole, which mends per-token texts that do not add up to it (:func:`spell`; an end-of-sequence
    token's own text at the end is left as it is).

    Returns:
        ``(text, n_tokens)`` up to that step's end, or None when the answer never completes.
    """
    if tokens is None or not marker:
        return None
    pieces = list(tokens.tokens)
    if written is not None and pieces:
        pieces = spell(pieces, written) or (spell(pieces[:-1], written) or pieces[:-1]) + pieces[-1:]
    for b in step_ends(pieces, step):
        text = "".join(pieces[:b])
        if answer_complete(text, marker):
            return text, b
    return None


def fast_keeps(step: TokenLogprobs, n_forced: int, fp: FastPath) -> bool:
    """:func:`~semanticspec.policies.fast_path_keeps_rows` from a server's top-k: every drafted token is in the
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
    return probe_features(spec, tokens, **kw)


def _context_fix(engine) -> str:
    """What to do when a server's context filled before the rows' ends: give it (a server that states none), or give
    the server's own (a larger ``n_ctx`` was given)."""
    given = getattr(engine, "context_length", None)
    if given is None:
        return ("A server that states no context (llama-cpp-python) needs it given (n_ctx; the endpoint's "
                "--backend_n_ctx), so that rows end at the context's end")
    return (f"The context given or stated, {given} tokens, is larger than the server's own: give the server's (n_ctx; "
            "the endpoint's --backend_n_ctx)")
