"""`SemanticSpecDecoder`: step-level speculative decoding verified by semantic probes, and its baselines, over
in-process models; and the two parts it gives the loop.

The draft writes a reasoning step; the target reads it in one forward pass over the new tokens
against its KV cache; a probe on the target's hidden states (``q``) and one on the draft's (``p``)
decide whether the step means what the target would have said (docs/design.md "Decoding"):

1. the target writes the first step if ``target_first_step`` (the paper; by default the draft does);
2. **propose**: the :class:`~semanticspec.parts.Proposer` (the draft) writes a step, keeping
   what the draft probe reads;
3. **verify**: the :class:`~semanticspec.decoder.TargetVerifier` reads the step in one forward
   pass (new tokens only, KV cache kept) and scores it (``q``, fast path, judge, coin); the
   proposer adds the draft probe's ``p`` where the policy wants it;
4. **decide**: the method's :class:`~semanticspec.policies.AcceptancePolicy`, a pure function
   of the step's :class:`~semanticspec.scores.Scores`, keeps or refuses it (SemanticSpec,
   :class:`~semanticspec.policies.ProbePolicy`: the optional gated top-k fast path, then
   ``q >= tau`` or the paper's ratio rule ``min(1, ratio_scale * q / p)``);
5. **commit or roll back**: a kept step stays in both caches and the token the target predicts
   after it (the *bonus* token) opens the next step; a refused one is rolled back by length and the
   target writes the step (with token-level speculation from the draft, ``token_sd``, by default);
6. stop at EOS, a completed answer-marker line, the token budget or the context end.

The parts write on each model's :class:`~generation.cache.BatchedCache`: the draft's :class:`DraftProposer` writes
windows of steps and scores their first one with the draft probe (``p``); the target's :class:`TargetVerifier` reads
every row's window in one forward and returns typed :class:`~semanticspec.scores.Scores` (the target probe's ``q``
from the hidden states and logits of that one forward, the fast-path verdict, the judge's score after a judge turn,
the acceptance coin). Both sync their caches to what a row committed (:meth:`CachePart.sync`: roll back by length,
feed the bonus token or the target's step), and the target writes its steps token by token from the draft's
proposals (:class:`~semanticspec.parts.TokenVerifier`).

Several prompts advance together, each with its own decisions (one :class:`~generation.cache.BatchedCache`
per model, in :class:`~semanticspec.loop.StepLoop`). Every baseline (target only, draft only,
SpecReason-style judging, random and oracle acceptance) runs through the same loop and the same
sampler, so their timings compare; token-level speculative decoding runs in transformers' own
assisted generation (:mod:`semanticspec.hf`) and is compared with transformers' own target-only
generation (``method="hf_target_only"``). ``method=`` names map to methods in one table,
:data:`semanticspec.methods.METHODS`.

Example (a task, :class:`datamodules.tasks.base.Task`, gives the problems, their prompts, the answer marker that
ends a decode, and the checker):
    >>> task = ArithmeticTask()  # or BoxedMathTask(path="problems.jsonl"), or your own Task
    >>> problems = task.problems(8, seed=0)  # records {"problem", "answer"}: a file's first 8, or 8 made in code
    >>> dec = SemanticSpecDecoder(target, draft, tok, target_probe="ckpt/target", draft_probe="ckpt/draft",
    ...                           policy=ProbePolicy(rule="threshold", tau=0.5), task=task)
    >>> results = dec.generate(dec.prompts([p["problem"] for p in problems]), max_new_tokens=256,
    ...                        seed=list(range(8)))  # one seed per prompt: each decodes alone as here
    >>> sum(task.check(r.text, p["answer"]) for r, p in zip(results, problems)) / len(problems)  # accuracy
    >>> summarize(results)["step_acceptance"]

``task.problems(n, seed)`` reads a task file's first ``n`` records, or makes ``n`` in code with
``task.generate(n, seed)`` when the task has no file (the embedded world's ``ArithmeticTask``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter

import torch

from generation.cache import BatchedCache, context_length, vocab_size
from generation.features import probe_features
from generation.handover import Handover, decode_text, pad_id, whole_prefix
from generation.sampling import Sampler, StepDraft, StepWriter, StreamKey, key_stream, stream_seed
from generation.specs import StepSpec
from probes.model import load_probes, run_probe
from semanticspec.base import Plan, StepDecoder
from semanticspec.config import DecodeConfig
from semanticspec.hf import TransformersLoop, hf_generate
from semanticspec.loop import StepLoop
from semanticspec.meter import Meter
from semanticspec.parts import ONE_STEP, Commit, Forced, Proposal, RoomAfter, RowState, Window, grow_windows
from semanticspec.policies import (Needs, ProbePolicy, check_policy, default_policy, fast_path_keeps_rows, judge_score,
                                   stored_tau)
from semanticspec.prompts import read_prompts
from semanticspec.results import DecodeResult, DecodeStats, StepEvent, StepTrace, summarize
from semanticspec.rows import Row
from semanticspec.scores import Scores
from semanticspec.speculative import speculate_tokens

__all__ = ["DecodeResult", "DecodeStats", "SemanticSpecDecoder", "StepTrace", "summarize"]

ProbeLike = str | os.PathLike | torch.nn.Module | None


class SemanticSpecDecoder(StepDecoder):
    """Step-level speculative decoding with semantic probes (SemanticSpec), plus baselines.

    Args:
        target: the large transformers causal LM (eval mode, any device).
        draft: the small causal LM (any device, may differ from the target's).
        tokenizer: the target's tokenizer (``tokenizer(prompt)`` adds BOS as the model expects).
        draft_tokenizer: the draft's tokenizer; None = shares ``tokenizer``. Another hands steps over as text.
        target_probe: exported probe directory (loaded with ``probes.load_probe`` so its
            fingerprint is checked against ``target``), a ``SemanticProbe``, or None.
        draft_probe: same for the draft (needed by the ratio rule).
        policy: SemanticSpec's acceptance (:class:`~semanticspec.policies.ProbePolicy`: rule,
            ``tau``, ``ratio_scale``, fast path, ``lazy_p``); None = :func:`~semanticspec.policies.default_policy`:
            the threshold rule at ``tau=0.5`` (or at the ``threshold.json`` beside the target probe's folder, written by
            ``python -m semanticspec.evaluate``), after the gated top-1 fast path when the two models share a
            tokenizer (``ProbePolicy(top_k=1)``; ``ProbePolicy()`` has no fast path).
        config: the decoder's default :class:`~semanticspec.config.DecodeConfig` (the budget, sampling, method,
            window and the loop's settings: who writes the first step, the step spec, token-level speculation, the
            bonus token); a ``generate`` call without a config starts from it. None = ``DecodeConfig()``.
        task: the :class:`~datamodules.tasks.base.Task` whose problems are decoded (or any object with an
            ``answer_marker``): a decode ends once a newline follows an occurrence of its ``answer_marker``
            (:func:`~semanticspec.rows.answer_complete`). None (default): the config's ``answer_marker``, else none
            (a decode ends at EOS, the token budget or the context end). Its problems come from
            ``task.problems(n, seed)`` and their prompts from ``decoder.prompts(problems)``; ``task.check`` scores
            the text.
        probe_dtype: the dtype the probes' MLPs run in: ``"auto"`` (default: float16 where float16 matrix-vector
            products are fast, CUDA and x86 CPUs with AVX2/AVX-512; float32 elsewhere;
            :func:`~probes.model.resolve_probe_dtype`), ``"float32"`` (the exported weights as they are) or
            ``"float16"``. A probe given as a module is converted on a copy.

    Raises:
        ValueError: a fast path or ``config.token_sd=True`` with two tokenizers, or a probe exported for
            another model or trained on other steps (naming the fields), a bad ``probe_dtype``, or a task whose
            answer marker differs from ``config.answer_marker`` (naming both), or a ``config`` every call would be
            refused with (``overlap=True``, ``lookahead`` above 1 with two tokenizers).
        TypeError: a ``policy`` that is not a ``ProbePolicy`` (other methods are named per call, ``method=``).
    """

    def __init__(self, target, draft, tokenizer, draft_tokenizer=None, target_probe: ProbeLike = None,
                 draft_probe: ProbeLike = None, policy: ProbePolicy | None = None, config: DecodeConfig | None = None,
                 *, probe_dtype: str = "auto", task=None):
        for name, model in (("target", target), ("draft", draft)):
            if not isinstance(model, torch.nn.Module):
                raise TypeError(f"{name}={model!r}: expected an in-process transformers model (AutoModelForCausalLM); "
                                "models behind servers decode with ServedDecoder")
        for name, tok in (("tokenizer", tokenizer), ("draft_tokenizer", draft_tokenizer)):
            if (tok is not None or name == "tokenizer") and not (callable(tok) and hasattr(tok, "get_vocab")):
                raise TypeError(f"{name}={tok!r}: expected a transformers tokenizer (AutoTokenizer)")
        check_policy(policy)
        self.handover = Handover(tokenizer, draft_tokenizer)
        self.shared = self.handover.shared
        self.windows = self.shared  # the target reads a window of draft steps in its own tokens
        self.policy = policy or default_policy(fast_path=self.shared, tau=stored_tau(target_probe))
        self.config, self.task = DecodeConfig.of(config), task
        if self.policy.top_k and not self.shared:
            raise ValueError(f"invalid SemanticSpecDecoder arguments: {_two_tokenizers_fast_path(self.policy.top_k)}")
        self.target, self.draft = target.eval(), draft.eval()
        self.tokenizer, self.draft_tokenizer = tokenizer, self.handover.draft_tokenizer
        self.target_probe, self.draft_probe, self._labelled_with = load_probes(
            (target_probe, draft_probe), (target, draft), (tokenizer, self.draft_tokenizer), probe_dtype)
        self._digits = [self.tokenizer(f" {d}", add_special_tokens=False).input_ids[-1] for d in range(10)]
        self._judges: dict[str, JudgeTurn] = {}  # per judge_suffix
        self._stoppers: dict = {}
        self.step = self._checked_default()

    def _prompt(self, problem: str):
        """Text where the one tokenizer has no chat template (``generate`` adds BOS as the tokenizer does), else each
        model's own ids in its own chat template: one list with one tokenizer, a ``(target, draft)`` pair with two."""
        task, tok = self.task, self.tokenizer
        if not self.shared:
            return task.prompt(tok, problem), task.prompt(self.draft_tokenizer, problem)
        return task.prompt(tok, problem) if getattr(tok, "chat_template", None) else task.prompt_text(tok, problem)

    def _token_sd(self, cfg: DecodeConfig) -> tuple[bool, bool]:
        if cfg.token_sd and not self.shared:
            raise ValueError("token_sd=True (token-level speculation inside target steps) needs a shared tokenizer")
        return self.shared if cfg.token_sd is None else cfg.token_sd, cfg.bonus_token and self.shared

    def judge(self, suffix: str) -> JudgeTurn:
        """The judge turn of ``suffix`` (a config's ``judge_suffix``) in the target's tokens."""
        if suffix not in self._judges:
            self._judges[suffix] = JudgeTurn(self.tokenizer(suffix, add_special_tokens=False).input_ids, self._digits)
        return self._judges[suffix]

    def spare(self, cfg: DecodeConfig) -> int:
        return 1 + len(self.judge(cfg.judge_suffix).suffix)  # a bonus token and SpecReason's judge turn

    def _refusals(self, cfg: DecodeConfig, method) -> list[str]:
        problems = []
        if cfg.overlap:
            problems.append("overlap=True: drafting the next window while the target verifies is served decoding's "
                            "(ServedDecoder: the two servers are separate processes); in-process the two models share "
                            "this process's cores")
        vocab = vocab_size(self.target.config)
        if isinstance(method, TransformersLoop) and method.assisted and not self.shared and \
                vocab == vocab_size(self.draft.config):
            problems.append(f"method={cfg.method!r}: transformers' assisted generation reads two models of one "
                            f"vocabulary size ({vocab}) as sharing a tokenizer, and this pair has two; it cannot run "
                            "on them (the step loop's methods can)")
        if (top_k := getattr(getattr(method, "policy", None), "top_k", 0)) and not self.shared:  # a call's policy
            problems.append(f"method={cfg.method!r}: {_two_tokenizers_fast_path(top_k)}")
        if (cfg.lookahead or 1) > 1 and not self.shared:
            problems.append(f"lookahead={cfg.lookahead}: the target reads a window of the draft's steps in its own "
                            "tokens, which needs one tokenizer; this pair has two (use lookahead=1)")
        if (room := self.context_room(self.spare(cfg))) is not None and room < 1:  # every decode would be empty
            problems.append(f"judge_suffix: its {len(self.judge(cfg.judge_suffix).suffix)} tokens, which every method "
                            f"keeps free at the context's end, leave no room in the models' context "
                            f"({min(c for c in self.contexts() if c is not None)} tokens); shorten it")
        return problems

    def _inputs(self, prompts, cfg: DecodeConfig, method) -> tuple[list, list]:
        """The target's and the draft's ids of each prompt."""
        return read_prompts(prompts, self.handover, self.target, self.draft)

    def transformers_events(self, plan: Plan, batch: tuple, keys) -> Iterator[StepEvent]:
        """Prompt by prompt through :func:`~semanticspec.hf.hf_generate`, each seeded from its own sampling stream;
        each prompt's one event is its end. Each stops at the models' context end less ``plan.spare`` (the room the
        step loop's methods keep free, so that every method stops at the same place): with two tokenizers
        transformers hands text over and only the target's context counts."""
        cap = plan.cfg.max_new_tokens
        for k, (key, *ids) in enumerate(zip(keys, *batch)):
            room = min([c - len(x) - plan.spare for c, x in zip(self.contexts()[: 1 + self.shared], ids)
                        if c is not None], default=cap)
            r = hf_generate(self.target, self.draft, self.tokenizer, None if self.shared else self.draft_tokenizer,
                            ids[0], plan.method.assisted, cap, plan.sampling, stream_seed(*key, "sampling"), room,
                            plan.loop.answer_marker)
            yield StepEvent(k, None, r.text, r)

    def step_loop(self, plan: Plan, batch: tuple, keys: Sequence[StreamKey]) -> StepLoop:
        """The loop of one batch of ``plan`` over the in-process models: one :class:`~generation.cache.BatchedCache`
        per model.

        Args:
            plan: the call's plan (its budget, sampling, loop setup, step spec and spare room).
            batch: the prompts' target ids and draft ids.
            keys: each prompt's :data:`~generation.sampling.StreamKey`: it samples and flips its acceptance coins
                from its own streams, seeded from its key (:func:`~generation.sampling.stream_keys`), so it decodes
                the same in any batch.
        """
        (ids_t, ids_d), n = batch, len(batch[0])
        streams = {s: [key_stream(key, s) for key in keys] for s in ("sampling", "coins")}
        sampler = Sampler(plan.sampling, streams["sampling"])
        tgt = BatchedCache(self.target, n, pad_id(self.tokenizer), _layers(self.target_probe))
        drf = BatchedCache(self.draft, n, pad_id(self.draft_tokenizer), _layers(self.draft_probe))
        for i in range(n):
            tgt.extend(i, ids_t[i])
            drf.extend(i, ids_d[i])
        target_stop, draft_stop = self._stopper(plan.step)
        proposer = DraftProposer(StepWriter(drf, draft_stop, sampler), self.draft_tokenizer, self.handover,
                                 self.draft_probe, plan.spare)
        verifier = TargetVerifier(StepWriter(tgt, target_stop, sampler), self.tokenizer, self.handover,
                                  self.target_probe, plan.spare, self.judge(plan.cfg.judge_suffix), streams["coins"])
        decode = (lambda ids: decode_text(self.tokenizer, ids)) if self.shared else None  # the output, whole
        rows = [Row(plan.cfg.max_new_tokens, plan.loop.answer_marker, decode) for _ in range(n)]
        return StepLoop(proposer, verifier, rows, plan.loop, Meter(rows, verifier, proposer))

    def _stopper(self, step: StepSpec) -> tuple:
        """The target's and the draft's stop checks of ``step`` (made once per step spec)."""
        if step not in self._stoppers:
            self._stoppers[step] = step.stopper(self.tokenizer), step.stopper(self.draft_tokenizer)
        return self._stoppers[step]

    def contexts(self) -> tuple[int | None, int | None]:
        return context_length(self.target.config), context_length(self.draft.config)

    def prompt_room(self, plan: Plan) -> int | None:
        return self._room(len(plan.inputs[0][0]), len(plan.inputs[1][0]), plan.spare)


def _layers(probe) -> list[int]:
    """The layers whose hidden states a cache keeps for ``probe`` (the last one without a probe)."""
    return list(probe.config.features.layer_ids) if probe is not None else [-1]


class CachePart:
    """A part over an in-process model's :class:`~generation.cache.BatchedCache` (its counters are the cache's).

    Args:
        writer: the model writing steps (its cache, rows holding their prompts; its stopper and the decode's sampler).
        tokenizer: the model's tokenizer.
        handover: hands steps between the two models' tokenizations.
        probe: the model's probe, or None.
        spare: context room each row keeps (a bonus token, a judge turn).
    """

    passes = property(attrgetter("cache.passes"))
    served_s = property(attrgetter("cache.served_s"))
    forward_s = property(attrgetter("cache.forward_s"))

    def __init__(self, writer: StepWriter, tokenizer, handover: Handover, probe, spare: int) -> None:
        self.writer, self.cache, self.spare = writer, writer.cache, spare
        self.tokenizer, self.handover = tokenizer, handover
        self.probe, self.spec = probe, probe.config.features if probe is not None else None
        self.probe_s = 0.0  # seconds in the probe so far

    def room(self, row: int) -> int | None:
        c = self.cache
        return None if c.context is None else c.context - len(c.seq[row]) - self.spare

    def retire(self, rows: Sequence[int]) -> None:
        self.cache.retire(rows)

    def sync(self, row: int, commit: Commit) -> None:
        """Roll the row back to the new tokens of its last read it keeps (their logits after them last), then feed
        what follows them (:class:`~semanticspec.parts.Commit`)."""
        if commit.kept is not None:
            self._keep(row, commit.kept)
        self.cache.extend(row, [*commit.then, *self._taken(row, commit.step)])

    def _keep(self, row: int, n: int) -> None:
        """The row keeps the first ``n`` new tokens of its last read and forgets the rest."""
        raise NotImplementedError

    def _whole(self, d: StepDraft) -> tuple[Proposal, tuple[int, torch.Tensor] | None]:
        """Step ``d`` as the row takes it, and the ids it leaves at the end with the logits predicting the first
        (None: none). With two tokenizers the other model reads a step as its text, so a step the cap cut inside a
        character (an emoji's bytes in a byte-level vocabulary) ends at its last whole character; the ids after it
        leave this model's context before its next step, which draws them again from the same context (each token is
        still drawn from this model's distribution). A step with no whole character (a cap below the character's byte
        tokens), or with EOS, is kept as it is."""
        tok, tokens, logits, cut = self.tokenizer, list(d.tokens), d.logits, None
        end = len(tokens) if self.handover.shared else whole_prefix(tok, tokens)
        if d.n_forced < end < len(tokens):
            cut = (len(tokens) - end, logits[end - d.n_forced])
            tokens, logits = tokens[:end], logits[: end - d.n_forced]
        return Proposal(tokens, d.n_forced, decode_text(tok, tokens), logits, eos=tok.eos_token_id in tokens,
                        confidence=least_logprob(d)), cut

    def write(self, rows: Sequence[int], limits: Mapping[int, int], forced: Mapping[int, Forced] | None = None,
              alone: bool = False) -> dict[int, Proposal]:
        """One step per row (after its forced tokens), kept as it is: the ids it leaves at its end (:meth:`_whole`)
        leave at once. ``alone`` (a baseline) changes nothing here: the loop's rounds write the output step by step."""
        steps = self.writer.write(list(rows), dict(limits), forced=_ids(forced), record_logits=not self.handover.shared)
        out = {}
        for i, d in steps.items():
            out[i], cut = self._whole(d)
            if cut is not None:
                self.cache.rollback(i, cut[0], last_logits=cut[1])
        return out

    def _taken(self, row: int, step: Proposal | None) -> list[int]:
        """The tokens of the target's ``step`` this part feeds (none: the target wrote it in its own context)."""
        return []

    def admit(self, prompt: Sequence[int], key) -> None:
        """A new row holding ``prompt`` (:meth:`~semanticspec.loop.StepLoop.admit`; its streams are the
        verifier's to add)."""
        self.cache.add_row(prompt)


class DraftProposer(CachePart):
    """The in-process draft model writing on its :class:`~generation.cache.BatchedCache`.

    Args: those of :class:`CachePart` (its probe the draft probe, reading the draft's states).
    """

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.window: dict[int, list[StepDraft]] = {}  # per row: the steps of its window, in order (p reads the first)
        self._cuts: dict[int, tuple[int, torch.Tensor]] = {}  # per row: ids its last proposal left, their logits

    def _proposal(self, row: int, d: StepDraft) -> Proposal:
        """Row ``row``'s step ``d`` as it is proposed; ids it leaves at the end (:meth:`~CachePart._whole`) leave
        the context before the row's next step, when it is kept (:meth:`_uncut`)."""
        step, cut = self._whole(d)
        if cut is not None:
            self._cuts[row] = cut
        return step

    def _uncut(self, rows) -> None:
        """The ids each row's last kept step left at its end (:meth:`_proposal`) leave the draft's context."""
        for i in rows:
            if (cut := self._cuts.pop(i, None)) is not None:
                self.cache.rollback(i, cut[0], last_logits=cut[1])

    def propose(self, rows: Mapping[int, RowState], *, for_p: bool, window: Window = ONE_STEP,
                room_after: RoomAfter | None = None) -> dict[int, list[Proposal]]:
        windows = {i: [d] for i, d in self._write(rows, for_p, more=False).items()}
        if room_after is not None:
            grow_windows(windows, rows, window, lambda more: self._write(more, False, more=True), room_after)
        return windows

    def _write(self, rows: Mapping[int, RowState], for_p: bool, more: bool) -> dict[int, Proposal]:
        """One step per row; ``more``: the step continues the row's window (after its last step, as if kept)."""
        for_p = for_p and self.spec is not None
        self._uncut(rows)
        steps = self.writer.write(
            list(rows), {i: s.limit for i, s in rows.items()}, forced=_ids({i: s.forced for i, s in rows.items()}),
            collect_hidden=for_p and self.spec.needs_hidden, record_logits=True,
            record_forced_logits=[i for i, s in rows.items() if not s.rewrite] if for_p and self.spec.needs_logits
            else False,
        )
        if more:
            for i, d in steps.items():
                self.window[i].append(d)
        else:
            self.window = {i: [d] for i, d in steps.items()}
        return {i: self._proposal(i, d) for i, d in steps.items()}

    def write(self, rows: Sequence[int], limits: Mapping[int, int], forced: Mapping[int, Forced] | None = None,
              alone: bool = False) -> dict[int, Proposal]:
        self._uncut(rows)  # the ids the row's last kept proposal left leave first
        return super().write(rows, limits, forced, alone)

    def score(self, rows: Sequence[int]) -> dict[int, float]:
        drafts = [self.window[i][0] for i in rows]
        if self.spec.needs_hidden:
            # The draft reads its step's last token only now, and only for steps that need p:
            # a kept step hands that token to the draft's next forward instead.
            for i, f in self.cache.feed(list(rows), hidden=True).items():
                d = self.window[i][0]
                d.hidden.extend(f.hidden[:, max(0, d.start - f.start) :].unbind(1))
        t0 = time.perf_counter()  # a draft forward is not probe time
        hidden = [d.pooled_input() for d in drafts] if self.spec.needs_hidden else None
        logits = [torch.stack(d.token_logits()) for d in drafts] if self.spec.needs_logits else None
        p = run_probe(self.probe, probe_features(self.spec, [d.tokens for d in drafts], hidden, logits))
        self.probe_s += time.perf_counter() - t0
        return dict(zip(rows, p))

    def _taken(self, row: int, step: Proposal | None) -> list[int]:
        if step is None:
            return []
        self._uncut([row])
        return self.handover.to_draft(list(step.tokens[step.n_forced :]), step.text)

    def _keep(self, row: int, n: int) -> None:
        self._cuts.pop(row, None)  # the step that left them is forgotten whole
        logits = [lg for d in self.window[row] for lg in d.logits]  # per new token of the window, in order
        drop = len(logits) - n
        self.cache.rollback(row, drop, last_logits=logits[n] if drop > 0 else None)


def least_logprob(d: StepDraft) -> float | None:
    """The least raw log-probability of a token the writer drew in step ``d`` (``record_logits``), or None."""
    new = d.tokens[d.n_forced :]
    if not new or len(d.logits) != len(new):
        return None
    logp = torch.log_softmax(torch.stack(d.logits).float(), dim=-1)
    return float(logp.gather(-1, torch.tensor(new, device=logp.device)[:, None]).min())


@dataclass(frozen=True)
class JudgeTurn:
    """The judge turn the target reads after a step (SpecReason): its tokens and the ten digit tokens."""

    suffix: list[int]
    digits: list[int]


@dataclass(frozen=True)
class StepRead:
    """What one verification forward read of one row's step (the probe, the fast path and the judge score it).

    Attributes:
        tokens: the step's target tokens (forced ones first).
        n_forced: how many of them were forced (the bonus token that opened the step).
        step_logits: (k, V) the target's logits predicting each step token, when the policy reads them.
        hidden: (L, k, D) the target's hidden rows of the step, when the probe reads them.
        judge_logits: (V,) the target's logits after the judge turn (SpecReason), when read.
    """

    tokens: list[int]
    n_forced: int
    step_logits: torch.Tensor | None
    hidden: torch.Tensor | None
    judge_logits: torch.Tensor | None


class TargetVerifier(CachePart):
    """The in-process target on its :class:`~generation.cache.BatchedCache`, with the target probe and the judge turn.

    Args: those of :class:`CachePart` (its probe the target probe), then
        judge: the judge turn.
        coins: per cache row, the generator of its acceptance coins.
    """

    def __init__(self, writer: StepWriter, tokenizer, handover: Handover, probe, spare: int, judge: JudgeTurn,
                 coins) -> None:
        super().__init__(writer, tokenizer, handover, probe, spare)
        self.sampler, self.judge, self.coins = writer.sampler, judge, coins
        self._new: dict[int, int] = {}  # per row read by the last verify(): new tokens
        self.token_logits: dict[int, torch.Tensor] = {}  # per row read: logits predicting its new tokens, then after

    def admit(self, prompt: Sequence[int], key) -> None:
        """A new row holding ``prompt`` with its own sampling and coin streams (the proposer's writer shares the
        sampler, so the row's sampling stream serves both models)."""
        super().admit(prompt, key)
        self.coins.append(key_stream(key, "coins"))
        self.sampler.add_stream(key_stream(key, "sampling"))

    def ends_step(self, tokens: Sequence[int], limit: int) -> bool:
        """A target step of ``tokens`` is finished: its stopper says so, or it holds ``limit`` tokens."""
        return bool(tokens) and (self.writer.stop(tokens) or len(tokens) >= limit)

    def finished(self, tokens: Sequence[int], n_forced: int, limit: int) -> Proposal | None:
        if not self.ends_step(tokens, limit):
            return None
        tokens, tok = list(tokens), self.tokenizer
        return Proposal(tokens, n_forced, decode_text(tok, tokens), eos=tok.eos_token_id in tokens)

    def rewrite(self, row: int, tokens: Sequence[int], limit: int, proposal: Proposal, drawn: bool,
                offset: int = 0) -> tuple[int, int | None] | None:
        """Token-level speculation (:func:`~semanticspec.speculative.speculate_tokens`) on the logits of the last
        :meth:`verify` (:attr:`token_logits`), the step ending at the stopper or ``limit``."""
        logits = self.token_logits.get(row)
        if logits is None:
            return None
        base, new = list(tokens), list(proposal.tokens[proposal.n_forced :])
        return speculate_tokens(self.sampler, row, new, logits[offset:], proposal.logits, drawn=drawn,
                                ends_after=lambda j: self.ends_step(base + new[:j], limit))

    def bonus(self, rows: list[int]) -> dict[int, Forced]:
        """The target's next token after each row's kept step, drawn from the forward that read it (it enters the
        contexts with :meth:`sync`)."""
        logits = torch.stack([self.cache.last_logits[i] for i in rows]).float()
        drawn = self.sampler.draw(logits, rows).tolist()
        return {i: Forced((t,), eos=t == self.tokenizer.eos_token_id) for i, t in zip(rows, drawn)}

    def verify(self, windows: Mapping[int, Sequence[Proposal]], outputs: Mapping[int, str], needs: Needs,
               rewrites: Collection[int] = ()) -> dict[int, list[Scores]]:
        """Read every row's proposals (a window of steps, one after another; plus the judge turn when needed) in one
        forward and score each step as the step-by-step loop would after the steps before it were kept.

        Rows in ``rewrites`` continue a target step the target is rewriting: read in the same forward, without
        the judge turn, and not scored. For every row read, :attr:`token_logits` holds the target's logits
        predicting each new (not forced) token of its window, then the token after it: what token-level
        speculation keeps from (:meth:`rewrite`).

        Returns:
            ``{row: [Scores per step]}`` for the rows it read and scores (an empty step reads nothing, cannot be
            kept).
        """
        tgt, hand = self.cache, self.handover
        suffix = list(self.judge.suffix) if needs.judge else []
        self._new, self.token_logits = {}, {}
        bounds, n0, pre = {}, {}, {}
        for i, window in windows.items():
            n0[i], pre[i] = len(tgt.seq[i]), tgt.last_logits[i]
            bounds[i] = []  # per step: (start, end) in the row's sequence, forced tokens included
            for d in window:
                new = hand.to_target(d, d.text)
                start = len(tgt.seq[i]) - hand.forced_in_target(d)
                tgt.extend(i, new)
                bounds[i].append((start, len(tgt.seq[i])))
            self._new[i] = len(tgt.seq[i]) - n0[i]
            tgt.extend(i, [] if i in rewrites else suffix)
        fed = tgt.feed(list(windows), hidden=needs.q and self.spec.needs_hidden, all_logits=True)
        read = {}
        for i, f in fed.items():
            end = n0[i] + self._new[i] - f.start  # one past the window's last token among the fed tokens
            self.token_logits[i] = f.predicting(n0[i] - f.start, end + 1, pre[i])
            for j, (d, (a, b)) in enumerate(zip(windows[i], bounds[i])):
                if i in rewrites and j == 0:
                    continue
                read[i, j] = self._read(i, f, a, b, hand.forced_in_target(d), pre[i], needs,
                                        f.logits[-1] if suffix else None)
        steps = {(i, j): d for i, w in windows.items() for j, d in enumerate(w)}
        outs = {(i, j): outputs.get(i, "") + "".join(d.text for d in windows[i][:j]) for i, j in read}
        scored = self._score(steps, outs, read, needs)
        if suffix:  # the judge turn is read: the target forgets it, its logits after the window last again
            for i in windows:
                if i not in rewrites:
                    tgt.rollback(i, len(suffix), last_logits=self.token_logits[i][self._new[i]])
        out: dict[int, list[Scores]] = {}
        for (i, _), s in scored.items():
            out.setdefault(i, []).append(s)
        return out

    def _read(self, i: int, f, a: int, b: int, n_forced: int, pre, needs: Needs, judge_logits) -> StepRead:
        """What the forward ``f`` read of row ``i``'s step at sequence indices ``a`` to ``b - 1``."""
        off, end = a - f.start, b - f.start
        step_logits = None
        if needs.q or needs.fast_path is not None:  # (k, V) the target's logits predicting every step token
            step_logits = f.predicting(off, end, pre)
        hidden = f.hidden[:, off:end] if needs.q and self.spec.needs_hidden else None
        return StepRead(self.cache.seq[i][a:b], n_forced, step_logits, hidden, judge_logits)

    def _score(self, steps, outputs, read: dict[tuple, StepRead], needs: Needs) -> dict[tuple, Scores]:
        """Fast path, then ``q`` and one coin per step it did not keep (in order, from its row's stream), and the
        judge's score; every mapping is keyed by ``(row, step in window)``."""
        fast, fp = {}, needs.fast_path
        if fp is not None:  # every step's drafted tokens (a bonus token excluded) scored in one pass
            rs = [(r.step_logits[r.n_forced :], r.tokens[r.n_forced :]) for r in read.values()]
            fast = dict(zip(read, fast_path_keeps_rows(rs, fp.top_k, fp.min_logprob)))
        slow = [k for k in read if not fast.get(k)]
        q, x = {}, {}
        if needs.q and slow:
            t0 = time.perf_counter()
            feats = probe_features(self.spec, [read[k].tokens for k in slow],
                                   [read[k].hidden for k in slow] if self.spec.needs_hidden else None,
                                   [read[k].step_logits for k in slow])
            x, q = dict(zip(slow, feats)), dict(zip(slow, run_probe(self.probe, feats)))
            self.probe_s += time.perf_counter() - t0
        coin = {k: float(torch.rand((), generator=self.coins[k[0]])) for k in slow} if needs.coin else {}
        return {k: Scores(text=steps[k].text, output=outputs[k], features=x.get(k), fast=fast.get(k, False),
                          q=q.get(k), coin=coin.get(k),
                          judge=judge_score(read[k].judge_logits, self.judge.digits) if needs.judge else None)
                for k in read}

    def _keep(self, row: int, n: int) -> None:
        drop = self._new.get(row, 0) - n
        if drop > 0:
            self.cache.rollback(row, drop, last_logits=self.token_logits[row][n])


def _ids(forced: Mapping[int, Forced] | None) -> dict[int, list[int]] | None:
    """Each row's forced token ids, as a writer takes them."""
    return None if forced is None else {i: list(f.ids) for i, f in forced.items()}


def _two_tokenizers_fast_path(top_k: int) -> str:
    """Why a fast path cannot run on a pair with two tokenizers."""
    return (f"top_k={top_k}: the fast path compares the draft's tokens with the target's top-k, so it needs a shared "
            "tokenizer; this pair has two (use top_k=0)")
