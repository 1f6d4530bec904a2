"""`SemanticSpecDecoder`: step-level speculative decoding verified by semantic probes, and its baselines.

The draft writes a reasoning step; the target reads it in one forward pass over the new tokens
against its KV cache; a probe on the target's hidden states (``q``) and one on the draft's (``p``)
decide whether the step means what the target would have said (DESIGN.md "Decoding"):

1. the target writes the first step if ``target_first_step`` (the paper; by default the draft does);
2. **propose**: the draft writes a step, keeping what the draft probe reads;
3. **verify**: the target reads the step in one forward pass (new tokens only, KV cache kept);
4. **decide**: the method's :class:`~probes.decoding.policies.AcceptancePolicy` keeps or refuses
   it (SemanticSpec: the optional gated top-k fast path, then ``q >= tau`` or the paper's ratio
   rule ``min(1, ratio_scale * q / p)``);
5. **commit or roll back**: a kept step stays in both caches and the token the target predicts
   after it (the *bonus* token) opens the next step; a refused one is rolled back by length and the
   target writes the step (with token-level speculation from the draft, ``token_sd``, by default);
6. stop at EOS, a completed answer-marker line, the token budget or the context end.

Several prompts advance together, each with its own decisions (one :class:`~generation.cache.BatchedCache`
per model). Every baseline (target only, draft only, SpecReason-style judging, random and oracle
acceptance) runs through the same loop and the same sampler, so their timings compare; token-level
speculative decoding runs in transformers' own assisted generation and is compared with
transformers' own target-only generation (``method="hf_target_only"``).

Example:
    >>> dec = SemanticSpecDecoder(target, draft, tok, target_probe="ckpt/target", draft_probe="ckpt/draft")
    >>> results = dec.generate([problem + "\\n\\n"], max_new_tokens=256)
    >>> summarize(results)["step_acceptance"]
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence

import torch

from generation.cache import BatchedCache, context_length
from generation.sampling import sample_next
from generation.writer import StepDraft, write_steps
from probes.decoding import setup
from generation.handover import Handover
from probes.decoding.hf import decode_text, hf_generate, pad_id
from probes.decoding.policies import AcceptancePolicy, OraclePolicy, ProbePolicy, RandomPolicy, SpecReasonPolicy
from probes.decoding.results import DecodeResult, DecodeStats, StepTrace, summarize
from probes.decoding.rows import Row
from probes.decoding.setup import RULES
from probes.decoding.speculative import token_sd_steps
from probes.decoding.verify import verify

__all__ = ["METHODS", "RULES", "SemanticSpecDecoder", "DecodeResult", "DecodeStats", "StepTrace", "summarize"]

METHODS = (
    "semanticspec",
    "target_only",
    "draft_only",
    "token_sd",
    "hf_target_only",
    "specreason",
    "random_accept",
    "oracle_accept",
)
"""Methods :meth:`SemanticSpecDecoder.generate` runs; ``token_sd``/``hf_target_only`` run in transformers' loop."""
SPECREASON_SUFFIX = "\nScore 0-9:"
"""Judge turn appended after a draft step for SpecReason-style scoring (SpecReason asks for a 0-9 score)."""

ProbeLike = str | os.PathLike | torch.nn.Module | None


class SemanticSpecDecoder:
    """Step-level speculative decoding with semantic probes (SemanticSpec), plus baselines.

    Args:
        target: the large transformers causal LM (eval mode, any device).
        draft: the small causal LM (any device, may differ from the target's).
        tokenizer: the target's tokenizer (``tokenizer(prompt)`` adds BOS as the model expects).
        draft_tokenizer: the draft's tokenizer; None = shares ``tokenizer``. Another hands steps over as text.
        target_probe: exported probe directory (loaded with ``probes.export.load_probe`` so its
            fingerprint is checked against ``target``), a ``SemanticProbe``, or None.
        draft_probe: same for the draft (needed by the ratio rule).
        rule: ``threshold`` (default: accept when ``q >= tau``) or ``ratio`` (the paper's: accept
            with probability ``min(1, ratio_scale * q / p)``). On the embedded world the ratio rule
            keeps 2-5x more wrong draft steps than the threshold at the same acceptance (the draft
            probe's p is small on the draft's own rare wrong steps, so q/p stays large; issue 9).
        tau: threshold of the threshold rule.
        ratio_scale: multiplies ``q / p`` in the ratio rule (>1 accepts more; a speed knob).
        top_k: fast path: keep a step without the probe when every draft token is in the target's
            top-k and passes ``fast_path_min_logprob``; 0 (default) disables it. The paper's plain
            top-2 test kept 56% of the wrong steps SemanticSpec accepted (issue 9), so it is gated.
            Needs a shared tokenizer (refused otherwise).
        fast_path_min_logprob: fast path: every draft token's log-probability under the target must
            be at least this (default log 0.5: the target itself would write it more often than not).
        target_first_step: the target writes the first step (the paper); off by default, as
            ``benchmarks/first_step.py`` backs (README "Who writes the first step").
        delimiters: step delimiters. None (default) = the ones the probes' labels were cut at
            (``config.delimiters``), else the blank-line family. A probe is used on the steps it was
            trained on: a value that differs from a probe's is refused, naming both.
        max_step_tokens: a step that reaches no delimiter is cut here. None (default) = the probes'
            label cap (``config.labels["max_step_tokens"]``), else 64; a differing value is refused.
        answer_marker: stop once a line starting at this marker is complete (e.g. ``"Answer:"``).
        token_sd: the target writes its steps (first and rejected) with token-level speculative
            sampling from the same draft; lossless for those steps. None (default) = on when the
            models share a tokenizer (``benchmarks/first_step.py``); True with two is refused.
        bonus_token: on accept, the token the target predicts after the step opens the next step.
        specreason_suffix: judge turn of the SpecReason baseline.
        specreason_threshold: SpecReason keeps a step whose score is at least this.
        token_sd_tokens: draft tokens proposed per target pass when ``token_sd``.
        lazy_p: ratio rule: skip ``p`` when ``q`` alone accepts (same decisions from the same coin,
            less probe time); such steps then have ``p=None`` in the trace. The default computes
            ``p`` for every judged step, which diagnostics (acceptance against ``q/p``) need.

    Raises:
        ValueError: bad rule or numbers, or a probe exported for another model (naming the fields).
    """

    def __init__(
        self,
        target,
        draft,
        tokenizer,
        draft_tokenizer=None,
        target_probe: ProbeLike = None,
        draft_probe: ProbeLike = None,
        rule: str = "threshold",
        tau: float = 0.5,
        ratio_scale: float = 1.0,
        top_k: int = 0,
        fast_path_min_logprob: float = math.log(0.5),
        target_first_step: bool = False,
        delimiters: Sequence[str] | None = None,
        max_step_tokens: int | None = None,
        answer_marker: str | None = None,
        token_sd: bool | None = None,
        bonus_token: bool = True,
        specreason_suffix: str = SPECREASON_SUFFIX,
        specreason_threshold: float = 7.0,
        token_sd_tokens: int = 4,
        lazy_p: bool = False,
    ):
        self.handover = Handover(tokenizer, draft_tokenizer)
        self.shared = self.handover.shared
        token_sd = self.shared if token_sd is None else token_sd
        setup.check_args(rule=rule, tau=tau, ratio_scale=ratio_scale, top_k=top_k, shared=self.shared,
                         fast_path_min_logprob=fast_path_min_logprob, token_sd=token_sd, token_sd_tokens=token_sd_tokens)
        self.target, self.draft = target.eval(), draft.eval()
        self.tokenizer, self.draft_tokenizer = tokenizer, self.handover.draft_tokenizer
        self.rule, self.tau, self.ratio_scale = rule, float(tau), float(ratio_scale)
        self.top_k = top_k
        self.fast_path_min_logprob = float(fast_path_min_logprob)
        self.target_first_step = target_first_step
        self.answer_marker = answer_marker
        self.bonus_token = bonus_token and self.shared
        self.specreason_suffix = specreason_suffix
        self.specreason_threshold = specreason_threshold
        self.token_sd, self.token_sd_tokens = token_sd, token_sd_tokens
        self.lazy_p = lazy_p
        self.target_probe = setup.load(target_probe, target, tokenizer)
        self.draft_probe = setup.load(draft_probe, draft, self.draft_tokenizer)
        self.step = setup.step_spec((self.target_probe, self.draft_probe), delimiters, max_step_tokens)
        self.delimiters, self.max_step_tokens = self.step.delimiters, self.step.max_step_tokens
        self._suffix_ids = self.tokenizer(specreason_suffix, add_special_tokens=False).input_ids
        self._spare = 1 + len(self._suffix_ids)  # room kept for a bonus token and SpecReason's judge turn
        self._digits = [self.tokenizer(f" {d}", add_special_tokens=False).input_ids[-1] for d in range(10)]
        self.sampling_spec = setup.sampling_spec((self.target_probe, self.draft_probe))
        """How the probes' labels were sampled: ``{"temperature": (0.6, "target probe"), ...}``."""
        self.target_stop = self.step.stopper(tokenizer)
        self.draft_stop = self.step.stopper(self.draft_tokenizer)

    # ------------------------------------------------------------------ public entry point

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[str],
        max_new_tokens: int = 256,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int = 0,
        method: str = "semanticspec",
        *,
        batch_size: int | None = None,
        accept_rate: float | None = None,
        oracle: Callable[[str, str], bool] | None = None,
        progress: bool = False,
    ) -> list[DecodeResult]:
        """Decode every prompt with ``method``.

        Args:
            prompts: prompt strings (tokenized with BOS, as ``tokenizer(prompt)`` does; a bare
                string is one prompt, as transformers tokenizers read it), or token ids already
                formatted (a chat template's, e.g. ``Task.prompt``): a list of ids with one tokenizer,
                a ``(target_ids, draft_ids)`` pair with two.
            max_new_tokens: output token budget per prompt.
            temperature: sampling temperature of both models; 0 is greedy. None (default) = the
                temperature the probes' labels were sampled at (``config.sampling``), else 0.6. A
                probe judges steps like the ones it was trained on, so for ``semanticspec`` a value
                that differs from the probes' is refused, naming both.
            top_p: nucleus mass of both models; None = the probes' (else 0.95), enforced likewise.
            seed: seeds sampling and acceptance coin flips.
            method: one of :data:`METHODS`.
            batch_size: prompts decoded together (default: all of them).
            accept_rate: acceptance probability of ``random_accept``.
            oracle: ``oracle(step_text, output_so_far) -> bool`` for ``oracle_accept``.
            progress: show a progress bar over batches.

        Returns:
            One :class:`DecodeResult` per prompt, in order; ``[]`` for no prompts.

        Raises:
            ValueError: unknown method, missing probe/rate/oracle, bad sampling numbers, or a
                prompt longer than a model's context (naming both lengths).
        """
        temperature, top_p = setup.resolve_sampling(self.sampling_spec, temperature, top_p,
                                                    enforce=method == "semanticspec")
        setup.check_generate(method, METHODS, max_new_tokens, temperature, top_p, accept_rate, oracle, batch_size,
                             has_target_probe=self.target_probe is not None,
                             needs_draft_probe=self.rule == "ratio" and self.draft_probe is None)
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)  # not one prompt per character
        if not prompts:
            return []
        ids_t, ids_d = zip(*(self.handover.prompt_ids(p) for p in prompts))
        for name, model, ids in (("target", self.target, ids_t), ("draft", self.draft, ids_d)):
            ctx = context_length(model)
            for i, row in enumerate(ids):
                if ctx is not None and len(row) >= ctx:
                    raise ValueError(
                        f"prompt {i} has {len(row)} tokens but the {name} model's context "
                        f"(max_position_embeddings) is {ctx}; shorten the prompt"
                    )
        bs = batch_size or len(prompts)
        gen = torch.Generator().manual_seed(seed)
        coins = torch.Generator().manual_seed(seed + 1)
        policy = self._policy(method, accept_rate, oracle, coins)
        sampling = {"temperature": temperature, "top_p": top_p, "generator": gen}
        results: list[DecodeResult] = []
        starts = range(0, len(prompts), bs)
        if progress:
            from tqdm.auto import tqdm

            starts = tqdm(starts, desc=method, unit="batch")
        for s in starts:
            chunk = slice(s, s + bs)
            if method in ("token_sd", "hf_target_only"):
                dtok = None if self.shared else self.draft_tokenizer
                results += [hf_generate(self.target, self.draft, self.tokenizer, dtok, t, method, max_new_tokens,
                                        temperature, top_p, seed + s + k) for k, t in enumerate(ids_t[chunk])]
            else:
                results += self._decode(ids_t[chunk], ids_d[chunk], method, max_new_tokens, sampling, policy)
        return results

    def _policy(self, method, accept_rate, oracle, coins) -> AcceptancePolicy | None:
        """The acceptance policy of a speculative method (None for the methods without a draft step)."""
        if method == "semanticspec":
            return ProbePolicy(self.target_probe, self.draft_probe, self.rule, self.tau, self.ratio_scale, self.lazy_p,
                               self.top_k, self.fast_path_min_logprob, coins)
        if method == "random_accept":
            return RandomPolicy(accept_rate, coins)
        if method == "oracle_accept":
            return OraclePolicy(oracle)
        if method == "specreason":
            return SpecReasonPolicy(self._suffix_ids, self._digits, self.specreason_threshold)
        return None

    # ------------------------------------------------------------------ the step loop

    def _decode(self, ids_t, ids_d, method, max_new_tokens, sampling, policy) -> list[DecodeResult]:
        B = len(ids_t)
        layers = lambda probe: probe.config.layer_ids if probe is not None else [-1]  # noqa: E731
        tgt = BatchedCache(self.target, B, pad_id(self.tokenizer), layers(self.target_probe))
        drf = BatchedCache(self.draft, B, pad_id(self.draft_tokenizer), layers(self.draft_probe))
        for i in range(B):
            tgt.seq[i], drf.seq[i] = list(ids_t[i]), list(ids_d[i])
        rows = [Row(max_new_tokens, self.shared, self.answer_marker) for _ in range(B)]
        t_start = time.perf_counter()
        using = {"target_only": (tgt,), "draft_only": (drf,)}.get(method, (tgt, drf))
        while True:
            active = [i for i in range(B) if not rows[i].done and rows[i].limit(i, self._spare, *using) > 0]
            for i in range(B):
                if not rows[i].done and i not in active:
                    rows[i].close(self.tokenizer)  # budget or context exhausted
            if not active:
                break
            if method == "target_only":
                self._target_steps(active, rows, tgt, drf, sampling, use_draft=False)
                continue
            if method == "draft_only":
                self._draft_only_steps(active, rows, drf, sampling)
                continue
            first = [i for i in active if self.target_first_step and rows[i].steps_written == 0]
            spec = [i for i in active if i not in first]
            rejected = self._speculate(spec, rows, tgt, drf, sampling, policy) if spec else []
            if first or rejected:
                t0 = time.perf_counter()
                self._target_steps(first + rejected, rows, tgt, drf, sampling, use_draft=True)
                dt = (time.perf_counter() - t0) / len(first + rejected)  # one batch; its time is shared per row
                for i in first:
                    rows[i].stats.first_step_s += dt
                for i in rejected:
                    rows[i].stats.rewrite_s += dt
        wall = time.perf_counter() - t_start
        out = []
        for i, r in enumerate(rows):
            r.stats.wall_s = wall / B
            r.stats.target_passes, r.stats.draft_passes = tgt.passes[i], drf.passes[i]
            text = self.tokenizer.decode(r.out, skip_special_tokens=True) if self.shared else r.text
            out.append(DecodeResult(text, r.trace, r.stats))
        return out

    def _speculate(self, rows_i, rows, tgt, drf, sampling, policy: AcceptancePolicy) -> list[int]:
        """Propose, verify, decide, then commit or roll back every row's step. Returns the refused rows."""
        t0 = time.perf_counter()
        drafts = self._propose(rows_i, rows, tgt, drf, sampling, policy)
        t_verify = time.perf_counter()
        verified, n_new, pre_logits, after = verify(tgt, self.handover, {i: rows[i].text for i in rows_i}, drafts, policy)
        t_fed = time.perf_counter()
        decisions = policy.decide(verified, drf) if verified else {}
        dt = (time.perf_counter() - t0) / len(rows_i)
        rejected, bonus_rows = [], []
        for i in rows_i:
            d, r, v = drafts[i], rows[i], verified.get(i)
            decision = decisions.get(i, "reject")  # a row the target read nothing of cannot be kept
            if policy.suffix:
                tgt.rollback(i, len(policy.suffix), last_logits=after.get(i))
            r.stats.draft_steps_proposed += 1
            r.stats.probe_s += policy.probe_s / len(rows_i)
            r.stats.draft_s += ((t_verify - t0) + policy.draft_s) / len(rows_i)
            r.stats.verify_s += (t_fed - t_verify) / len(rows_i)
            r.stats.drafted_tokens += len(d.tokens) - d.n_forced
            text = v.text if v else decode_text(self.draft_tokenizer, d.tokens)
            trace = StepTrace("draft", text, len(d.tokens), v and v.q, v and v.p, decision, dt, v and v.score)
            if decision == "reject":  # roll back by length: both models forget the step
                tgt.rollback(i, n_new[i], last_logits=pre_logits[i])
                drf.rollback(i, len(d.tokens) - d.n_forced, last_logits=d.logits[0] if d.logits else None)
                r.trace.append(trace)
                r.forced = list(d.tokens[: d.n_forced])
                rejected.append(i)
                continue
            r.stats.draft_steps_accepted += 1
            r.commit(trace, d.tokens, d.n_forced, self.draft_tokenizer.eos_token_id, True)
            if self.bonus_token and not r.done and r.limit(i, self._spare, tgt, drf) > 0:
                bonus_rows.append(i)
        if bonus_rows:  # the target's next token opens the next step
            logits = torch.stack([tgt.last_logits[i] for i in bonus_rows]).float()
            for i, t in zip(bonus_rows, sample_next(logits, **sampling).tolist()):
                r = rows[i]
                tgt.seq[i].append(t)
                drf.seq[i].append(t)
                r.out.append(t)
                r.stats.output_tokens += 1
                if t == self.tokenizer.eos_token_id:
                    r.done = True
                else:
                    r.forced = [t]
        return rejected

    def _propose(self, rows_i, rows, tgt, drf, sampling, policy) -> dict[int, StepDraft]:
        """The draft writes one step per row (opened by the target's bonus token, if any)."""
        limits = {i: rows[i].limit(i, self._spare, tgt, drf) + len(rows[i].forced) for i in rows_i}
        return write_steps(
            drf, rows_i, stop=self.draft_stop, limits=limits, forced={i: rows[i].forced for i in rows_i},
            collect_hidden=policy.draft_needs_hidden, record_logits=True,
            record_forced_logits=policy.draft_needs_logits, **sampling,
        )

    def _target_steps(self, rows_i, rows, tgt, drf, sampling, use_draft: bool) -> None:
        """The target writes one step for each row; the draft is handed the step."""
        t0 = time.perf_counter()
        using = (tgt, drf) if use_draft else (tgt,)
        limits = {i: rows[i].limit(i, self._spare, *using) + len(rows[i].forced) for i in rows_i}
        forced = {i: rows[i].forced for i in rows_i}
        token_sd = use_draft and self.token_sd
        if token_sd:
            steps = token_sd_steps(tgt, drf, rows_i, stop=self.target_stop, draft_stop=self.draft_stop, limits=limits,
                                   forced=forced, n_propose=self.token_sd_tokens, **sampling)
        else:
            steps = write_steps(tgt, rows_i, stop=self.target_stop, limits=limits, forced=forced, **sampling)
        dt = (time.perf_counter() - t0) / len(rows_i)
        for i in rows_i:
            st = steps[i]
            text = decode_text(self.tokenizer, st.tokens)
            if use_draft and not token_sd:  # the draft reads the target's step on its next forward
                drf.seq[i].extend(self.handover.to_draft(st.tokens[st.n_forced :], text))
            trace = StepTrace("target", text, len(st.tokens), decision="target", seconds=dt)
            rows[i].commit(trace, st.tokens, st.n_forced, self.tokenizer.eos_token_id, False)

    def _draft_only_steps(self, rows_i, rows, drf, sampling) -> None:
        t0 = time.perf_counter()
        limits = {i: rows[i].limit(i, self._spare, drf) for i in rows_i}
        steps = write_steps(drf, rows_i, stop=self.draft_stop, limits=limits, **sampling)
        dt = (time.perf_counter() - t0) / len(rows_i)
        for i in rows_i:
            st = steps[i]
            rows[i].stats.draft_steps_proposed += 1
            rows[i].stats.draft_steps_accepted += 1
            trace = StepTrace("draft", decode_text(self.draft_tokenizer, st.tokens), len(st.tokens),
                              decision="accept", seconds=dt)
            rows[i].commit(trace, st.tokens, 0, self.draft_tokenizer.eos_token_id, True)
