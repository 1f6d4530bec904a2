"""What both decoders share: ``generate`` and ``stream`` over the one step loop, and the method's checks.

:class:`~semanticspec.decoder.SemanticSpecDecoder` (in-process models) and
:class:`~semanticspec.served.ServedDecoder` (two servers) differ only in how they read their
prompts and which parts they give :class:`~semanticspec.loop.StepLoop`
(:meth:`StepDecoder.step_loop`); the rounds, the decisions and the events are the loop's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch

from generation.specs import SamplingSpec
from semanticspec.config import DecodeConfig
from semanticspec.parts import SHIPPED_WINDOW, Window
from semanticspec.hf import TransformersLoop
from semanticspec.methods import Method, method_for
from semanticspec.results import DecodeResult, StepEvent, collect


class Plan(NamedTuple):
    """One call's work, every check done: the method, the inputs (the prompts as the verifier reads them, then as the
    proposer does), each prompt's stream key, the sampling and the config."""

    method: Method | TransformersLoop
    inputs: tuple[Sequence, ...]
    keys: list
    sampling: SamplingSpec
    cfg: DecodeConfig


class StepDecoder:
    """The public ``generate``/``stream`` of a decoder; subclasses plan a call and build its loop."""

    policy: Any
    target_probe: Any
    draft_probe: Any
    last_wall_s: float = 0.0
    """Wall time of the last :meth:`generate` or :meth:`stream` call (all prompts)."""
    windows: bool = True
    """The decoder can judge a window of several drafted steps per target pass (in-process: one tokenizer)."""
    spare: int
    """Context positions each row keeps free past its output (a bonus token, and in-process a judge turn)."""

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
        """
        plan = self.plan(prompts, DecodeConfig.of(config, overrides))
        return collect(self._events(plan), len(plan.keys))

    def stream(self, prompts: Sequence, config: DecodeConfig | None = None, **overrides: Any
               ) -> Iterator[StepEvent]:
        """:meth:`generate`, yielding each prompt's steps as the loop commits them (or refuses them), then its end
        event with its :class:`~semanticspec.results.DecodeResult` (:class:`~semanticspec.results.StepEvent`);
        prompts of one batch interleave round by round. Everything :meth:`generate` refuses is refused here, when
        called, before any model call or request."""
        return self._events(self.plan(prompts, DecodeConfig.of(config, overrides)))

    def plan(self, prompts, cfg: DecodeConfig) -> Plan:
        """A call's work: its method, prompts as each part reads them, stream keys, sampling and config, every check
        :meth:`generate` makes done (ValueError naming what is wrong) before any model call or request."""
        raise NotImplementedError

    def step_loop(self, batch: tuple, max_new_tokens: int, sampling: SamplingSpec, keys):
        """The :class:`~semanticspec.loop.StepLoop` of one batch (``batch``: the plan's inputs, sliced)."""
        raise NotImplementedError

    def batch_events(self, plan: Plan, batch: tuple, keys) -> Iterator[StepEvent]:
        """The events of one batch of a plan (``batch``: its inputs, sliced; ``keys``: their stream keys), prompt
        indices within the batch: the batch's step loop, run with the plan's method."""
        return self.step_loop(batch, plan.cfg.max_new_tokens, plan.sampling, keys).stream(plan.method)

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
        for s in range(0, n, bs):
            batch = tuple(x[s : s + bs] for x in plan.inputs)
            for e in self.batch_events(plan, batch, plan.keys[s : s + bs]):
                if bar is not None and e.end:
                    bar.update()
                yield dataclasses.replace(e, prompt=s + e.prompt)
        if bar is not None:
            bar.close()
        self.last_wall_s = time.perf_counter() - t0

    def row_inputs(self, inputs: tuple, k: int) -> tuple:
        """Prompt ``k`` of a plan's inputs as a loop admits it: its prompt for the verifier, then for the proposer."""
        return inputs[0][k], inputs[1][k]

    def prompt_room(self, inputs: tuple) -> int | None:
        """New tokens the first prompt of a plan's inputs leaves room for in the models' contexts (None: unknown, a
        server's count)."""
        return None

    def _batch_size(self, cfg: DecodeConfig, n: int) -> int:
        """Prompts per loop: ``cfg.batch_size``, else all ``n``."""
        return cfg.batch_size or max(n, 1)

    def _method(self, cfg: DecodeConfig) -> tuple[Method | TransformersLoop | None, list[str]]:
        """The call's method (with the config's window) and what is wrong with the call for it."""
        name = cfg.method
        try:
            method = method_for(name, self.policy)
        except ValueError as e:
            return None, [str(e)]
        needs, problems = method.policy.needs if method.policy is not None else None, []
        if needs is not None and needs.q and self.target_probe is None:
            problems.append(f"method={name!r} needs target_probe (an exported probe directory)")
        if needs is not None and needs.p and self.draft_probe is None:
            problems.append("rule='ratio' needs draft_probe for p; give one or use rule='threshold'")
        window = self._window(cfg, method)
        if window.size > 1 or window.overlap:
            why = lookahead_problem(method, name) or self._window_fits(cfg.lookahead)
            if why:
                problems.append(f"lookahead={window.size}: {why}")
            else:
                method = dataclasses.replace(method, window=window)
        return method, problems

    def _window_fits(self, lookahead: int | None) -> str | None:
        """Why a window of ``lookahead`` steps of the step spec's most tokens cannot fit the models' context after a
        one-token prompt, or None (the shipped window, None, is cut at the context as any window near its end is)."""
        room, cap = self.context_room(), self.step.max_step_tokens
        if lookahead is None or room is None or lookahead * cap <= room:
            return None
        return (f"a window of {lookahead} steps of up to {cap} tokens ({lookahead * cap}) cannot fit the "
                f"{room} new tokens the models' context leaves after a one-token prompt; use lookahead <= "
                f"{max(room // cap, 1)}")

    def context_room(self) -> int | None:
        """New tokens both models' contexts hold after a one-token prompt (None: neither context known)."""
        return self._room(1, 1)

    def _room(self, n_target: int, n_draft: int) -> int | None:
        """New tokens both models' contexts hold after prompts of these lengths (None: neither context known)."""
        rooms = [ctx - n - self.spare for n, ctx in zip((n_target, n_draft), self.contexts()) if ctx is not None]
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
        return f"method={name!r} drafts no steps for the target to judge; use lookahead=1"
    if method.policy.needs.judge:
        return (f"method={name!r} reads a judge turn after each step, which cannot share one forward with the "
                "steps after it; use lookahead=1")
    if method.policy.needs.p:
        return "the ratio rule reads the draft probe's p, which is read for one-step windows only; use lookahead=1"
    return None
