"""The word-level tokenizer shared by the world's target, draft and judge.

Every number 0-199 and every word of the world's templates is one token, with or without a
leading space (as GPT-style byte-level tokenizers do), so ``decode(encode(text)) == text`` for
all text the world writes. Blank lines are tokens too: ``"\\n\\n"`` is the step delimiter. Encoding adds ``<bos>`` in
front (as Llama tokenizers do); pass ``add_special_tokens=False`` to encode a continuation.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from arithmetic_world import task

if TYPE_CHECKING:  # transformers loads when a tokenizer is built, not with the world's registration
    from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<unk>", "<bos>", "<eos>"]
MAX_NUMBER = 199
JUDGE_TEMPLATE = "Step A: {a}\nStep B: {b}\nSame meaning?"
"""Prompt of the world's equivalence judge; the model answers `` yes`` or `` no``."""
PIECE = r" ?[A-Za-z]+| ?\d+|\n\n|\n| ?[^\sA-Za-z\d]"


def _words() -> list[str]:
    texts = [t for ts in task.TEMPLATES.values() for t in ts]
    texts += list(task.PROBLEM_OPS.values()) + list(task.PROBLEM_OPENERS) + list(task.PROBLEM_QUESTIONS)
    texts += [task.ANSWER_MARKER, JUDGE_TEMPLATE, " yes no Yes No", "Add Subtract Multiply then , . ? :"]
    pieces = {p.strip() for t in texts for p in re.findall(PIECE, re.sub(r"\{\w\}", "", t)) if p.strip()}
    pieces |= {str(i) for i in range(MAX_NUMBER + 1)}
    return sorted(pieces)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Build the world's tokenizer in code (deterministic vocabulary order)."""
    from transformers import PreTrainedTokenizerFast

    vocab_list = SPECIALS + ["\n\n", "\n", " "] + [v for w in _words() for v in (w, " " + w)]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(vocab_list))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PIECE), behavior="isolated")
    tok.decoder = decoders.Fuse()
    # Like Llama tokenizers: `tokenizer(text)` starts with <bos>; pass add_special_tokens=False for continuations.
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
    )
