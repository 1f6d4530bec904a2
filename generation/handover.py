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
