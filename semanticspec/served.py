"""`ServedDecoder`: SemanticSpec's step loop over two served models (any :class:`~generation.engines.base.Engine`).

The loop is :class:`~semanticspec.loop.StepLoop`, the one the in-process decoder runs; only its parts
differ (:mod:`semanticspec.engine_parts`: one request per row of a phase, at most ``concurrency`` in
flight). Its prompts are text (the servers tokenize them), all of a call's prompts are rows of one loop,
and a row whose request fails ends with ``stop_reason="error"`` while the others go on.
"""

from __future__ import annotations

from generation.engines.checks import model_names, serving_problems, swapped_roles
from generation.sampling import key_stream
from generation.specs import is_count
from semanticspec.base import Plan, StepDecoder, load_probes, sampling_spec
from semanticspec.config import DecodeConfig
from semanticspec.engine_parts import SPARE, EngineProposer, EngineVerifier, ServedPrompt
from semanticspec.loop import StepLoop
from semanticspec.meter import Meter
from semanticspec.hf import TransformersLoop
from semanticspec.policies import ProbePolicy, check_policy, default_policy, stored_tau
from semanticspec.prompts import read_prompt_texts
from semanticspec.rows import Row


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
        self.target_probe, self.draft_probe = load_probes((target_probe, draft_probe), (None, None), (None, None),
                                                          probe_dtype)
        probes = (self.target_probe, self.draft_probe)
        self.step = self._checked_default()
        self._recorded_sampling = sampling_spec(probes)
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
                                 f"(max_model_len) is {ctx}; shorten the prompt")
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
        method = self._method(cfg)[0]
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

