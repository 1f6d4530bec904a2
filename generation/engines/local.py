"""`LocalEngine`: an in-process transformers causal LM behind the :class:`~generation.engines.base.Engine` protocol.

It answers what a server answers, from the same text requests, so every served path (the served
decoder, an engine-read label build) runs and is tested without a server, and served results can
be compared with in-process ones on the same weights:

- :meth:`LocalEngine.read`: one forward over ``context + step`` (tokenized as ``tokenizer(text)``
  does, BOS included); the step's tokens are those past the context's own tokens, which must be a
  prefix (a step that merges with the context's last token is refused); the step's log-probabilities
  and top-k come from the full float32 log-softmax, the hidden rows from the last ``hidden_states``
  entry (after the final norm: ``"final_norm"``), and the next token is drawn as
  :meth:`~generation.sampling.Sampler.draw` draws (greedy at temperature 0), from a
  ``torch.Generator`` seeded with ``seed``;
- :meth:`LocalEngine.write`: the core's writer (:meth:`~generation.sampling.StepWriter.write`) on a one-row
  :class:`~generation.cache.BatchedCache`, stopping at EOS, the step's delimiters (``StepSpec.stopper``),
  ``max_tokens`` or the model's context.

There is no prefix cache: every request prefills its whole prompt, and :class:`Usage` says so.
"""

from __future__ import annotations

import time

import torch

from generation.cache import BatchedCache, context_length
from generation.engines.base import Capabilities, Reading, TokenLogprobs, Usage, Written
from generation.features import topk_of_logits
from generation.handover import decode_text, pad_id
from generation.sampling import Sampler, StepWriter
from generation.specs import SamplingSpec, StepSpec, is_count
from generation.steps import ends_step


class LocalEngine:
    """An in-process transformers causal LM answering as a served one does.

    Args:
        model: a transformers causal LM (put in eval mode here; any device).
        tokenizer: its tokenizer (``tokenizer(text)`` adds BOS as the model expects).
        name: the feature source it stands for (``"transformers"``: probes trained on in-process features).
    """

    def __init__(self, model, tokenizer, name: str = "transformers") -> None:
        import transformers

        self.model, self.tokenizer, self.name = model.eval(), tokenizer, name
        self.url = f"local://{getattr(model.config, '_name_or_path', '') or type(model).__name__}"
        self.version = f"transformers {transformers.__version__}"
        self.context_length = context_length(model.config)
        """The model's context (``max_position_embeddings``), None when unknown."""
        self.device = next(model.parameters()).device

    def capabilities(self) -> Capabilities:
        """Everything: prompt log-probs with any top-k, hidden rows after the final norm."""
        return Capabilities(prompt_logprobs=True, max_top_k=None, hidden=True, hidden_norm="final_norm")

    @torch.inference_mode()
    def read(self, context: str, step: str, *, top_k: int, hidden: bool, sampling: SamplingSpec,
             seed: int) -> Reading:
        """Read ``context + step`` in one forward (see the module docstring).

        Raises:
            ValueError: an empty step, a ``top_k`` below 1, or a step whose tokens do not start at the
                context's token boundary (naming both token counts).
        """
        t0 = time.perf_counter()
        if not step:
            raise ValueError("read(step=''): expected a step of at least one character")
        if not is_count(top_k):
            raise ValueError(f"top_k={top_k!r}: expected an integer >= 1")
        ctx, full = self._ids(context), self._ids(context + step)
        if full[: len(ctx)] != ctx or len(full) == len(ctx):
            raise ValueError(f"the context's {len(ctx)} tokens are not a prefix of context + step's {len(full)} "
                             f"tokens (step {step[:40]!r}): the step's first token merges with the context's end; "
                             "cut steps at token boundaries (after a delimiter)")
        out = self.model(torch.tensor([full], device=self.device), output_hidden_states=hidden)
        logits = out.logits[0].float()
        pred = logits[len(ctx) - 1 : len(full) - 1]  # position t - 1 predicts token t
        ids = full[len(ctx) :]
        tokens = self._logprobs(pred, ids, top_k)
        rows = out.hidden_states[-1][0, len(ctx) :].float().cpu() if hidden else None
        # the token after the step, drawn as the writer draws (greedy at temperature 0)
        nxt = int(Sampler(sampling, torch.Generator().manual_seed(seed)).draw(logits[-1:].cpu(), [0])[0])
        eos = nxt == self.tokenizer.eos_token_id
        usage = Usage(len(full), 1, 0, len(full), time.perf_counter() - t0)
        return Reading(tokens, rows, "" if eos else decode_text(self.tokenizer, [nxt]), eos, usage)

    @torch.inference_mode()
    def write(self, context: str, *, step: StepSpec | None, max_tokens: int, sampling: SamplingSpec, seed: int,
              top_k: int | None = None, n: int | None = None) -> Written | list[Written]:
        """Continue ``context``: one step (``step``'s stopper) or, with ``step=None``, up to ``max_tokens`` tokens;
        ``n``: a list of ``n``, continuation ``j`` drawn with seed ``seed + j``.

        ``stop`` is ``"eos"``, ``"delimiter"`` or ``"length"`` (``max_tokens``, the step cap or the context end).

        Raises:
            ValueError: ``max_tokens`` or ``top_k`` not an integer >= 1.
        """
        if n is not None:
            return [self.write(context, step=step, max_tokens=max_tokens, sampling=sampling, seed=seed + j,
                               top_k=top_k) for j in range(n)]
        t0 = time.perf_counter()
        if not is_count(max_tokens) or (top_k is not None and not is_count(top_k)):
            raise ValueError(f"max_tokens={max_tokens!r}, top_k={top_k!r}: expected integers >= 1 (top_k may be None)")
        ids = self._ids(context)
        room = max_tokens if self.context_length is None else min(max_tokens, self.context_length - len(ids))
        new, preds = self._write(ids, room, step, sampling, seed, record=bool(top_k)) if room > 0 else ([], [])
        text = decode_text(self.tokenizer, new)
        how = "eos" if new and new[-1] == self.tokenizer.eos_token_id else \
            "delimiter" if step is not None and ends_step(text, step.delimiters) else "length"
        tokens = self._logprobs(torch.stack(preds), new, top_k) if top_k and new else None
        usage = Usage(len(ids), len(new), 0, len(ids), time.perf_counter() - t0)
        return Written(text, how, tokens, usage)

    def _write(self, ids: list[int], room: int, step: StepSpec | None, sampling: SamplingSpec, seed: int,
               record: bool) -> tuple[list[int], list[torch.Tensor]]:
        """The core's writer on a one-row cache: the new tokens (EOS, the step's stopper or ``room``) and, when
        ``record``, the logits each was drawn from."""
        eos, stop = self.tokenizer.eos_token_id, step.stopper(self.tokenizer) if step is not None else None

        def done(tokens: list[int]) -> bool:
            return tokens[-1] == eos or (stop is not None and stop(tokens))

        cache = BatchedCache(self.model, 1, pad_id(self.tokenizer))
        cache.prefill([ids])
        sampler = Sampler(sampling, torch.Generator().manual_seed(seed))
        draft = StepWriter(cache, done, sampler).write([0], {0: room}, record_logits=record)[0]
        return draft.tokens, draft.logits

    def prompt_tokens(self, texts: list[str]) -> list[int]:
        """``tokenizer(text)``'s length (BOS included where the tokenizer adds it)."""
        return [len(self._ids(t)) for t in texts]

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text).input_ids)

    def _logprobs(self, pred: torch.Tensor, ids: list[int], top_k: int) -> TokenLogprobs:
        """The tokens' log-probabilities under ``pred`` (n, V) and the top-``top_k`` of each row
        (:func:`~generation.features.topk_of_logits`, as in-process reading computes them)."""
        own, top = topk_of_logits(pred, torch.tensor(ids), top_k)
        texts = [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        return TokenLogprobs(texts, list(ids), own.cpu(), top.cpu())
