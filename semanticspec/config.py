"""`DecodeConfig`: what one ``generate`` call decodes with, typed, frozen and checked where it is built.

As transformers' ``GenerationConfig`` and vLLM's ``SamplingParams``: build one and pass it, or pass its fields as
keyword arguments (``dec.generate(prompts, max_new_tokens=64)``), which build one; both decoders
(:class:`~semanticspec.decoder.SemanticSpecDecoder`, :class:`~semanticspec.served.ServedDecoder`) read the same
config::

    config = DecodeConfig(max_new_tokens=128, seed=[0, 1, 2])
    results = dec.generate(prompts, config)
    greedy = dec.generate(prompts, config, temperature=0.0, allow_sampling_mismatch=True)  # a changed copy

A bad value is refused when the config is built, naming the field and the value; what depends on the decoder (a
method it does not run, a probe it lacks, a sampling that differs from its probes') is refused by ``generate``
before any model call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from generation.sampling import seed_errors
from generation.specs import SamplingSpec, StepSpec, is_count, is_real
from semanticspec.policies import AcceptancePolicy

SPECREASON_SUFFIX = "\nScore 0-9:"
"""Judge turn appended after a draft step for SpecReason-style scoring (SpecReason asks for a 0-9 score)."""


@dataclass(frozen=True)
class DecodeConfig:
    """What one ``generate`` call decodes with.

    Attributes:
        max_new_tokens: output token budget per prompt (an integer >= 1), counted in the tokens of the model that
            wrote each kept step: with two tokenizers a kept draft step counts in the draft's (see
            :attr:`~semanticspec.results.DecodeStats.output_tokens`).
        temperature: sampling temperature of both models, 0 greedy; None = the temperature the probes' labels were
            sampled at (their ``config.sampling``), else 0.6. For methods the probes decide, a value that differs
            from the probes' is refused, naming both, unless ``allow_sampling_mismatch``.
        top_p: nucleus mass of both models, in (0, 1]; None = the probes', else 0.95; enforced likewise.
        seed: seeds sampling and the acceptance coins; every prompt draws from its own streams
            (:func:`~generation.sampling.stream_keys`). One integer: prompt ``k`` seeds from ``(seed, k)``, so a
            call decodes the same whatever its batching. One seed per prompt (a list or tuple, like the OpenAI
            API's per-request ``seed``): prompt ``k`` decodes the same in any batch, at any position, and alone
            with ``seed=seed[k]``.
        method: a name of the decoder's method table (``semanticspec``, ``target_only``, ``draft_only``,
            ``specreason``...) or an :class:`~semanticspec.policies.AcceptancePolicy` run speculatively: another
            :class:`~semanticspec.policies.ProbePolicy`, ``RandomPolicy(rate)`` (keeps a step with probability
            ``rate``), ``OraclePolicy(oracle)`` (keeps a step when ``oracle(step_text, output_so_far)``).
        batch_size: prompts decoded together in-process (None: all at once); the served decoder's prompts run
            concurrently instead (its ``concurrency``), so it refuses a batch size.
        allow_sampling_mismatch: decode with a ``temperature`` or ``top_p`` that differs from the probes' (greedy
            with probes trained on steps sampled at 0.6, say): a ``UserWarning`` naming both instead of the
            refusal. The probes then judge steps unlike their training steps: measure before relying on it.
        progress: a progress bar over the prompts.
        lookahead: drafted steps judged per target pass (an integer >= 1), or None (default): SemanticSpec's
            shipped window (:data:`~semanticspec.parts.SHIPPED_WINDOW`: up to 4 steps, adaptive) for the method
            ``semanticspec`` where windows apply (one tokenizer in-process, a policy that reads neither the draft
            probe's ``p`` nor a judge turn), else one step. The draft writes up to ``lookahead`` steps one after
            another, the target reads them all in one forward (served: one request), the probe judges each as the
            step-by-step loop would (causal attention: a step's features depend only on the text before it), and
            the kept steps up to the first refused one are committed; in-process, a window may also follow a
            refused step's rewrite in the same forward (docs/design.md, "Windows"). 1 is one step per target pass
            (the paper's loop). Above 1: speculative methods only; it needs one tokenizer in-process, no policy
            that reads the draft probe's ``p`` or a judge turn, and room in the models' context for ``lookahead``
            steps of the step spec's most tokens after a one-token prompt (where the decoder knows the context; the
            decoder refuses more, naming the most that fits). A window near the context's end or the budget's is
            cut there (the row's ``stop_reason`` says which).
        window_min_logprob: an adaptive window (with a ``lookahead`` above 1 given): the draft writes a window's
            next step only after a step whose every token it drew at this raw log-probability or more (a step it was
            unsure of is the likelier to be refused, and the steps after a refused one are thrown away); None
            (default): every window holds ``lookahead`` steps where the row goes on. A number <= 0.
        overlap: the draft writes each row's next window while the target reads this one, as if it were kept whole
            (PEARL-style); the draft's work is thrown away when a step is refused or the target's bonus token is not
            the draft's next token. Served decoding only (the two servers are separate processes); speculative
            methods.
        target_first_step: the target writes each prompt's first step (the paper); off by default, as
            ``benchmarks/first_step.py`` backs (docs/benchmarks.md, "Who writes the first step").
        step: what a step is (:class:`~generation.specs.StepSpec`: delimiters and cap). None (default) = the step the
            probes' labels were cut at (``config.step``), else ``StepSpec()``. A probe is used on the steps it was
            trained on: a step that differs from a probe's is refused, naming both.
        answer_marker: stop once a newline follows an occurrence of this marker (before the next one), wherever it
            stands in its line (e.g. ``"Answer:"``, ``"\\boxed{"``): at the end of the step that completes the line;
            None = the decoder's task's marker, else none. A marker that differs from the task's is refused.
        token_sd: the target writes its steps (first and refused) with token-level speculative sampling from the
            same draft; lossless for those steps. None (default) = on when the models share a tokenizer
            (``benchmarks/first_step.py``); True with two is refused, as is True served (a target server writes
            refused steps with its own speculation, if it has one).
        token_sd_tokens: draft tokens proposed per target pass when ``token_sd``.
        rewrite_in_rounds: with ``token_sd``, a refused step is rewritten inside the loop's rounds instead of in a
            phase of its own while the other rows wait: the target redraws the step from the verification forward
            it already ran (the refused step as a point-mass proposal, so the rewrite is an exact draw from the
            target), and an unfinished rewrite continues as the draft's proposal, checked token by token in the next
            round's verification forward beside the other rows' steps.
        bonus_token: on accept, the token the target predicts after the step opens the next step (in-process, one
            tokenizer only).
        judge_suffix: the judge turn of the SpecReason baseline; in-process, every method keeps room for it (and a
            bonus token) at the context's end, and a call where it leaves no room is refused.

    Raises:
        ValueError: a field with a bad value, naming every bad field and its value at once.
    """

    max_new_tokens: int = 256
    temperature: float | None = None
    top_p: float | None = None
    seed: int | tuple[int, ...] = 0
    method: Any = "semanticspec"
    batch_size: int | None = None
    allow_sampling_mismatch: bool = False
    progress: bool = False
    lookahead: int | None = None
    window_min_logprob: float | None = None
    overlap: bool = False
    target_first_step: bool = False
    step: StepSpec | None = None
    answer_marker: str | None = None
    token_sd: bool | None = None
    token_sd_tokens: int = 4
    rewrite_in_rounds: bool = True
    bonus_token: bool = True
    judge_suffix: str = SPECREASON_SUFFIX

    def __post_init__(self) -> None:
        if isinstance(self.seed, Sequence) and not isinstance(self.seed, (str, bytes)):
            object.__setattr__(self, "seed", tuple(self.seed))
        errors = self._problems()
        if errors:
            raise ValueError("invalid DecodeConfig: " + "; ".join(errors))

    def _problems(self) -> list[str]:
        """Every bad field, as ``name=value: what is expected``."""
        from semanticspec.methods import unknown_method  # the table imports the loop; configs are built after it

        m, w, ahead, marker, step = self.method, self.window_min_logprob, self.lookahead, self.answer_marker, self.step
        unknown = unknown_method(m) if isinstance(m, str) else None
        log_w = w is None or (is_real(w) and w <= 0)
        flags = ("allow_sampling_mismatch", "progress", "overlap", "target_first_step", "rewrite_in_rounds",
                 "bonus_token")
        checks = [  # (field, its value is good, what is expected), in the order a refusal names them
            ("max_new_tokens", is_count(self.max_new_tokens), "expected an integer >= 1"),
            ("lookahead", ahead is None or is_count(ahead), "expected an integer >= 1, or None for the shipped window"),
            ("method", isinstance(m, (str, AcceptancePolicy)), "expected a method name or an AcceptancePolicy"),
            ("method", unknown is None, unknown),
            ("window_min_logprob", log_w, "expected a log-probability (a number <= 0) or None"),
            ("window_min_logprob", not log_w or w is None or not (ahead is None or ahead == 1),
             "an adaptive window needs lookahead > 1"),
            ("batch_size", self.batch_size is None or is_count(self.batch_size),
             "expected an integer >= 1, or None for all prompts at once"),
            *((flag, isinstance(getattr(self, flag), bool), "expected True or False") for flag in flags),
            ("token_sd", self.token_sd is None or isinstance(self.token_sd, bool),
             "expected True, False or None (on where the models share a tokenizer)"),
            ("token_sd_tokens", is_count(self.token_sd_tokens), "expected an integer >= 1"),
            ("step", step is None or isinstance(step, StepSpec), "expected a generation.specs.StepSpec or None"),
            ("answer_marker", marker is None or (isinstance(marker, str) and marker),
             "expected a non-empty string or None"),
            ("judge_suffix", isinstance(self.judge_suffix, str) and self.judge_suffix, "expected a non-empty string"),
        ]
        problems = [f"{name}={getattr(self, name)!r}: {why}" for name, good, why in checks if not good]
        problems += SamplingSpec.errors(SamplingSpec.temperature if self.temperature is None else self.temperature,
                                        SamplingSpec.top_p if self.top_p is None else self.top_p)  # the one check
        return problems + seed_errors(self.seed)

    @classmethod
    def of(cls, config: DecodeConfig | None = None, overrides: Mapping[str, Any] | None = None) -> DecodeConfig:
        """``config`` (default: ``DecodeConfig()``) with ``overrides`` applied: what ``generate(prompts, config,
        **overrides)`` decodes with.

        Raises:
            TypeError: ``config`` is not a DecodeConfig.
            ValueError: an override that is not a field (naming it and the fields), or a bad value.
        """
        if config is None:
            config = cls()
        elif not isinstance(config, cls):
            raise TypeError(f"config must be a DecodeConfig, got {type(config).__name__}; pass its fields as "
                            "keyword arguments or build one with DecodeConfig(...)")
        if not overrides:
            return config
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(overrides) - set(fields))
        if unknown:
            raise ValueError(f"{', '.join(unknown)}: not a DecodeConfig field; expected some of {fields}")
        return dataclasses.replace(config, **overrides)
