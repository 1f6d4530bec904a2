"""`SemanticSpecDecoder`: step-level speculative decoding verified by semantic probes, and its baselines.

The draft writes a reasoning step; the target reads it in one forward pass over the new tokens
against its KV cache; a probe on the target's hidden states (``q``) and one on the draft's (``p``)
decide whether the step means what the target would have said (docs/design.md "Decoding"):

1. the target writes the first step if ``target_first_step`` (the paper; by default the draft does);
2. **propose**: the :class:`~semanticspec.parts.Proposer` (the draft) writes a step, keeping
   what the draft probe reads;
3. **verify**: the :class:`~semanticspec.cache_parts.TargetVerifier` reads the step in one forward
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
from collections.abc import Iterator, Sequence

import torch

from generation.cache import BatchedCache, context_length
from generation.handover import Handover, decode_text, pad_id
from generation.sampling import Sampler, StreamKey, key_stream
from generation.specs import StepSpec
from generation.writer import StepWriter
from semanticspec.base import Plan, StepDecoder, load_probes, sampling_spec
from semanticspec.cache_parts import DraftProposer, JudgeTurn, TargetVerifier
from semanticspec.config import DecodeConfig
from semanticspec.hf import transformers_events
from semanticspec.loop import StepLoop
from semanticspec.meter import Meter
from semanticspec.policies import ProbePolicy, check_policy, default_policy, stored_tau
from semanticspec.prompts import read_prompts
from semanticspec.results import DecodeResult, DecodeStats, StepEvent, StepTrace, summarize
from semanticspec.rows import Row

__all__ = ["DecodeResult", "DecodeStats", "SemanticSpecDecoder", "StepTrace", "summarize"]

ProbeLike = str | os.PathLike | torch.nn.Module | None


class SemanticSpecDecoder(StepDecoder):
    """Step-level speculative decoding with semantic probes (SemanticSpec), plus baselines.

    Args:
        target: the large transformers causal LM (eval mode, any device).
        draft: the small causal LM (any device, may differ from the target's).
        tokenizer: the target's tokenizer (``tokenizer(prompt)`` adds BOS as the model expects).
        draft_tokenizer: the draft's tokenizer; None = shares ``tokenizer``. Another hands steps over as text.
        target_probe: exported probe directory (loaded with ``probes.export.load_probe`` so its
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
            ``answer_marker``): a decode ends once a newline follows its ``answer_marker``'s last occurrence. None
            (default): the config's ``answer_marker``, else none (a decode ends at EOS, the token budget or the
            context end). Its problems come from ``task.problems(n, seed)``
            and their prompts from ``decoder.prompts(problems)``; ``task.check`` scores the text.
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
            raise ValueError(f"invalid SemanticSpecDecoder arguments: top_k={self.policy.top_k}: the fast path "
                             "compares the draft's tokens with the target's top-k, so it needs a shared tokenizer; "
                             "this pair has two (use top_k=0)")
        self.target, self.draft = target.eval(), draft.eval()
        self.tokenizer, self.draft_tokenizer = tokenizer, self.handover.draft_tokenizer
        self.target_probe, self.draft_probe = load_probes((target_probe, draft_probe), (target, draft),
                                                          (tokenizer, self.draft_tokenizer), probe_dtype)
        self.step = self._checked_default()
        self._digits = [self.tokenizer(f" {d}", add_special_tokens=False).input_ids[-1] for d in range(10)]
        self._judges: dict[str, JudgeTurn] = {}  # per judge_suffix
        self._recorded_sampling = sampling_spec((self.target_probe, self.draft_probe))
        self._stoppers: dict = {}

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
        if (cfg.lookahead or 1) > 1 and not self.shared:
            problems.append(f"lookahead={cfg.lookahead}: the target reads a window of the draft's steps in its own "
                            "tokens, which needs one tokenizer; this pair has two (use lookahead=1)")
        return problems

    def _inputs(self, prompts, cfg: DecodeConfig, method) -> tuple[list, list]:
        """The target's and the draft's ids of each prompt."""
        return read_prompts(prompts, self.handover, self.target, self.draft)

    def transformers_events(self, plan: Plan, batch: tuple, keys) -> Iterator[StepEvent]:
        return transformers_events(plan.method, self.target, self.draft, self.tokenizer,
                                   None if self.shared else self.draft_tokenizer, batch, plan.cfg.max_new_tokens,
                                   plan.sampling, keys, plan.loop.answer_marker)

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
        proposer = DraftProposer(StepWriter(drf, draft_stop, sampler), self.draft_tokenizer, self.draft_probe,
                                 self.handover, plan.spare)
        verifier = TargetVerifier(StepWriter(tgt, target_stop, sampler), self.tokenizer, self.handover,
                                  self.target_probe, self.judge(plan.cfg.judge_suffix), streams["coins"], plan.spare)
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
