"""What both decoders share: ``generate`` and ``stream`` over the one step loop, and each call's plan: its config
resolved against the probes (the step and the sampling their labels were made with) and the task (the answer marker),
and the method's checks.

:class:`~semanticspec.decoder.SemanticSpecDecoder` (in-process models) and
:class:`~semanticspec.served.ServedDecoder` (two servers) differ only in how they read their
prompts and which parts they give :class:`~semanticspec.loop.StepLoop`
(:meth:`StepDecoder.step_loop`); the rounds, the decisions and the events are the loop's.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch

from generation.sampling import stream_keys
from generation.specs import SamplingSpec, StepSpec
from semanticspec.config import DecodeConfig
from semanticspec.loop import LoopSetup
from semanticspec.parts import SHIPPED_WINDOW, Window
from semanticspec.prompts import batch
from semanticspec.hf import TransformersLoop
from semanticspec.methods import Method, method_for
from semanticspec.results import DecodeResult, StepEvent, collect


class Plan(NamedTuple):
    """One call's work, every check done: the method, the inputs (the prompts as the verifier reads them, then as the
    proposer does), each prompt's stream key, the sampling, the config, how the loop runs, what a step is and the
    context room each row keeps spare."""

    method: Method | TransformersLoop
    inputs: tuple[Sequence, ...]
    keys: list
    sampling: SamplingSpec
    cfg: DecodeConfig
    loop: LoopSetup
    step: StepSpec
    spare: int


class StepDecoder:
    """The public ``generate``/``stream`` of a decoder; subclasses plan a call and build its loop."""

    policy: Any
    target_probe: Any
    draft_probe: Any
    config: DecodeConfig
    """The decoder's default config: a call without one starts from it."""
    task: Any = None
    """The task whose answer marker ends a decode (None: the config's marker, if any)."""
    step: StepSpec
    """What a step is with the default config: the probes' :class:`StepSpec`, unless the config says."""
    _labelled_with: dict
    """What the probes' labels were made with (their step and sampling), per field, with whose it is
    (:func:`probes.model.labelled_with`)."""
    last_wall_s: float = 0.0
    """Wall time of the last :meth:`generate` or :meth:`stream` call (all prompts; a stream's until its reader closes
    it)."""
    windows: bool = True
    """The decoder can judge a window of several drafted steps per target pass (in-process: one tokenizer)."""

    def generate(self, prompts: Sequence, config: DecodeConfig | None = None, **overrides: Any
                 ) -> list[DecodeResult]:
        """Decode every prompt with ``config`` (a :class:`~semanticspec.config.DecodeConfig`: the budget,
        sampling, seed, method and its arguments, batch size), or with its fields as keyword arguments, which
        change a copy of it (``generate(prompts, max_new_tokens=64, seed=[0, 1])``).

        Args:
            prompts: prompt strings (in-process tokenized with BOS, as ``tokenizer(prompt)`` does; a bare string is
                one prompt, as transformers tokenizers read it), or, in-process, token ids already formatted (a chat
                template's, e.g. ``Task.prompt``): a list of ids with one tokenizer, a ``(target_ids, draft_ids)``
                pair with two. A served decoder's prompts are text (its servers tokenize them).
            config: what to decode with; None = ``DecodeConfig()`` (the method ``semanticspec``, 256 new tokens,
                the probes' sampling, seed 0).
            **overrides: :class:`~semanticspec.config.DecodeConfig` fields that change ``config`` for this
                call. Methods are the names of :data:`semanticspec.methods.METHODS`, or an acceptance policy
                (e.g. ``SpecReasonPolicy(threshold=8)``) run in the speculative loop.

        Returns:
            One :class:`~semanticspec.results.DecodeResult` per prompt, in order, each with its ``stop_reason``
            (``eos``, ``answer``, ``budget``, ``context``, or ``error`` for a served row whose request failed: no
            method writes past either model's context); ``[]`` for no prompts.

        Raises:
            ValueError: a bad config field or an unknown override (naming it), an unknown method, a missing
                probe/rate/oracle, a sampling that differs from the probes', a list of seeds whose length is not
                the number of prompts, or a bad prompt (a mixed batch, an empty prompt, an id outside the
                vocabulary, a prompt longer than a model's context), naming the prompt's index; all before any
                model call or request.
            EngineError: served, a server that is gone or refuses while the prompts are counted on it (one that
                states its context), before any decode; a server that fails later fails its rows instead
                (``stop_reason="error"``).
        """
        plan = self.plan(prompts, self._config(config, overrides))
        return collect(self._events(plan), len(plan.keys))

    def stream(self, prompts: Sequence, config: DecodeConfig | None = None, **overrides: Any
               ) -> Iterator[StepEvent]:
        """:meth:`generate`, yielding each prompt's steps as the loop commits them (or refuses them), then its end
        event with its :class:`~semanticspec.results.DecodeResult` (:class:`~semanticspec.results.StepEvent`);
        prompts of one batch interleave round by round. Everything :meth:`generate` refuses is refused here, when
        called, before any model call or request."""
        return self._events(self.plan(prompts, self._config(config, overrides)))

    def _config(self, config: DecodeConfig | None, overrides) -> DecodeConfig:
        """A call's config: ``config``, else the decoder's own, with ``overrides`` applied."""
        return DecodeConfig.of(self.config if config is None else config, overrides)

    def loop_setup(self, config: DecodeConfig | None = None) -> LoopSetup:
        """How the step loop runs for ``config`` (default: the decoder's own) on this decoder: the task's answer
        marker, token-level speculation and the bonus token where this pair allows them (ValueError: what it
        cannot run)."""
        return self._setup(self.config if config is None else config)[0]

    def _checked_default(self) -> StepSpec:
        """What a step is with the decoder's own config, checked before any call for what every call with it would be
        refused (ValueError naming the field, as a call's refusal does: a method this decoder cannot run, a setting
        it has no use for, a window that cannot fit, a sampling other than the probes'); a call's overrides are
        still checked per call."""
        # a decoder without probes, built with the default config, is called with methods that need none
        _, step, method, problems = self._checked(self.config, probes=False)
        if problems:
            raise ValueError(f"config: {'; '.join(problems)}")
        self._sampling(self.config, method, stacklevel=3)  # the warning names the line building the decoder
        return step

    def _checked(self, cfg: DecodeConfig, probes: bool = True
                 ) -> tuple[LoopSetup, StepSpec, Method | TransformersLoop | None, list[str]]:
        """The loop setup, step spec and method of ``cfg`` on this decoder, and what is wrong with it (:meth:`_method`,
        whose ``probes`` says whether the probes the method needs are checked, and :meth:`_refusals`)."""
        loop, step = self._setup(cfg)
        method, problems = self._method(cfg, step, probes)
        return loop, step, method, problems + self._refusals(cfg, method)

    def _sampling(self, cfg: DecodeConfig, method, stacklevel: int) -> SamplingSpec:
        """The sampling of ``cfg``: the probes' unless given; a value that differs from theirs is refused for a method
        they decide, naming both (a warning with ``allow_sampling_mismatch``, naming the frame ``stacklevel`` above
        the caller, 1 being the caller's)."""
        return resolve_sampling(self._labelled_with, cfg.temperature, cfg.top_p,
                                method is not None and method.probes_decide, cfg.allow_sampling_mismatch,
                                stacklevel=stacklevel + 1)

    def _setup(self, cfg: DecodeConfig) -> tuple[LoopSetup, StepSpec]:
        """How the loop runs for ``cfg`` on this decoder, and what a step is (the probes' unless ``cfg.step`` says).

        Raises:
            ValueError: a step that differs from the probes', an answer marker that differs from the task's, or loop
                settings this decoder cannot run (naming them).
        """
        step = step_spec(self._labelled_with, cfg.step)
        marker = answer_marker(cfg.answer_marker, self.task)
        token_sd, bonus = self._token_sd(cfg)
        return LoopSetup(cfg.target_first_step, marker, bonus, token_sd, cfg.token_sd_tokens,
                         cfg.rewrite_in_rounds), step

    def sampling(self, temperature: float | None = None, top_p: float | None = None, *,
                 enforce: bool = True, allow_mismatch: bool = False) -> SamplingSpec:
        """The :class:`~generation.specs.SamplingSpec` a decode samples with: the values given, else how the probes'
        labels were sampled, else the defaults (T = 0.6, top-p 0.95).

        Args:
            temperature: 0 is greedy; None = the probes'.
            top_p: nucleus mass; None = the probes'.
            enforce: refuse a given value that differs from the probes' (naming both), as every method whose
                decisions come from the probes does: a probe judges steps like the ones it was trained on.
            allow_mismatch: with ``enforce``, warn about such a value instead of refusing it.

        Raises:
            ValueError: a value that differs from the probes' (with ``enforce`` and without ``allow_mismatch``), or
                a bad value (naming it, before it is compared with the probes').
        """
        given = {"temperature": temperature, "top_p": top_p}  # a call's config was checked where it was built
        if bad := SamplingSpec.errors(*(getattr(SamplingSpec, k) if v is None else v for k, v in given.items())):
            raise ValueError("invalid sampling: " + "; ".join(bad))
        return resolve_sampling(self._labelled_with, temperature, top_p, enforce, allow_mismatch, stacklevel=2)

    def _token_sd(self, cfg: DecodeConfig) -> tuple[bool, bool]:
        """Whether the target writes its steps with token-level speculation, and whether a bonus token opens the step
        after a kept one, for ``cfg`` on this decoder (ValueError: what it cannot run)."""
        raise NotImplementedError

    def spare(self, cfg: DecodeConfig) -> int:
        """Context positions each row keeps free past its output for ``cfg`` (a bonus token, and in-process a judge
        turn)."""
        raise NotImplementedError

    def prompts(self, problems: Sequence[str] | str) -> list:
        """Each problem as :meth:`generate` reads it, in the decoder's task's format (``Task.prompt_text``: a model's
        chat template where its tokenizer has one, else the problem and the task's prompt suffix); a bare string is
        one problem, as :meth:`generate` reads a bare string as one prompt.

        Raises:
            ValueError: the decoder has no task, or a problem is not a string (naming its index).
        """
        if self.task is None:
            raise ValueError("prompts() formats problems as the decoder's task does; give the decoder task=... (a "
                             "datamodules.tasks.base.Task), or format prompts yourself")
        problems = batch(problems, "problems", "problem texts (or one text)")
        bad = next((i for i, p in enumerate(problems) if not isinstance(p, str) or not p.strip()), None)
        if bad is not None:
            got = "empty" if isinstance(problems[bad], str) else f"a {type(problems[bad]).__name__}"
            raise ValueError(f"problem {bad} is {got}: expected the problem's text")
        return [self._prompt(p) for p in problems]

    def _prompt(self, problem: str):
        raise NotImplementedError

    def plan(self, prompts, cfg: DecodeConfig) -> Plan:
        """A call's work: its method, prompts as each part reads them, stream keys, sampling and config, every check
        :meth:`generate` makes done (ValueError naming what is wrong) before any model call or request.

        The loop setup and step spec (:meth:`_setup`), the method (:meth:`_method`), what this decoder cannot run of
        the call (:meth:`_refusals`), the sampling (the probes' unless given; a value that differs from theirs is
        refused for a method they decide, naming both), then the prompts as the parts read them (:meth:`_inputs`).
        """
        loop, step, method, problems = self._checked(cfg)
        sampling = self._sampling(cfg, method, stacklevel=3)  # a warning names the line calling generate() or stream()
        if problems:
            raise ValueError("; ".join(problems))
        inputs = self._inputs(prompts, cfg, method)
        return Plan(method, inputs, stream_keys(cfg.seed, len(inputs[0])), sampling, cfg, loop, step, self.spare(cfg))

    def _refusals(self, cfg: DecodeConfig, method) -> list[str]:
        """What this decoder cannot run of ``cfg`` with ``method`` (one line each, naming the field)."""
        raise NotImplementedError

    def _inputs(self, prompts, cfg: DecodeConfig, method) -> tuple[Sequence, Sequence]:
        """The prompts as the verifier reads them, then as the proposer does (ValueError naming a bad prompt or a
        server that cannot run ``method``)."""
        raise NotImplementedError

    def step_loop(self, plan: Plan, batch: tuple, keys):
        """The :class:`~semanticspec.loop.StepLoop` of one batch of ``plan`` (``batch``: its inputs, sliced; ``keys``:
        their stream keys)."""
        raise NotImplementedError

    def batch_events(self, plan: Plan, batch: tuple, keys) -> Iterator[StepEvent]:
        """The events of one batch of a plan (``batch``: its inputs, sliced; ``keys``: their stream keys), prompt
        indices within the batch: the batch's step loop, run with the plan's method, or for a
        :class:`~semanticspec.hf.TransformersLoop` method transformers' own loop (:meth:`transformers_events`)."""
        if isinstance(plan.method, TransformersLoop):
            return self.transformers_events(plan, batch, keys)
        return self.step_loop(plan, batch, keys).stream(plan.method)

    def transformers_events(self, plan: Plan, batch: tuple, keys) -> Iterator[StepEvent]:
        """The events of one batch decoded by transformers' own loop, prompt by prompt (in-process only: the served
        decoder refuses such a method in :meth:`plan`)."""
        raise NotImplementedError

    @torch.inference_mode()
    def _events(self, plan: Plan) -> Iterator[StepEvent]:
        """The events of every batch of ``cfg.batch_size`` prompts, with their indices in the call (in inference mode:
        no autograd, no version counters)."""
        n, cfg = len(plan.keys), plan.cfg
        bs = self._batch_size(cfg, n)
        bar = None
        if cfg.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=n, desc=str(cfg.method), unit="prompt")
        t0 = time.perf_counter()
        try:
            for s in range(0, n, bs):
                batch = tuple(x[s : s + bs] for x in plan.inputs)
                for e in self.batch_events(plan, batch, plan.keys[s : s + bs]):
                    if bar is not None and e.end:
                        bar.update()
                    yield dataclasses.replace(e, prompt=s + e.prompt)
        finally:  # a stream its reader left too (closed, or collected)
            if bar is not None:
                bar.close()
            self.last_wall_s = time.perf_counter() - t0

    def row_inputs(self, inputs: tuple, k: int) -> tuple:
        """Prompt ``k`` of a plan's inputs as a loop admits it: its prompt for the verifier, then for the proposer."""
        return inputs[0][k], inputs[1][k]

    def prompt_room(self, plan: Plan) -> int | None:
        """New tokens the first prompt of a plan leaves room for in the models' contexts (None: unknown, a server's
        count)."""
        return None

    def _batch_size(self, cfg: DecodeConfig, n: int) -> int:
        """Prompts per loop: ``cfg.batch_size``, else all ``n``."""
        return cfg.batch_size or max(n, 1)

    def _method(self, cfg: DecodeConfig, step: StepSpec | None = None, probes: bool = True
                ) -> tuple[Method | TransformersLoop | None, list[str]]:
        """The call's method (with the config's window, its steps ``step``: default the decoder's) and what is wrong
        with the call for it; ``probes``: whether the probes the method needs are checked."""
        name = cfg.method
        try:
            method = method_for(name, self.policy)
        except ValueError as e:
            return None, [str(e)]
        needs, problems = method.policy.needs if method.policy is not None and probes else None, []
        if needs is not None and needs.q and self.target_probe is None:
            problems.append(f"method={name!r} needs target_probe (an exported probe directory)")
        if needs is not None and needs.p and self.draft_probe is None:
            problems.append("rule='ratio' needs draft_probe for p; give one or use rule='threshold'")
        window = self._window(cfg, method)
        if window.size > 1 or window.overlap:
            why = lookahead_problem(method, name)
            if why:  # overlap drafts a next window ahead: of one step too
                head, fix = ("overlap=True", "overlap=False") if window.size == 1 else \
                    (f"lookahead={window.size}", "lookahead=1")
                problems.append(f"{head}: {why}; use {fix}")
            elif why := self._window_fits(cfg, step or self.step):
                problems.append(f"lookahead={window.size}: {why}")
            else:
                method = dataclasses.replace(method, window=window)
        return method, problems

    def _window_fits(self, cfg: DecodeConfig, step: StepSpec) -> str | None:
        """Why a window of ``cfg.lookahead`` steps of ``step``'s most tokens cannot fit the models' context after a
        one-token prompt, or None (the shipped window, None, is cut at the context as any window near its end is)."""
        lookahead, room, cap = cfg.lookahead, self.context_room(self.spare(cfg)), step.max_step_tokens
        if lookahead is None or room is None or lookahead * cap <= room:
            return None
        return (f"a window of {lookahead} steps of up to {cap} tokens ({lookahead * cap}) cannot fit the "
                f"{room} new tokens the models' context leaves after a one-token prompt; use lookahead <= "
                f"{max(room // cap, 1)}")

    def context_room(self, spare: int | None = None) -> int | None:
        """New tokens both models' contexts hold after a one-token prompt, each row keeping ``spare`` positions free
        (default: what the decoder's own config keeps); None: neither context known."""
        return self._room(1, 1, self.spare(self.config) if spare is None else spare)

    def _room(self, n_target: int, n_draft: int, spare: int) -> int | None:
        """New tokens both models' contexts hold after prompts of these lengths (None: neither context known)."""
        rooms = [ctx - n - spare for n, ctx in zip((n_target, n_draft), self.contexts()) if ctx is not None]
        return min(rooms, default=None)

    def contexts(self) -> tuple[int | None, int | None]:
        """The target's and the draft's context in tokens, each None where it is not known."""
        raise NotImplementedError

    def _window(self, cfg: DecodeConfig, method) -> Window:
        """The call's window: the config's ``lookahead``, else the shipped window for ``semanticspec`` where this
        decoder and the policy allow windows, else one step."""
        if cfg.lookahead is not None:
            return Window(cfg.lookahead, cfg.window_min_logprob, cfg.overlap)
        shipped = cfg.method == "semanticspec" and self.windows and lookahead_problem(method, cfg.method) is None
        return dataclasses.replace(SHIPPED_WINDOW if shipped else Window(), overlap=cfg.overlap)


def lookahead_problem(method, name) -> str | None:
    """Why ``method`` (named ``name``) cannot judge a window of several drafted steps per target pass, or None."""
    if getattr(method, "policy", None) is None:
        return f"method={name!r} drafts no steps for the target to judge"
    if method.policy.needs.judge:
        return (f"method={name!r} reads a judge turn after each step, which cannot share one forward with the "
                "steps after it")
    if method.policy.needs.p:
        return "the ratio rule reads the draft probe's p, which is read for one-step windows only"
    return None


# ------------------------------------------------------------------ a call's settings against the probes and task


def refuse_conflicts(given: dict[str, object], seen: dict[str, tuple[object, str]], what: str,
                     warn: bool = False, stacklevel: int = 1) -> None:
    """Refuse an explicit value that differs from the probes', naming both (``warn``: warn instead, naming the line
    ``stacklevel`` frames up, 1 being the caller's)."""
    differ = [k for k, v in given.items() if v is not None and k in seen and seen[k][0] != v]
    problems = [f"{k}={given[k]!r} but the {seen[k][1]} was trained on {what} with {k}={seen[k][0]!r}" for k in differ]
    if problems and warn:
        warnings.warn("allow_sampling_mismatch=True: " + "; ".join(problems) + ". The probes judge steps unlike "
                      "the ones they were trained on, so their decisions (and the accuracy) may suffer.",
                      UserWarning, stacklevel=stacklevel + 1)
    elif problems:
        fix = f"leave {' and '.join(differ)} unset to use the probe's"
        if what == "steps sampled":
            fix += ", or pass allow_sampling_mismatch=True to accept the mismatch"
        raise ValueError("a probe is used on the steps it was trained on: " + "; ".join(problems) + f" ({fix})")


def step_spec(seen: dict[str, tuple[object, str]], given: StepSpec | None) -> StepSpec:
    """The step definition: the one the probes' labels were cut at (``seen``: :func:`probes.model.labelled_with`),
    unless given; a differing one is refused."""
    refuse_conflicts({"step": given}, seen, "steps")
    return given or (seen["step"][0] if "step" in seen else StepSpec())


def answer_marker(given: str | None, task) -> str | None:
    """The marker that ends a decode: ``given`` (a config's ``answer_marker``), else ``task``'s (any object with an
    ``answer_marker``, such as a ``datamodules.tasks.base.Task``), else None.

    Raises:
        ValueError: the task has no ``answer_marker``, or ``given`` differs from it (naming both).
    """
    if task is None:
        return given
    if isinstance(task, type):  # its class attributes would pass, its methods fail at the first prompt
        raise TypeError(f"task={task.__name__}: a class; give an instance, e.g. task={task.__name__}()")
    marker = getattr(task, "answer_marker", None)
    if not isinstance(marker, str) or not marker:
        raise ValueError(f"task={task!r} has no answer_marker (a non-empty string); give a "
                         "datamodules.tasks.base.Task, or DecodeConfig(answer_marker=...) and no task")
    if given not in (None, marker):
        raise ValueError(f"answer_marker={given!r} but the task's is {marker!r}; give one of them")
    return marker


def resolve_sampling(seen: dict[str, tuple[object, str]], temperature, top_p, enforce: bool,
                     allow_mismatch: bool = False, stacklevel: int = 1) -> SamplingSpec:
    """The sampling of a decode: the call's values, else the probes' label sampling, else the defaults.

    Args:
        seen: what the decoder's probes' labels were made with (:func:`probes.model.labelled_with`).
        enforce: the method decides with the probes, so an explicit value that differs from how
            their labels were sampled is refused (naming both).
        allow_mismatch: warn about such a value instead of refusing it (the caller's explicit opt-in).
        stacklevel: the frame the warning names, 1 being the caller's (as :func:`warnings.warn` counts).
    """
    given = {"temperature": temperature, "top_p": top_p}
    if enforce:
        refuse_conflicts(given, seen, "steps sampled", warn=allow_mismatch, stacklevel=stacklevel + 1)
    out = {k: v if v is not None else seen.get(k, (getattr(SamplingSpec, k),))[0] for k, v in given.items()}
    return SamplingSpec(**out)  # validated here, once
