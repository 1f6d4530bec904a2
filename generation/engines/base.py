"""What a served model returns, engine-neutral, and the protocol every engine client implements.

A verifier sends context + step and gets the step's per-token log-probabilities with their top-k
(:class:`TokenLogprobs`), optionally the last layer's hidden rows, and the token after the step
(:class:`Reading`). A proposer asks the server to write a step (:class:`Written`). Every answer
carries the server's own usage figures (:class:`Usage`). What an engine can serve is declared by
:class:`Capabilities` and checked before any decoding or sampling starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from generation.specs import SamplingSpec, StepSpec


@dataclass(frozen=True)
class Usage:
    """One request's cost, from the server's usage fields (and the client's clock).

    Attributes:
        prompt_tokens: prompt tokens the server counted.
        completion_tokens: tokens it generated.
        cached_tokens: prompt tokens served from its prefix cache, when the engine reports it (else None).
        prefill_tokens: prompt tokens it computed (``prompt_tokens - cached_tokens``), when known.
        seconds: the request's wall time on the client, HTTP included.
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None
    prefill_tokens: int | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities an engine returned for a run of tokens (raw distribution, temperature 1).

    Attributes:
        tokens: the tokens' texts as the engine reports them.
        ids: their ids when the engine reports them (vLLM, SGLang), else None.
        logprobs: (n,) each token's own log-probability.
        top: (n, k) the k largest log-probabilities at each position, descending.
    """

    tokens: list[str]
    ids: list[int] | None
    logprobs: torch.Tensor
    top: torch.Tensor

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if self.logprobs.shape != (n,) or self.top.ndim != 2 or self.top.shape[0] != n:
            raise ValueError(f"{n} tokens with logprobs of shape {tuple(self.logprobs.shape)} and top-k of shape "
                             f"{tuple(self.top.shape)}; expected ({n},) and ({n}, k)")

    def span(self, a: int, b: int | None = None) -> TokenLogprobs:
        """The tokens ``a`` to ``b - 1`` (to the end when ``b`` is None), everything about them kept."""
        ids = self.ids[a:b] if self.ids is not None else None
        return TokenLogprobs(self.tokens[a:b], ids, self.logprobs[a:b], self.top[a:b])

    def join(self, after: TokenLogprobs) -> TokenLogprobs:
        """These tokens, then ``after``'s (the same k; ids where both have them)."""
        ids = self.ids + after.ids if self.ids is not None and after.ids is not None else None
        return TokenLogprobs(self.tokens + after.tokens, ids, torch.cat([self.logprobs, after.logprobs]),
                             torch.cat([self.top, after.top]))


@dataclass(frozen=True)
class Reading:
    """What a server returned for context + step, read in one request.

    Attributes:
        step: the step's tokens (the first one predicted by the context's last position).
        hidden: (n, D) float32 last-layer rows of the step's tokens (SGLang only), else None.
        next_text: the token after the step, drawn by the server (the bonus token), "" at EOS.
        next_eos: the token after the step is the end of sequence.
        usage: the request's usage.
    """

    step: TokenLogprobs
    hidden: torch.Tensor | None
    next_text: str
    next_eos: bool
    usage: Usage


@dataclass(frozen=True)
class Written:
    """A step (or a longer continuation) a server wrote.

    Attributes:
        text: what it wrote, the matched delimiter included (put back when the server trims it).
        stop: ``"delimiter"``, ``"eos"`` or ``"length"`` (the ``max_tokens`` cap).
        tokens: the written tokens' log-probabilities, when asked for (the draft probe reads them).
        usage: the request's usage.
    """

    text: str
    stop: str
    tokens: TokenLogprobs | None
    usage: Usage


@dataclass(frozen=True)
class Capabilities:
    """What an engine can give the package.

    Attributes:
        prompt_logprobs: log-probabilities of prompt tokens (what a verifier and a reader need).
        max_top_k: the largest top-k it returns per position (vLLM: ``--max-logprobs``), None = no cap.
        hidden: it returns the last layer's hidden rows.
        hidden_norm: their norm convention (``"final_norm"``: after the model's final norm, as
            transformers' last ``hidden_states`` entry; ``"pre_norm"``: before it), when ``hidden``.
        remarks: why something is missing and how to get it, one sentence each (shown when refused).
    """

    prompt_logprobs: bool
    max_top_k: int | None
    hidden: bool
    hidden_norm: str | None
    remarks: tuple[str, ...] = ()


def spell(pieces: list[str], text: str) -> list[str] | None:
    """Per-token texts that add up to ``text``: ``pieces`` themselves when they do, else ``pieces`` as engines decode
    each id alone, mended; None when they cannot be.

    SGLang (``tokenizer_manager.py`` ``detokenize_logprob_tokens``, every version) and vLLM 0.11 decode each id alone:
    a SentencePiece tokenizer's dummy prefix drops the leading spaces, and the bytes of a character split over several
    tokens read as U+FFFD. ``text`` (which the server decodes whole) holds what they lost: each piece takes the spaces
    before it, and a run of tokens reading U+FFFD takes the characters up to where the next piece starts, all on its
    last token (a step never ends inside a character: delimiters are ASCII).
    """
    if "".join(pieces) == text:
        return list(pieces)
    out, pos, i = [], 0, 0
    while i < len(pieces):
        if "\ufffd" in pieces[i]:  # bytes of split characters, up to where the next piece starts
            j = i
            while j < len(pieces) and "\ufffd" in pieces[j]:
                j += 1
            end = next((k for k in range(pos + 1, len(text) + 1) if j == len(pieces) and k == len(text)
                        or j < len(pieces) and text.startswith(pieces[j], _spaces(text, k, pieces[j]))), None)
            if end is None:
                return None
            out += [""] * (j - i - 1) + [text[pos:end]]
            pos, i = end, j
            continue
        k = _spaces(text, pos, pieces[i])
        if not text.startswith(pieces[i], k):
            return None
        out.append(text[pos:k + len(pieces[i])])
        pos, i = k + len(pieces[i]), i + 1
    return out if pos == len(text) else None


def _spaces(text: str, at: int, piece: str) -> int:
    """Where ``piece`` starts in ``text`` from ``at``, past the spaces a lone decode dropped (``at`` when it is
    there)."""
    k = at
    while not text.startswith(piece, k) and k < len(text) and text[k] == " ":
        k += 1
    return k


class EngineError(RuntimeError):
    """A server died, refused or timed out (after the client's retries), or cannot serve what is asked.

    The message names the server's URL, never its API key.

    Attributes:
        url: the server's base URL.
    """

    def __init__(self, message: str, url: str):
        super().__init__(message)
        self.url = url


class Unreachable(EngineError):
    """A request failed after the client's retries: no answer, a timeout, a refused key or an HTTP error."""


class Refused(EngineError):
    """The server answered the request with a client error (400, 413, 422: a prompt past its context, a budget it
    refuses): the caller's to fix, not retried, and passed on as such (the endpoint answers 400).

    Attributes:
        status: the HTTP status.
        param: the field the server's error JSON names, if any.
    """

    def __init__(self, message: str, url: str, status: int, param: str | None = None):
        super().__init__(message, url)
        self.status, self.param = status, param


class Unsupported(EngineError):
    """The server answers, but its version or its flags cannot serve what is asked (refused before any request
    that decodes or builds, naming the URL, what it has, what is needed and the fix)."""


class MalformedAnswer(EngineError):
    """A server answered, but short or malformed (fewer top-k entries than asked, missing rows or fields).

    Refused with the counts, naming the URL and the field (never the key); an answer is never padded.
    """


class Engine(Protocol):
    """A client of one server serving one model."""

    name: str
    """``"sglang"``, ``"vllm"`` or ``"llama.cpp"``."""
    url: str
    version: str | None
    context_length: int | None
    """The tokens a request may fill, where the server states its context (vLLM's and SGLang's ``/v1/models``
    ``max_model_len``; SGLang's less what its reads ask for past a request's input) or is told it (llama.cpp's
    ``n_ctx``), else None: the decoders cap a row's steps at the room it leaves."""

    def capabilities(self) -> Capabilities:
        """What this server can give (asked once, before any decoding or sampling)."""

    def prompt_tokens(self, texts: list[str]) -> list[int] | None:
        """How many tokens the server makes of each text as a prompt (BOS included where it adds one), from its own
        tokenizer; None from a server that states no ``context_length`` (nothing needs the count there)."""

    def read(self, context: str, step: str, *, top_k: int, hidden: bool, sampling: SamplingSpec,
             seed: int) -> Reading:
        """Read ``context + step`` in one request: the step's log-probs (top-``top_k``), hidden rows when
        ``hidden``, and the next token drawn with ``sampling`` and ``seed``."""

    def write(self, context: str, *, step: StepSpec | None, max_tokens: int, sampling: SamplingSpec, seed: int,
              top_k: int | None = None, n: int | None = None) -> Written | list[Written]:
        """Continue ``context``: one step (stop at ``step``'s delimiters, at most ``max_tokens``), or, with
        ``step=None``, up to ``max_tokens`` tokens; ``top_k``: also return the written tokens' log-probs. ``n``: a
        list of ``n`` continuations, continuation ``j`` drawn with seed ``seed + j`` (as vLLM seeds the children of
        an ``n`` request), in one request where the engine takes ``n``; a request's usage on its first one."""
