"""Step handover between two models: one tokenizer (tokens as they are) or two (text re-tokenized).

A shared tokenizer hands tokens over unchanged, so the target's *bonus* token can open the draft's
next step and the top-k fast path can compare token ids. Two tokenizers hand a step over as its
text, cut at the same delimiters, which each model tokenizes in its own vocabulary. The decoder
and the label build (a draft step as the target reads it) both hand steps over with :class:`Handover`.
"""

from __future__ import annotations

from generation.fingerprints import tokenizer_hash


def pad_id(tok) -> int:
    """The id fed in unused slots: the pad token, else EOS, else 0."""
    return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)


def decode_text(tok, tokens) -> str:
    """Text of ``tokens`` up to EOS, special tokens dropped."""
    eos = tok.eos_token_id
    tokens = list(tokens)
    if eos is not None and eos in tokens:
        tokens = tokens[: tokens.index(eos)]
    return tok.decode(tokens, skip_special_tokens=True)


PARTIAL = "\ufffd"
"""What a tokenizer decodes the bytes of an unfinished character to (U+FFFD, the replacement character)."""


def text_delta(decode, ids: list[int], shown: tuple[int, int], flush: bool = False) -> tuple[str, tuple[int, int]]:
    """The text ``ids`` add past what was shown, up to their last whole character, and the new ``shown`` offsets:
    vLLM's incremental detokenization. A character whose bytes are split over two tokens (an emoji in a byte-level
    vocabulary) comes whole with the call that completes it instead of as U+FFFD twice.

    Args:
        decode: token ids to text.
        ids: all ids so far.
        shown: ``(prefix, read)``: text is shown up to ``ids[:read]``; ``ids[prefix:read]`` is decoded beside the
            new ids so that a tokenizer spaces them as it would in one text. ``(0, 0)`` at the start.
        flush: show every id (the output ends): an unfinished character is shown as the tokenizer decodes it.
    """
    prefix, read = shown
    before = decode(ids[prefix:read])
    for end in range(len(ids), max(read, len(ids) - 3) - 1, -1):  # a UTF-8 character is 4 bytes at most
        text = decode(ids[prefix:end])
        if flush or not text.endswith(PARTIAL) or end == read:
            break
    else:  # no end within a character's bytes is whole (the text holds U+FFFD itself): show it as it is
        text, end = decode(ids[prefix:]), len(ids)
    if end == read or len(text) <= len(before):
        return "", shown
    return text[len(before):], (read, end)


def whole_prefix(tok, ids) -> int:
    """How many of a step's ``ids`` end at its last whole character: fewer when the step's cap cut inside a character
    (its last ids an emoji's first bytes in a byte-level vocabulary); all of them when it ends whole, holds EOS or
    holds no whole character. Two tokenizers hand a step over as the text of these ids (the decoder and the label
    build), so the other model never reads U+FFFD for a character its writer had not finished."""
    ids = list(ids)
    if tok.eos_token_id in ids:
        return len(ids)
    _, (_, end) = text_delta(lambda x: decode_text(tok, x), ids, (0, 0))
    return end or len(ids)


def adds_bos(tok) -> bool:
    """Whether ``tok(text)`` starts with its BOS token (Gemma, Llama: yes; SmolLM2, whose BOS is its chat
    template's ``<|im_start|>``: no)."""
    bos = tok.bos_token_id
    return bos is not None and tok("a").input_ids[:1] == [bos]


def prompt_text(tok, ids) -> str:
    """Token ids as the text a server is sent: a server tokenizes text as the model's tokenizer does, adding BOS
    exactly when it adds one, so a leading BOS is dropped for such a tokenizer; special tokens stay as text."""
    ids = list(ids)
    if ids and ids[0] == tok.bos_token_id and adds_bos(tok):
        ids = ids[1:]
    return tok.decode(ids, skip_special_tokens=False)


class Handover:
    """How a step written by one model enters the other's context.

    Args:
        tokenizer: the target's tokenizer.
        draft_tokenizer: the draft's, or None when it shares the target's. One with the target's vocabulary and
            special tokens (the same :func:`~generation.fingerprints.tokenizer_hash`, as the label build tells them
            apart) is shared: the target's tokenizer serves both, and tokens pass unchanged.
    """

    def __init__(self, tokenizer, draft_tokenizer=None) -> None:
        self.tokenizer = tokenizer
        self.shared = draft_tokenizer is None or draft_tokenizer is tokenizer \
            or tokenizer_hash(draft_tokenizer) == tokenizer_hash(tokenizer)
        self.draft_tokenizer = tokenizer if self.shared else draft_tokenizer

    def to_target(self, step, text: str) -> list[int]:
        """A draft step (``tokens``, ``n_forced``) as new target tokens (its forced bonus token excluded)."""
        if self.shared:
            return list(step.tokens[step.n_forced :])
        return self.text_to_target(text)

    def text_to_target(self, text: str) -> list[int]:
        """A draft step's text in the target's tokenization (two tokenizers: no special tokens added)."""
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def to_draft(self, new_tokens: list[int], text: str) -> list[int]:
        """The target's step (its new tokens and text) as draft tokens."""
        if self.shared:
            return list(new_tokens)
        return self.draft_tokenizer(text, add_special_tokens=False).input_ids

    def forced_in_target(self, step) -> int:
        """Leading tokens of the draft's step that the target wrote (its bonus token; none across tokenizers)."""
        return step.n_forced if self.shared else 0

    def prompt_ids(self, prompt) -> tuple[list[int], list[int]]:
        """A prompt in the target's and the draft's tokenization: a string (tokenized with special tokens),
        token ids already formatted (one tokenizer), or a ``(target_ids, draft_ids)`` pair (two)."""
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt).input_ids
            return ids, (ids if self.shared else self.draft_tokenizer(prompt).input_ids)
        if isinstance(prompt, tuple) and len(prompt) == 2:
            return list(prompt[0]), list(prompt[1])
        if self.shared and all(isinstance(t, int) for t in prompt):
            return list(prompt), list(prompt)
        raise TypeError(f"a prompt is a string, token ids (one tokenizer) or a (target_ids, draft_ids) pair (two); "
                        f"got {type(prompt).__name__} {str(prompt)[:60]!r}")
