"""What a batch of prompts may be, checked before any model call.

A prompt is text, token ids already formatted (one tokenizer), or a ``(target_ids, draft_ids)``
pair (two tokenizers); a batch holds one form. Every prompt must hold at least one token, ids the
model's vocabulary knows, and fewer tokens than either model's context. A refusal is one
``ValueError`` naming the prompt's index, what is wrong, and the limit.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence

from generation.cache import context_length, vocab_size
from generation.handover import Handover

TEXT, IDS, PAIR = "text", "token ids", "a (target_ids, draft_ids) pair"


def read_prompts(prompts, handover: Handover, target, draft) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts in the target's and the draft's tokenization, or a ValueError naming the first bad one.

    Args:
        prompts: a list of prompts (a bare string is one prompt).
        handover: the pair's tokenizers.
        target: the target model (its vocabulary size and context).
        draft: the draft model.
    """
    prompts = batch(prompts, "prompts", "prompts (strings, or token ids already formatted)")
    read = [_read(i, p, handover.shared) for i, p in enumerate(prompts)]
    for i, (form, _) in enumerate(read):
        if form != read[0][0]:
            raise ValueError(f"prompt {i} is {form} but prompt 0 is {read[0][0]}: a batch holds prompts of one form; "
                             "format the text ones as ids too (e.g. Task.prompt), or decode them in separate calls")
    ids = [handover.prompt_ids(p) for _, p in read]
    for k, (name, model) in enumerate((("target", target), ("draft", draft))):
        _check_rows(name, model, [pair[k] for pair in ids])
    return [t for t, _ in ids], [d for _, d in ids]


def _read(i: int, prompt, shared: bool) -> tuple[str, object]:
    """A prompt's form and the prompt with its ids as ints; refuses what is none of the forms."""
    if prompt is None:
        raise ValueError(f"prompt {i} is None: expected a string, token ids or a (target_ids, draft_ids) pair")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"prompt {i} is empty: give the text the model continues")
        return TEXT, utf8(prompt, f"prompt {i}")
    if isinstance(prompt, tuple) and len(prompt) == 2 and all(_sequence(side) for side in prompt):
        pair = _ids(i, prompt[0]), _ids(i, prompt[1])
        if shared and pair[0] != pair[1]:  # both models would read other prompts
            raise ValueError(f"prompt {i} is a (target_ids, draft_ids) pair whose two sides differ, but this pair "
                             "shares one tokenizer, so both models read the same ids: give them once")
        return PAIR, pair
    if not _sequence(prompt):
        raise ValueError(f"prompt {i} is a {type(prompt).__name__}: expected a string, token ids or a "
                         "(target_ids, draft_ids) pair")
    ids = _ids(i, prompt)
    if not shared:
        raise ValueError(f"prompt {i} is token ids, which need one tokenizer; this pair has two, so give a "
                         "(target_ids, draft_ids) pair (SemanticSpecDecoder.prompts builds one)")
    return IDS, ids


def _sequence(x) -> bool:
    return isinstance(x, Sequence) and not isinstance(x, (str, bytes)) or hasattr(x, "tolist")


def _ids(i: int, seq) -> list[int]:
    out = []
    for j, t in enumerate(seq.tolist() if hasattr(seq, "tolist") else seq):
        try:
            if isinstance(t, bool):
                raise TypeError
            out.append(operator.index(t))
        except TypeError:
            raise ValueError(f"prompt {i} holds {t!r} at position {j}: expected an integer token id") from None
    if not out:
        raise ValueError(f"prompt {i} is empty: give at least one token id")
    return out


def _check_rows(name: str, model, rows: list[list[int]]) -> None:
    vocab, ctx = vocab_size(model.config), context_length(model.config)
    for i, row in enumerate(rows):
        if not row:
            raise ValueError(f"prompt {i} is empty in the {name}'s tokenization: give text that has tokens")
        bad = next(((j, t) for j, t in enumerate(row) if not 0 <= t < vocab), None) if vocab else None
        if bad is not None:
            raise ValueError(f"prompt {i} holds token id {bad[1]} at position {bad[0]}, outside the {name}'s "
                             f"vocabulary [0, {vocab}); ids come from the {name}'s tokenizer")
        if ctx is not None and len(row) >= ctx:
            raise ValueError(f"prompt {i} has {len(row)} tokens but the {name} model's context "
                             f"(max_position_embeddings) is {ctx}; shorten the prompt")


def read_prompt_texts(prompts) -> list[str]:
    """Prompts for servers (which tokenize them): a list of non-empty strings (a bare string is one prompt), or a
    ValueError naming the first bad one."""
    prompts = batch(prompts, "prompts", "prompt strings")
    for i, p in enumerate(prompts):
        if not isinstance(p, str) or not p:
            raise ValueError(f"prompt {i} is {p!r}: the served decoder sends text (the servers tokenize it); "
                             "give a non-empty string (Task.prompt_text formats one)")
        utf8(p, f"prompt {i}")
    return prompts


def batch(items, name: str, what: str) -> list:
    """``items`` as a list (a bare string is one item, not one per character), or a ValueError naming ``name`` and
    the value: a list, a tuple or an iterator (a generator) is a batch; a tensor, a mapping, a set (no order) or a
    number is not."""
    if isinstance(items, str):
        return [items]
    if not isinstance(items, (list, tuple, Iterator)):
        hint = " (a tensor of ids: its .tolist())" if hasattr(items, "tolist") else ""
        raise ValueError(f"{name}={items!r}: expected a list of {what}{hint}")
    return list(items)


def utf8(text: str, where: str) -> str:
    """``text``, or a ValueError when it cannot be encoded as UTF-8 (a lone surrogate), naming ``where``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where} is not valid UTF-8 text: {e.reason} at character {e.start} "
                         f"({text[e.start:e.end]!r})") from None
    return text
