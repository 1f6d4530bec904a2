"""The world's models as f32 GGUF files, so llama.cpp (``llama-cpp-python``) can serve them.

:func:`export_gguf` writes one role's weights unquantized (float32, equal to the in-process ones; Q and
K rows permuted as llama.cpp's own ``convert_hf_to_gguf.py`` does; the tied embedding is the output
matrix, so there is no ``output.weight``). :func:`world_gguf` writes each file once into a cache
folder and writes it again when the weights, the tokenizer or this exporter change::

    python -m arithmetic_world.gguf       # target, draft and judge -> checkpoints/arithmetic/gguf/

**Why a Unigram ("t5") tokenizer.** The world's tokenizer is word-level: a regex splits text into
pieces (a number or a word with its optional leading space, ``"\\n\\n"``, ``"\\n"``, a punctuation
mark) and each piece is one token. llama.cpp reads only its own tokenizer kinds, and the other routes
do not fit:

- BPE or SentencePiece-BPE needs merges, and every merge adds an intermediate token (``" S"``,
  ``" St"``, ...) that the world's vocabulary does not have, so the vocabulary, and with it the
  models' embedding and output rows, would change;
- talking to the server in token ids does not work either: llama-cpp-python's server accepts text
  prompts only.

Unigram (llama.cpp's UGM) segments text by Viterbi over the scores of the vocabulary's pieces. With
every score equal (-1), the best segmentation is the one with the fewest tokens, and for every text
written in the world's vocabulary that is the world's own pre-split (a longer piece always beats two
shorter ones). One tie remains: a run of three or more newlines splits into as few tokens as
``"\n\n" "\n"`` or ``"\n" "\n\n"``, and Viterbi keeps the first path it finds, ``"\n" "\n\n"``,
where the world's regex takes ``"\n\n"`` first. Scores cannot break a tie between two orders of the
same tokens, so ``"\n\n"`` is typed user-defined (:data:`GREEDY`): llama.cpp splits user-defined
pieces out of the text first, leftmost, as the regex does, and Viterbi segments the rest.

Text outside the vocabulary is not covered: the world's tokenizer writes ``<unk>`` for a number above
199 (``"1234"``), llama.cpp splits it into known numbers. ``tests/arithmetic_world/test_world_gguf.py`` checks the
tokenizers agree on everything the world writes (problems, traces, the judge's prompts, its models'
samples), and that log-probs through llama.cpp equal transformers' when the KV cache is f32
(:func:`arithmetic_world.serve.world_server`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Optional

from safetensors import SafetensorError

from arithmetic_world import models
from generation.cli import fail, one_line_parser
from generation.paths import atomic_path, folder_problem

CACHE_FOLDER = "gguf"
"""Default cache: ``<world root>/gguf/`` (``checkpoints/arithmetic/gguf/`` for the shipped world, gitignored)."""
SCORE = -1.0
"""Every piece's Unigram score: equal scores make Viterbi pick the fewest tokens."""
SPACE = "\u2581"
"""SentencePiece's word-boundary mark; llama.cpp's UGM tokenizer stores spaces as this character."""
GREEDY = ("\n\n",)
"""Pieces typed user-defined: llama.cpp splits them out of the text first, leftmost, before Viterbi (see the module
docstring)."""
SOURCE_FILES = ("config.json", "model.safetensors", "tokenizer.json")
GGUF_FORMAT = 1
"""Version of what :func:`export_gguf` writes from those files; part of the cache key. Raise it with any change to
the written bytes (tensor layout, metadata, the vocabulary's token types), so cached files are written again."""


def weights_key(role: str, root: Optional[str | os.PathLike] = None) -> str:
    """Cache key of one role's GGUF: sha256 (16 hex digits) of its config, weights and tokenizer, and of
    :data:`GGUF_FORMAT`, so that a changed exporter writes the files again (an edit that changes no byte, a comment,
    does not)."""
    folder = models.model_dir(role, root)
    h = hashlib.sha256(f"gguf-format-{GGUF_FORMAT}".encode())
    for name in SOURCE_FILES:
        h.update(name.encode())
        with open(folder / name, "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
    return h.hexdigest()[:16]


def _check_config(cfg: dict, folder: Path) -> None:
    problems = []
    if cfg.get("architectures") != ["LlamaForCausalLM"]:
        problems.append(f"architectures={cfg.get('architectures')} (expected ['LlamaForCausalLM'])")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            problems.append(f"{flag}=True (expected False)")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type={rope.get('rope_type')!r} (expected 'default')")
    if problems:
        raise ValueError(f"{folder / 'config.json'}: cannot export as a plain llama GGUF: " + "; ".join(problems))


def _add_hparams(w, cfg: dict) -> None:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads", heads))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(0)  # all float32


def _add_tokenizer(w, tok, vocab_size: int) -> None:
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    if [i for _, i in vocab] != list(range(vocab_size)):
        raise ValueError(f"tokenizer ids are not 0..{vocab_size - 1} (the model's vocab_size); got {len(vocab)} tokens")
    pieces = [t for t, _ in vocab]
    if any(SPACE in p for p in pieces):
        raise ValueError(f"a vocabulary piece already holds {SPACE!r}; the UGM space mark would be ambiguous")
    # Only EOS is a control token: llama.cpp detokenizes control tokens to "", and llama-cpp-python keys its
    # top_logprobs by token text, so two control tokens in one position's top-k would collide into one key and
    # lose a log-prob. <pad>, <unk> and <bos> are user-defined instead: they read as their text, as in-process.
    control = {tok.eos_token}
    w.add_tokenizer_model("t5")  # llama.cpp's Unigram (UGM) tokenizer
    w.add_token_list([p.replace(" ", SPACE) for p in pieces])
    w.add_token_scores([SCORE] * len(pieces))
    w.add_token_types([3 if p in control else 4 if p in GREEDY or p in set(tok.all_special_tokens) else 1
                     for p in pieces])  # control, user-defined, normal
    w.add_add_space_prefix(False)
    w.add_remove_extra_whitespaces(False)
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_unk_token_id(tok.unk_token_id)
    w.add_add_bos_token(True)  # as the world's tokenizer: `tokenizer(text)` starts with <bos>
    w.add_add_eos_token(False)


def _permute(x, heads: int):
    """Q/K rows from HF's rotate-half order to llama.cpp's interleaved order (``convert_hf_to_gguf.py``)."""
    return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _add_tensors(w, weights: dict, cfg: dict) -> None:
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    heads = cfg["num_attention_heads"]
    for key, value in weights.items():
        if key == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue  # llama.cpp reuses token_embd when output.weight is absent
        name = names.get_name(key, try_suffixes=(".weight",))
        if name is None:
            raise ValueError(f"no GGUF name for tensor {key!r}")
        x = value.float().numpy()
        if key.endswith("self_attn.q_proj.weight"):
            x = _permute(x, heads)
        elif key.endswith("self_attn.k_proj.weight"):
            x = _permute(x, cfg.get("num_key_value_heads", heads))
        w.add_tensor(name, x)  # get_name keeps the ".weight" suffix


def export_gguf(role: str, out_path: str | os.PathLike, root: Optional[str | os.PathLike] = None) -> Path:
    """Write one world model as an f32 GGUF (llama architecture, Unigram tokenizer).

    Args:
        role: ``"target"``, ``"draft"`` or ``"judge"``.
        out_path: the ``.gguf`` file to write (written to a temporary name, then renamed).
        root: the world folder (default ``$SEMANTICSPEC_WORLD`` or ``checkpoints/arithmetic``).

    Returns:
        ``out_path`` as a Path.

    Raises:
        ValueError: the model is not a plain Llama or its tokenizer does not match its vocabulary.
        FileNotFoundError: the role's folder or one of its files is missing.
    """
    import gguf
    from safetensors.torch import load_file

    folder = models.model_dir(role, root)
    cfg = json.loads((folder / "config.json").read_text())
    _check_config(cfg, folder)
    out = Path(out_path)
    with atomic_path(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), "llama")
        w.add_name(f"semanticspec-arithmetic-{role}")
        w.add_string("semanticspec.weights_key", weights_key(role, root))
        _add_hparams(w, cfg)
        _add_tokenizer(w, models.load_tokenizer(root, role), cfg["vocab_size"])
        _add_tensors(w, load_file(str(folder / "model.safetensors")), cfg)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return out


def world_gguf(role: str, cache_dir: Optional[str | os.PathLike] = None,
               root: Optional[str | os.PathLike] = None) -> Path:
    """One role's GGUF, written on first use and again whenever its weights, its tokenizer or this exporter change.

    The file is ``<cache_dir>/<role>-<key>.gguf`` with the key from :func:`weights_key`; older files of
    the same role in the folder are removed when a new one is written.

    Args:
        role: ``"target"``, ``"draft"`` or ``"judge"``.
        cache_dir: folder of the cached files (default ``<world root>/gguf``: beside the weights it is made
            from, so another world root never shares a cache; ``checkpoints/arithmetic/gguf/`` is gitignored).
        root: the world folder (default ``$SEMANTICSPEC_WORLD`` or ``checkpoints/arithmetic``).

    Returns:
        The path of the GGUF file.
    """
    cache = Path(cache_dir) if cache_dir is not None else models.world_root(root) / CACHE_FOLDER
    path = cache / f"{role}-{weights_key(role, root)}.gguf"
    if path.is_file():
        return path
    export_gguf(role, path, root)
    for old in cache.glob(f"{role}-*.gguf"):
        if old != path:
            old.unlink()
    return path


def main(argv: Optional[list[str]] = None) -> None:
    ap = one_line_parser("python -m arithmetic_world.gguf", description=__doc__.split("\n\n")[0])
    ap.add_argument("--roles", nargs="+", default=list(models.ROLES), choices=models.ROLES,
                    help="the models written as GGUF files")
    ap.add_argument("--root", type=Path, default=None,
                    help="world folder (default $SEMANTICSPEC_WORLD or checkpoints/arithmetic)")
    ap.add_argument("--cache_dir", type=Path, default=None, help="where the GGUF files go (default <world root>/gguf)")
    args = ap.parse_args(argv)
    prog = "python -m arithmetic_world.gguf"
    if importlib.util.find_spec("gguf") is None:  # the [server] extra's; this module imports it where it writes
        fail(prog, "the gguf package is not installed: pip install -e \".[server]\" (or pip install gguf)")
    if args.cache_dir is not None and (problem := folder_problem(args.cache_dir, "--cache_dir")):
        fail(prog, problem)
    try:
        for role in args.roles:
            print(world_gguf(role, args.cache_dir, args.root))
    except (OSError, ValueError) as e:  # a missing or incomplete world folder, an unwritable cache
        fail(prog, str(e))
    except SafetensorError as e:  # a cut or damaged model.safetensors
        fail(prog, f"the {role} model's model.safetensors cannot be read ({e}); train or copy the world again")
    except KeyError as e:  # a config.json or tokenizer.json without a field the export writes (transformers may not
        # need it: it fills a default), each a traceback
        fail(prog, f"the {role} model's config.json or tokenizer.json has no {e}: not a world model as "
                   "`python -m arithmetic_world.train` writes it; train or copy the world again")


if __name__ == "__main__":
    main()
