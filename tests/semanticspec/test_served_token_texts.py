"""Served decoding when a server's per-token texts do not add up to its text: SGLang decodes each id alone
(``tokenizer_manager.py`` ``detokenize_logprob_tokens``, every version; vLLM 0.11 likewise), so a SentencePiece
tokenizer's dummy prefix loses the leading spaces and the bytes of a split character read as U+FFFD. The step loop
still cuts a written window into its steps and a read window into its steps' rows, and keeps the draft steps it
would keep in-process. Both tokenizers are built in code with the ``tokenizers`` library."""

import string

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from generation.engines import make_engine
from generation.specs import StepSpec
from generation.steps import DEFAULT_DELIMITERS
from semanticspec.config import DecodeConfig
from semanticspec.served import ServedDecoder
from tests.fake_engines import ScriptSGLang
from tests.semanticspec.conftest import ConstProbe

PROMPT = "Q: what is 2 × 3 + 4 ?\n\n"
STEPS = ["First, 2 × 3 = 6.\n\n", "Then 6 + 4 = 10.\n\n", "Answer: 10\n\n"]


def sentencepiece() -> Tokenizer:
    """Llama-2-like: a Metaspace pre-tokenizer with a dummy prefix ("▁" before every word), byte fallback, and a
    decoder that strips the first space (so an id decoded alone loses its leading space)."""
    chars = sorted(set(string.printable) - set(" "))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}, "▁": 259}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    merges = [("▁", c) for c in chars]
    vocab.update({"▁" + c: len(vocab) + i for i, c in enumerate(chars)})
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace("▁", prepend_scheme="always"),
                                                 pre_tokenizers.Split("\n", "isolated")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def byte_level() -> Tokenizer:
    """Qwen- and Llama-3-like byte-level BPE, trained without "×": its two bytes stay two tokens, each reading U+FFFD
    alone."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<s>", "</s>"])
    tok.train_from_iterator([(PROMPT + "".join(STEPS)).replace("×", "*").strip()] * 5, trainer)  # no "\n\n" merge
    return tok


@pytest.mark.parametrize("make", [sentencepiece, byte_level])
def test_lone_texts_are_mended_to_the_text(make):
    from generation.engines.base import spell

    tok = make()
    text = PROMPT + "".join(STEPS)
    ids = tok.encode(text).ids
    lone = [tok.decode([i]) for i in ids]
    assert "".join(lone) != text  # what the server returns does not add up
    pieces = spell(lone, text)
    assert "".join(pieces) == text and len(pieces) == len(ids)
    ends = {len(tok.decode(ids[:k])) for k in range(len(ids) + 1)}  # where the whole decode puts token boundaries
    at = 0
    for step in [PROMPT, *STEPS]:  # every step ends where the mended texts say a token ends
        at += len(step)
        assert at in ends
        assert at in {sum(len(p) for p in pieces[:k]) for k in range(len(pieces) + 1)}
    assert spell(["a", "b"], "xy") is None


@pytest.mark.parametrize("lookahead", [1, 4])
@pytest.mark.parametrize("make", [sentencepiece, byte_level])
def test_served_decoder_keeps_the_draft_steps_when_token_texts_do_not_add_up(make, lookahead):
    """A target probe that keeps every step (in-process: every draft step kept) keeps every step served, with the
    draft's window cut into its steps and the target's window read into its steps' rows."""
    tok, script = make(), PROMPT + "".join(STEPS)
    servers = [ScriptSGLang(tok, script, name) for name in ("target", "draft")]
    try:
        target, draft = (make_engine("sglang", s.root, api_key_env="", retries=1, timeout=10.0) for s in servers)
        probe = ConstProbe(8, 1.0, groups=("topk_stats",), step=StepSpec(DEFAULT_DELIMITERS, 32))
        dec = ServedDecoder(target, draft, target_probe=probe, config=DecodeConfig(answer_marker="Answer:"))
        (r,) = dec.generate([PROMPT], temperature=0.0, max_new_tokens=96, lookahead=lookahead)
        assert r.error is None and r.text == "".join(STEPS)
        assert [s.text for s in r.steps] == STEPS
        assert all(s.decision.value.startswith("accept") for s in r.steps), [s.decision for s in r.steps]
    finally:
        for s in servers:
            s.close()
