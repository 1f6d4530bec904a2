"""`SemanticSpecDecoder`: step-level speculative decoding verified by semantic probes, and its baselines.

The draft writes a reasoning step; the target reads it in one forward pass over the new tokens
against its KV cache; a probe on the target's hidden states (``q``) and one on the draft's (``p``)
decide whether the step means what the target would have said (DESIGN.md "Decoding"):

1. the target writes the first step (``target_first_step``);
2. the draft writes a step, keeping the hidden states of its tokens for ``p``;
3. the target reads the step in one forward pass (new tokens only, KV cache kept);
4. fast path (off by default; shared tokenizer only): every draft token is in the target's top-k
   *and* has target log-probability >= ``fast_path_min_logprob`` -> keep without the probe;
5. else keep when ``q >= tau`` (threshold rule, default) or with probability
   ``min(1, ratio_scale * q / p)`` (the paper's ratio rule);
6. keep: the target's cache stays and the token it predicts after the step (the *bonus* token)
   opens the next step; refuse: the target's cache is rolled back and the target writes the step
   (optionally with token-level speculation, ``token_sd=True``);
7. stop at EOS, a completed answer-marker line, the token budget or the context end.

Several prompts advance together, each with its own decisions (one :class:`~generation.cache.BatchedCache` per model).
Every baseline (target only, draft only, SpecReason-style judging, random and oracle acceptance)
runs through the same loop and the same sampler, so their timings compare; token-level
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
from dataclasses import asdict, dataclass, field

import torch

from generation.sampling import sample_next, top_p_filter
from generation.steps import DEFAULT_DELIMITERS, StepStopper
from probes import metrics
from generation.features import FeatureSpec, probe_input, rows_features, token_scores
from generation.groups import FEATURE_GROUPS, TOKEN_STATS, require_features
from generation.cache import BatchedCache
from generation.writer import StepDraft, write_steps

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
RULES = ("ratio", "threshold")
SPECREASON_SUFFIX = "\nScore 0-9:"
"""Judge turn appended after a draft step for SpecReason-style scoring (SpecReason asks for a 0-9 score)."""

ProbeLike = str | os.PathLike | torch.nn.Module | None


@dataclass
class StepTrace:
    """One step of a decode.

    Attributes:
        writer: ``"target"`` or ``"draft"``.
        text: the step's text (special tokens dropped).
        n_tokens: tokens in the step, in the writer's tokenizer (a target bonus token included).
        q: target probe's semantic probability (None when not computed, e.g. fast path).
        p: draft probe's semantic probability (None when not computed).
        decision: ``accept_fast`` (top-k fast path), ``accept``, ``reject`` (a draft step thrown
            away; the next trace entry is the target's step) or ``target`` (target-written).
        seconds: wall time of the phases that produced and judged this step (shared evenly by the
            rows of a batch).
        score: SpecReason judge score 0-9 (only for ``method="specreason"``).
    """

    writer: str
    text: str
    n_tokens: int
    q: float | None = None
    p: float | None = None
    decision: str = "target"
    seconds: float = 0.0
    score: float | None = None


@dataclass
class DecodeStats:
    """Counters of one prompt's decode (DESIGN.md "Definitions").

    ``wall_s`` and the phase times (``*_s``) of a batch are shared evenly by its rows, so sums over
    results give totals. ``steps`` counts committed steps (rejected proposals not included). Phases of
    the speculative loop: the target's first step (``first_step_s``), drafting (``draft_s``), the
    target's verification forward (``verify_s``), probes (``probe_s``) and the target rewriting
    refused steps (``rewrite_s``); the rest of ``wall_s`` is bookkeeping. Methods without a draft
    count only ``wall_s``.
    """

    wall_s: float = 0.0
    output_tokens: int = 0
    draft_tokens: int = 0
    steps: int = 0
    draft_steps_proposed: int = 0
    draft_steps_accepted: int = 0
    target_passes: int = 0
    draft_passes: int = 0
    probe_s: float = 0.0
    first_step_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    rewrite_s: float = 0.0
    drafted_tokens: int = 0
    """Tokens the draft wrote, kept or not (the bonus tokens that open steps excluded)."""


@dataclass
class DecodeResult:
    """Output of one prompt: the generated text (prompt excluded), the step trace and counters."""

    text: str
    steps: list[StepTrace] = field(default_factory=list)
    stats: DecodeStats = field(default_factory=DecodeStats)

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(results: Sequence[DecodeResult]) -> dict[str, float]:
    """Aggregate figures over prompts, named as in DESIGN.md "Definitions".

    Returns:
        ``step_acceptance``, ``draft_token_share``, ``target_passes_per_100_tokens``,
        ``probe_overhead``, ``wall_s``, ``output_tokens``, ``tokens_per_s``, ``n_prompts``, ``steps``,
        ``draft_steps_proposed``, ``draft_steps_accepted``, ``target_passes``, ``draft_passes``, ``probe_s``.
    """
    s = [r.stats for r in results]
    tot = {k: sum(getattr(x, k) for x in s) for k in DecodeStats.__dataclass_fields__}
    return {
        "step_acceptance": float(metrics.step_acceptance(tot["draft_steps_accepted"], tot["draft_steps_proposed"])),
        "draft_token_share": float(metrics.draft_token_share(tot["draft_tokens"], tot["output_tokens"])),
        "target_passes_per_100_tokens": float(
            metrics.target_passes_per_100_tokens(tot["target_passes"], tot["output_tokens"])
        ),
        "probe_overhead": float(metrics.probe_overhead(tot["probe_s"], tot["wall_s"])),
        "tokens_per_s": tot["output_tokens"] / tot["wall_s"] if tot["wall_s"] > 0 else 0.0,
        "n_prompts": len(results),
        **tot,
    }


def _context_length(model) -> int | None:
    cfg = model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return getattr(cfg, "max_position_embeddings", None)


def _device(model) -> torch.device:
    return next(model.parameters()).device


class _Row:
    """Decode state of one prompt."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.out: list[int] = []  # output tokens (shared tokenizer)
        self.pieces: list[str] = []  # output text per committed step
        self.trace: list[StepTrace] = []
        self.stats = DecodeStats()
        self.done = False
        self.forced: list[int] = []  # target bonus token opening the next step
        self.steps_written = 0

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class SemanticSpecDecoder:
    """Step-level speculative decoding with semantic probes (SemanticSpec), plus baselines.

    Args:
        target: the large transformers causal LM (eval mode, any device).
        draft: the small causal LM (any device, may differ from the target's).
        tokenizer: the target's tokenizer (``tokenizer(prompt)`` adds BOS as the model expects).
        draft_tokenizer: the draft's tokenizer; None means the draft shares ``tokenizer``. A
            different tokenizer hands steps over as text and turns the fast path off.
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
        target_first_step: the target writes the first step.
        delimiters: step delimiters. None (default) = the ones the probes' labels were cut at
            (``config.delimiters``), else the blank-line family. A probe is used on the steps it was
            trained on: a value that differs from a probe's is refused, naming both.
        max_step_tokens: a step that reaches no delimiter is cut here. None (default) = the probes'
            label cap (``config.labels["max_step_tokens"]``), else 64; a differing value is refused.
        answer_marker: stop once a line starting at this marker is complete (e.g. ``"Answer:"``).
        token_sd: the target writes its steps (first and rejected) with token-level speculative
            sampling from the same draft (shared tokenizer only); lossless for those steps.
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
        target_first_step: bool = True,
        delimiters: Sequence[str] | None = None,
        max_step_tokens: int | None = None,
        answer_marker: str | None = None,
        token_sd: bool = False,
        bonus_token: bool = True,
        specreason_suffix: str = SPECREASON_SUFFIX,
        specreason_threshold: float = 7.0,
        token_sd_tokens: int = 4,
        lazy_p: bool = False,
    ):
        errors = []
        if rule not in RULES:
            errors.append(f"rule={rule!r}: expected one of {RULES}")
        if not 0 <= tau <= 1:
            errors.append(f"tau={tau}: expected 0 <= tau <= 1")
        if ratio_scale <= 0:
            errors.append(f"ratio_scale={ratio_scale}: expected > 0")
        if top_k < 0:
            errors.append(f"top_k={top_k}: expected >= 0 (0 disables the fast path)")
        if top_k and draft_tokenizer is not None and draft_tokenizer is not tokenizer:
            errors.append(f"top_k={top_k}: the fast path compares the draft's tokens with the target's top-k, "
                          "so it needs a shared tokenizer; this pair has two (use top_k=0)")
        if not fast_path_min_logprob <= 0:
            errors.append(f"fast_path_min_logprob={fast_path_min_logprob}: expected a log-probability <= 0")
        if max_step_tokens is not None and max_step_tokens < 1:
            errors.append(f"max_step_tokens={max_step_tokens}: expected >= 1")
        if delimiters is not None and (isinstance(delimiters, str) or not delimiters or not all(delimiters)):
            errors.append(f"delimiters={delimiters!r}: expected a non-empty list of non-empty strings")
        if token_sd and draft_tokenizer is not None and draft_tokenizer is not tokenizer:
            errors.append("token_sd=True (token-level speculation inside target steps) needs a shared tokenizer")
        if token_sd_tokens < 1:
            errors.append(f"token_sd_tokens={token_sd_tokens}: expected >= 1")
        if errors:
            raise ValueError("invalid SemanticSpecDecoder arguments: " + "; ".join(errors))
        self.target, self.draft = target.eval(), draft.eval()
        self.tokenizer = tokenizer
        self.shared = draft_tokenizer is None or draft_tokenizer is tokenizer
        self.draft_tokenizer = tokenizer if draft_tokenizer is None else draft_tokenizer
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
        self.target_probe = self._probe(target_probe, target, tokenizer)
        self.draft_probe = self._probe(draft_probe, draft, self.draft_tokenizer)
        self._check_features(self.target_probe)
        self._check_features(self.draft_probe)
        self.delimiters, self.max_step_tokens = self._step_spec(delimiters, max_step_tokens)
        self._suffix_ids = self.tokenizer(specreason_suffix, add_special_tokens=False).input_ids
        self.target_stop = StepStopper(tokenizer, self.delimiters, self.max_step_tokens)
        self.draft_stop = StepStopper(self.draft_tokenizer, self.delimiters, self.max_step_tokens)

    def _step_spec(self, delimiters, max_step_tokens) -> tuple[tuple[str, ...], int]:
        """The step definition: what the probes' labels were cut at, unless given; a conflict is refused.

        Raises:
            ValueError: the two probes were trained on different steps, or an argument differs from
                a probe's (naming both values).
        """
        recorded: dict[str, tuple[object, str]] = {}
        problems = []
        for probe in (self.target_probe, self.draft_probe):
            if probe is None:
                continue
            c = probe.config
            for key, value in (("delimiters", tuple(c.delimiters)), ("max_step_tokens", c.labels.get("max_step_tokens"))):
                if value is None:
                    continue
                if key in recorded and recorded[key][0] != value:
                    problems.append(f"the {recorded[key][1]} has {key}={recorded[key][0]!r}, the {c.role} probe {value!r}")
                recorded.setdefault(key, (value, f"{c.role} probe"))
        given = {"delimiters": None if delimiters is None else tuple(delimiters), "max_step_tokens": max_step_tokens}
        for key, value in given.items():
            if value is not None and key in recorded and recorded[key][0] != value:
                problems.append(f"{key}={value!r} but the {recorded[key][1]} was trained on steps with {key}="
                                f"{recorded[key][0]!r} (leave {key} unset to use the probe's)")
        if problems:
            raise ValueError("a probe is used on the steps it was trained on: " + "; ".join(problems))
        resolved = {k: v if v is not None else recorded.get(k, (None,))[0] for k, v in given.items()}
        return tuple(resolved["delimiters"] or DEFAULT_DELIMITERS), int(resolved["max_step_tokens"] or 64)

    @staticmethod
    def _probe(probe: ProbeLike, model, tokenizer):
        if probe is None:
            return None
        if isinstance(probe, (str, os.PathLike)):
            from probes.export import load_probe

            return load_probe(probe, model, tokenizer, device=str(_device(model)))
        if not isinstance(probe, torch.nn.Module) or not hasattr(probe, "config"):
            raise TypeError(f"probe must be a path, a SemanticProbe or None, got {type(probe).__name__}")
        from probes.export import check_probe_matches

        # The same fingerprint check as load_probe: width, and model/tokenizer when the probe records them.
        check_probe_matches(probe.config, model, tokenizer, where=f"{probe.config.role} probe")
        return probe.to(_device(model)).eval()

    @staticmethod
    def _check_features(probe) -> None:
        """Refuse a probe reading features this decoder cannot compute, naming both lists."""
        if probe is not None:
            c = probe.config
            require_features(c.feature_groups, c.token_stats, FEATURE_GROUPS, TOKEN_STATS,
                             where=f"{c.role} probe", provider="SemanticSpecDecoder")

    # ------------------------------------------------------------------ public entry point

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[str],
        max_new_tokens: int = 256,
        temperature: float = 0.6,
        top_p: float = 0.95,
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
            prompts: prompt strings (tokenized with BOS, as ``tokenizer(prompt)`` does); a bare
                string is one prompt, as transformers tokenizers read it.
            max_new_tokens: output token budget per prompt.
            temperature: sampling temperature of both models; 0 is greedy.
            top_p: nucleus mass of both models.
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
        self._check(method, max_new_tokens, temperature, top_p, accept_rate, oracle, batch_size)
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)  # not one prompt per character
        if not prompts:
            return []
        ids_t = [self.tokenizer(p).input_ids for p in prompts]
        ids_d = ids_t if self.shared else [self.draft_tokenizer(p).input_ids for p in prompts]
        for name, model, ids in (("target", self.target, ids_t), ("draft", self.draft, ids_d)):
            ctx = _context_length(model)
            for i, row in enumerate(ids):
                if ctx is not None and len(row) >= ctx:
                    raise ValueError(
                        f"prompt {i} has {len(row)} tokens but the {name} model's context "
                        f"(max_position_embeddings) is {ctx}; shorten the prompt"
                    )
        bs = batch_size or len(prompts)
        gen = torch.Generator().manual_seed(seed)
        coins = torch.Generator().manual_seed(seed + 1)
        results: list[DecodeResult] = []
        starts = range(0, len(prompts), bs)
        if progress:
            from tqdm.auto import tqdm

            starts = tqdm(starts, desc=method, unit="batch")
        for s in starts:
            chunk = slice(s, s + bs)
            if method in ("token_sd", "hf_target_only"):
                results += [
                    self._hf_generate(t, method, max_new_tokens, temperature, top_p, seed + s + k)
                    for k, t in enumerate(ids_t[chunk])
                ]
            else:
                results += self._decode(
                    ids_t[chunk],
                    ids_d[chunk],
                    method,
                    max_new_tokens,
                    temperature,
                    top_p,
                    gen,
                    coins,
                    accept_rate,
                    oracle,
                )
        return results

    def _check(self, method, max_new_tokens, temperature, top_p, accept_rate, oracle, batch_size=None) -> None:
        errors = []
        if method not in METHODS:
            errors.append(f"method={method!r}: expected one of {METHODS}")
        if max_new_tokens < 1:
            errors.append(f"max_new_tokens={max_new_tokens}: expected >= 1")
        if not (math.isfinite(temperature) and temperature >= 0):  # nan would reach torch's sampler
            errors.append(f"temperature={temperature}: expected a finite number >= 0 (0 = greedy)")
        if not 0 < top_p <= 1:
            errors.append(f"top_p={top_p}: expected in (0, 1]")
        if batch_size is not None and batch_size < 1:  # 0 would silently mean "all prompts"
            errors.append(f"batch_size={batch_size}: expected >= 1, or None for all prompts at once")
        if method == "semanticspec":
            if self.target_probe is None:
                errors.append("method='semanticspec' needs target_probe (an exported probe directory)")
            if self.rule == "ratio" and self.draft_probe is None:
                errors.append("rule='ratio' needs draft_probe for p; give one or use rule='threshold'")
        if method == "random_accept" and (accept_rate is None or not 0 <= accept_rate <= 1):
            errors.append(f"method='random_accept' needs accept_rate in [0, 1], got {accept_rate}")
        if method == "oracle_accept" and not callable(oracle):
            errors.append("method='oracle_accept' needs oracle=callable(step_text, output_so_far) -> bool")
        if errors:
            raise ValueError("; ".join(errors))

    # ------------------------------------------------------------------ the step loop

    def _decode(
        self, ids_t, ids_d, method, max_new_tokens, temperature, top_p, gen, coins, accept_rate, oracle
    ) -> list[DecodeResult]:
        B = len(ids_t)
        tprobe, dprobe = self.target_probe, self.draft_probe
        tgt = BatchedCache(
            self.target, B, self._pad(self.tokenizer), tprobe.config.layer_ids if tprobe is not None else [-1]
        )
        drf = BatchedCache(
            self.draft, B, self._pad(self.draft_tokenizer), dprobe.config.layer_ids if dprobe is not None else [-1]
        )
        for i in range(B):
            tgt.seq[i], drf.seq[i] = list(ids_t[i]), list(ids_d[i])
        rows = [_Row(max_new_tokens) for _ in range(B)]
        sampling = {"temperature": temperature, "top_p": top_p, "generator": gen}
        t_start = time.perf_counter()
        while True:
            using = {"target_only": (tgt,), "draft_only": (drf,)}.get(method, (tgt, drf))
            active = [i for i in range(B) if not rows[i].done and self._limit(rows[i], i, *using) > 0]
            for i in range(B):
                if not rows[i].done and i not in active:
                    self._close(rows[i])  # budget or context exhausted
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
            rejected: list[int] = []
            if spec:
                rejected = self._speculate(spec, rows, tgt, drf, method, sampling, coins, accept_rate, oracle)
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

    def _close(self, r: _Row) -> None:
        """Finish a row; a bonus token still waiting for its step becomes a last one-token step."""
        r.done = True
        if r.forced:
            text = self._text(self.tokenizer, r.forced)
            r.trace.append(StepTrace("target", text, len(r.forced), decision="target"))
            r.pieces.append(text)
            r.stats.steps += 1
            r.forced = []

    @staticmethod
    def _pad(tok) -> int:
        return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)

    def _limit(self, row: _Row, i: int, *runs: BatchedCache) -> int:
        """Tokens the next step may hold: budget left and room in the models' contexts.

        One position stays spare for a bonus token, plus the judge turn's length for SpecReason.
        """
        left = row.budget - row.stats.output_tokens
        spare = 1 + len(self._suffix_ids)
        for run in runs:
            if run.context is not None:
                left = min(left, run.context - len(run.seq[i]) - spare)
        return left

    def _commit(
        self, r: _Row, trace: StepTrace, tokens: list[int], n_forced: int, eos_id: int | None, by_draft: bool
    ) -> None:
        """Add a kept step to the output and decide whether the row is finished."""
        r.trace.append(trace)
        r.steps_written += 1
        r.stats.steps += 1
        r.stats.output_tokens += len(tokens) - n_forced
        if by_draft:
            r.stats.draft_tokens += len(tokens) - n_forced
        if self.shared:
            r.out.extend(tokens[n_forced:])
        r.pieces.append(trace.text)
        r.forced = []
        if eos_id is not None and eos_id in tokens:
            r.done = True
        elif self.answer_marker:
            text = r.text
            k = text.rfind(self.answer_marker)
            if k >= 0 and "\n" in text[k:]:
                r.done = True

    def _text(self, tok, tokens: Sequence[int]) -> str:
        eos = tok.eos_token_id
        if eos is not None and eos in tokens:
            tokens = tokens[: list(tokens).index(eos)]
        return tok.decode(list(tokens), skip_special_tokens=True)

    def _target_steps(self, rows_i, rows, tgt, drf, sampling, use_draft: bool) -> None:
        """The target writes one step for each row; the draft is handed the step."""
        t0 = time.perf_counter()
        using = (tgt, drf) if use_draft else (tgt,)
        limits = {i: self._limit(rows[i], i, *using) + len(rows[i].forced) for i in rows_i}
        forced = {i: rows[i].forced for i in rows_i}
        token_sd = use_draft and self.token_sd
        if token_sd:
            steps = self._token_sd_steps(rows_i, tgt, drf, limits, forced, sampling)
        else:
            steps = write_steps(tgt, rows_i, stop=self.target_stop, limits=limits, forced=forced, **sampling)
        dt = (time.perf_counter() - t0) / len(rows_i)
        for i in rows_i:
            st, r = steps[i], rows[i]
            text = self._text(self.tokenizer, st.tokens)
            new = st.tokens[st.n_forced :]
            if use_draft and not token_sd:  # the draft reads the target's step on its next forward
                drf.seq[i].extend(
                    new if self.shared else self.draft_tokenizer(text, add_special_tokens=False).input_ids
                )
            self._commit(
                r,
                StepTrace("target", text, len(st.tokens), decision="target", seconds=dt),
                st.tokens,
                st.n_forced,
                self.tokenizer.eos_token_id,
                False,
            )

    def _token_sd_steps(self, rows_i, tgt, drf, limits, forced, sampling) -> dict[int, StepDraft]:
        """The target writes one step per row with token-level speculative sampling (Leviathan et al., 2023).

        The draft proposes up to ``token_sd_tokens`` tokens, the target scores them in one forward,
        each is kept with probability ``min(1, p_target / p_draft)``; the first refused one is
        replaced by a draw from the residual ``max(0, p_target - p_draft)``, and when all are kept
        the target adds one more. The step is therefore distributed as the target's own. Both
        caches end holding the step (its last token pending).
        """
        temperature, top_p, gen = sampling["temperature"], sampling["top_p"], sampling["generator"]
        steps = {i: StepDraft(len(tgt.seq[i]) - len(forced[i]), list(forced[i]), len(forced[i])) for i in rows_i}

        def finished(i: int) -> bool:
            toks = steps[i].tokens
            return bool(toks) and (self.target_stop(toks) or len(toks) >= limits[i])

        writing = [i for i in rows_i if not finished(i)]
        while writing:
            lim = {i: min(len(steps[i].tokens) + self.token_sd_tokens, limits[i]) for i in writing}
            props = write_steps(
                drf,
                writing,
                stop=self.draft_stop,
                limits=lim,
                record_logits=True,
                forced={i: steps[i].tokens for i in writing},
                **sampling,
            )
            before = {i: tgt.last_logits[i] for i in writing}
            n0 = {i: len(tgt.seq[i]) for i in writing}
            for i in writing:
                tgt.seq[i].extend(props[i].tokens[props[i].n_forced :])
            fed = tgt.feed(writing, all_logits=True)
            for i in writing:
                d, f = props[i], fed.get(i)
                proposal = d.tokens[d.n_forced :]

                def t_logits(j: int, i=i, f=f, n0=n0, before=before):  # target logits predicting proposal token j
                    k = n0[i] + j - 1 - f.start
                    return f.logits[k] if k >= 0 else before[i]

                kept, extra = 0, None
                for j, x in enumerate(proposal):
                    pt, pd = self._probs(t_logits(j), temperature, top_p), self._probs(d.logits[j], temperature, top_p)
                    if float(torch.rand((), generator=gen)) * float(pd[x]) <= float(pt[x]) and float(pt[x]) > 0:
                        kept += 1
                        steps[i].tokens.append(x)
                        if finished(i):
                            break
                        continue
                    residual = (pt - pd).clamp(min=0)
                    residual = residual if float(residual.sum()) > 0 else pt
                    extra = int(torch.multinomial(residual, 1, generator=gen))
                    break
                if extra is None and not finished(i):  # all kept: the target adds one more token
                    extra = int(sample_next(t_logits(len(proposal))[None].float().cpu(), temperature, top_p, gen)[0])
                drop = len(proposal) - kept
                tgt.rollback(i, drop, last_logits=t_logits(kept) if drop else tgt.last_logits[i])
                drf.rollback(i, drop, last_logits=d.logits[kept] if drop else None)
                if extra is not None:
                    steps[i].tokens.append(extra)
                    tgt.seq[i].append(extra)
                    drf.seq[i].append(extra)
            writing = [i for i in writing if not finished(i)]
        return steps

    @staticmethod
    def _probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
        """The distribution :func:`~generation.sampling.sample_next` draws from, as (V,) probabilities."""
        logits = logits.float().cpu()
        if temperature == 0:
            return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).float()
        probs = top_p_filter(torch.softmax(logits / temperature, dim=-1)[None], top_p)[0]
        return probs / probs.sum()

    def _draft_only_steps(self, rows_i, rows, drf, sampling) -> None:
        t0 = time.perf_counter()
        limits = {i: self._limit(rows[i], i, drf) for i in rows_i}
        steps = write_steps(drf, rows_i, stop=self.draft_stop, limits=limits, **sampling)
        dt = (time.perf_counter() - t0) / len(rows_i)
        for i in rows_i:
            st = steps[i]
            text = self._text(self.draft_tokenizer, st.tokens)
            rows[i].stats.draft_steps_proposed += 1
            rows[i].stats.draft_steps_accepted += 1
            self._commit(
                rows[i],
                StepTrace("draft", text, len(st.tokens), decision="accept", seconds=dt),
                st.tokens,
                0,
                self.draft_tokenizer.eos_token_id,
                True,
            )

    def _speculate(self, rows_i, rows, tgt, drf, method, sampling, coins, accept_rate, oracle) -> list[int]:
        """Draft a step per row, let the target read it, decide, keep or roll back. Returns rejected rows."""
        t0 = time.perf_counter()
        need_q = method == "semanticspec"
        need_p = need_q and self.rule == "ratio"
        tspec = FeatureSpec.of(self.target_probe.config) if need_q else None
        dspec = FeatureSpec.of(self.draft_probe.config) if need_p else None
        limits = {i: self._limit(rows[i], i, tgt, drf) + len(rows[i].forced) for i in rows_i}
        forced = {i: rows[i].forced for i in rows_i}
        t_draft = time.perf_counter()
        drafts = write_steps(
            drf,
            rows_i,
            stop=self.draft_stop,
            limits=limits,
            forced=forced,
            collect_hidden=need_p and dspec.needs_hidden,
            record_logits=True,
            record_forced_logits=need_p and dspec.needs_logits,
            **sampling,
        )
        t_verify = time.perf_counter()
        # The target reads every row's step (plus the judge turn for SpecReason) in one forward.
        suffix = list(self._suffix_ids) if method == "specreason" else []
        texts, t_start, n_new, pre_logits = {}, {}, {}, {}
        for i in rows_i:
            d = drafts[i]
            texts[i] = self._text(self.draft_tokenizer, d.tokens)
            new = (
                d.tokens[d.n_forced :] if self.shared else self.tokenizer(texts[i], add_special_tokens=False).input_ids
            )
            t_start[i] = len(tgt.seq[i]) - (d.n_forced if self.shared else 0)
            n_new[i] = len(new)
            pre_logits[i] = tgt.last_logits[i]
            tgt.seq[i].extend(new + suffix)
        fed = tgt.feed(rows_i, hidden=need_q and tspec.needs_hidden, all_logits=True)
        t_fed = time.perf_counter()
        probe_s = draft_feed_s = 0.0
        decisions, q, p, scores = {}, {}, {}, {}
        after, step_logits = {}, {}
        for i in rows_i:
            f = fed.get(i)
            if f is None:  # empty step (cannot happen with max_step_tokens >= 1) - treat as rejected
                decisions[i] = "reject"
                continue
            off = t_start[i] - f.start  # index of the step's first token among the fed tokens
            end = len(tgt.seq[i]) - len(suffix) - f.start  # one past the step's last token

            def predictor(j: int, f=f, i=i):  # logits that predicted fed token j
                return f.logits[j - 1] if j >= 1 else pre_logits[i]

            if need_q:  # (k, V) the target's logits predicting every step token (fed tokens off..end-1)
                step_logits[i] = (f.logits[off - 1 : end - 1] if off >= 1
                                  else torch.cat([pre_logits[i][None], f.logits[: end - 1]]))
            pre_logits[i] = predictor(off + drafts[i].n_forced) if n_new[i] else None
            after[i] = f.logits[end - 1]
            if method == "specreason":
                scores[i] = self._judge_score(f.logits[-1])
                decisions[i] = "accept" if scores[i] >= self.specreason_threshold else "reject"
            elif method == "random_accept":
                decisions[i] = "accept" if float(torch.rand((), generator=coins)) < accept_rate else "reject"
            elif method == "oracle_accept":
                decisions[i] = "accept" if oracle(texts[i], rows[i].text) else "reject"
            elif self.top_k and self._fast_path(
                step_logits[i][drafts[i].n_forced :], tgt.seq[i][t_start[i] + drafts[i].n_forced : f.start + end]
            ):
                decisions[i] = "accept_fast"
        slow = [i for i in rows_i if i not in decisions] if need_q else []
        if slow:
            probe_s, draft_feed_s = self._probe_decisions(slow, fed, t_start, tgt, drf, drafts, coins, decisions, q, p,
                                                          step_logits)
        # Keep or roll back, then the target's bonus token opens the next step.
        rejected, bonus_rows = [], []
        dt = (time.perf_counter() - t0) / len(rows_i)
        for i in rows_i:
            d, r = drafts[i], rows[i]
            if suffix:
                tgt.rollback(i, len(suffix), last_logits=after.get(i))
            r.stats.draft_steps_proposed += 1
            r.stats.probe_s += probe_s / len(rows_i)
            r.stats.draft_s += ((t_verify - t_draft) + draft_feed_s) / len(rows_i)
            r.stats.verify_s += (t_fed - t_verify) / len(rows_i)
            r.stats.drafted_tokens += len(d.tokens) - d.n_forced
            trace = StepTrace("draft", texts[i], len(d.tokens), q.get(i), p.get(i), decisions[i], dt, scores.get(i))
            if decisions[i] == "reject":
                tgt.rollback(i, n_new[i], last_logits=pre_logits[i])
                drf.rollback(i, len(d.tokens) - d.n_forced, last_logits=d.logits[0] if d.logits else None)
                r.trace.append(trace)
                r.forced = list(d.tokens[: d.n_forced])
                rejected.append(i)
                continue
            r.stats.draft_steps_accepted += 1
            self._commit(r, trace, d.tokens, d.n_forced, self.draft_tokenizer.eos_token_id, True)
            if self.shared and self.bonus_token and not r.done and self._limit(r, i, tgt, drf) > 0:
                bonus_rows.append(i)
        if bonus_rows:
            toks = sample_next(torch.stack([tgt.last_logits[i].float().cpu() for i in bonus_rows]), **sampling).tolist()
            for i, t in zip(bonus_rows, toks):
                r = rows[i]
                tgt.seq[i].append(int(t))
                drf.seq[i].append(int(t))
                r.out.append(int(t))
                r.stats.output_tokens += 1
                if int(t) == self.tokenizer.eos_token_id:
                    r.done = True
                else:
                    r.forced = [int(t)]
        return rejected

    def _fast_path(self, logits: torch.Tensor, tokens: list[int]) -> bool:
        """Keep without the probe: every drafted token is in the target's top-k and passes the log-prob floor.

        Args:
            logits: (k, V) the target's logits predicting each drafted token.
            tokens: the k drafted tokens (the bonus token, which the target wrote, excluded).
        """
        if not tokens:
            return False
        _, logp, rank = token_scores(logits, torch.as_tensor(tokens))  # (k,), (k,): as the token statistics score them
        return bool(((rank < self.top_k) & (logp >= self.fast_path_min_logprob)).all())

    def _probe_decisions(self, slow, fed, t_start, tgt, drf, drafts, coins, decisions, q, p, step_logits
                         ) -> tuple[float, float]:
        """q (and p when needed) for the rows off the fast path, and the rule's decision.

        Returns:
            Probe seconds, and the seconds of the draft forward that reads the steps' last tokens for p.

        Both probes' inputs come from :func:`~generation.features.rows_features`, the feature function
        the label build uses: the target's from this verification forward (hidden states at the
        step's positions, logits predicting its tokens), the draft's from its drafting forwards.

        Ratio rule: accept when ``u < min(1, s * q / p)``, i.e. ``u * p < s * q``. With ``lazy_p``,
        ``s * q >= u`` accepts whatever ``p`` is, so the draft probe (and the draft's read of the
        step's last token) only runs for the other rows; their trace has ``p=None``.
        """
        tp = time.perf_counter()
        tspec = FeatureSpec.of(self.target_probe.config)
        ends = {i: t_start[i] + len(step_logits[i]) for i in slow}
        x = self._rows_input(
            tspec,
            [tgt.seq[i][t_start[i] : ends[i]] for i in slow],
            [fed[i].hidden[:, t_start[i] - fed[i].start : ends[i] - fed[i].start] for i in slow] if tspec.needs_hidden else None,
            [step_logits[i] for i in slow],
        )
        for i, qi in zip(slow, self.target_probe(x.to(_device(self.target))).float().cpu().tolist()):
            q[i] = qi
        if self.rule == "threshold":
            for i in slow:
                decisions[i] = "accept" if q[i] >= self.tau else "reject"
            return time.perf_counter() - tp, 0.0
        u = {i: float(torch.rand((), generator=coins)) for i in slow}
        need = [i for i in slow if not (self.lazy_p and self.ratio_scale * q[i] >= u[i])]
        draft_feed_s = 0.0
        if need:
            dspec = FeatureSpec.of(self.draft_probe.config)
            if dspec.needs_hidden:
                # The draft reads its step's last token only now, and only for steps that need p:
                # a kept step hands that token to the draft's next forward instead.
                t_feed = time.perf_counter()
                for i, f in drf.feed(need, hidden=True).items():
                    drafts[i].hidden.extend(f.hidden[:, max(0, drafts[i].start - f.start) :].unbind(1))
                draft_feed_s = time.perf_counter() - t_feed
                tp += draft_feed_s  # a draft forward, not probe time
            x = self._rows_input(
                dspec,
                [drafts[i].tokens for i in need],
                [drafts[i].pooled_input() for i in need] if dspec.needs_hidden else None,
                [torch.stack(drafts[i].token_logits()) for i in need],
            )
            for i, pi in zip(need, self.draft_probe(x.to(_device(self.draft))).float().cpu().tolist()):
                p[i] = pi
        for i in slow:
            ok = i not in p or u[i] * p[i] < self.ratio_scale * q[i]
            decisions[i] = "accept" if ok else "reject"
        return time.perf_counter() - tp, draft_feed_s

    @staticmethod
    def _rows_input(spec: FeatureSpec, tokens, hidden, logits) -> torch.Tensor:
        return probe_input(rows_features(spec, tokens, hidden, logits), spec.groups)

    def _judge_score(self, logits: torch.Tensor) -> float:
        """Expected 0-9 score from the logits of the digit tokens (SpecReason-style judge)."""
        ids = self._digit_ids()
        probs = torch.softmax(logits.float()[ids], dim=-1).cpu()
        return float((probs * torch.arange(10, dtype=torch.float32)).sum())

    def _digit_ids(self) -> list[int]:
        if not hasattr(self, "_digits"):
            self._digits = [self.tokenizer(f" {d}", add_special_tokens=False).input_ids[-1] for d in range(10)]
        return self._digits

    # ------------------------------------------------------------------ transformers' own loop

    def _hf_generate(
        self, ids: list[int], method: str, max_new_tokens: int, temperature: float, top_p: float, seed: int
    ) -> DecodeResult:
        """One prompt through ``model.generate`` (assisted with the draft for ``token_sd``)."""
        dev = _device(self.target)
        calls = {"target": 0, "draft": 0}
        hooks = [self.target.register_forward_hook(lambda *a: calls.__setitem__("target", calls["target"] + 1))]
        kwargs = {
            "max_new_tokens": max_new_tokens,
            "pad_token_id": self._pad(self.tokenizer),
            "eos_token_id": self.tokenizer.eos_token_id,
        }
        kwargs.update(
            {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {"do_sample": False}
        )
        if method == "token_sd":
            hooks.append(self.draft.register_forward_hook(lambda *a: calls.__setitem__("draft", calls["draft"] + 1)))
            kwargs["assistant_model"] = self.draft
            if not self.shared:
                kwargs.update(tokenizer=self.tokenizer, assistant_tokenizer=self.draft_tokenizer)
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        try:
            x = torch.tensor([ids], device=dev)
            out = self.target.generate(x, attention_mask=torch.ones_like(x), **kwargs)
        finally:
            for h in hooks:
                h.remove()
        wall = time.perf_counter() - t0
        new = out[0, len(ids) :].tolist()
        eos = self.tokenizer.eos_token_id
        if eos in new:
            new = new[: new.index(eos) + 1]
        text = self._text(self.tokenizer, new)
        stats = DecodeStats(
            wall_s=wall, output_tokens=len(new), steps=0, target_passes=calls["target"], draft_passes=calls["draft"]
        )
        return DecodeResult(text, [], stats)
