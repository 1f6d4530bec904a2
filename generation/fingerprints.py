"""Fingerprints of a model and its tokenizer, and of files: what a probe or a data directory records about what it
was made from.

Imported downward by the exports (``probes.model``), the label build's manifest and shards
(``datamodules.labels.config``, ``datamodules.labels.shards``) and the tasks (a problem file's hash), so all describe
a model or a file the same way.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def weights_stamp(folder: str | os.PathLike, pieces: int = 64, piece: int = 1 << 16) -> str:
    """Cheap content stamp of a model folder's weights (``*.safetensors``, ``*.bin``): sha256 (first 16 hex digits) of
    each file's name and size and of ``pieces`` pieces of ``piece`` bytes spread evenly from its start to its end (the
    whole file when it is no larger), so a model retrained in place, even in a few of its layers, gets another stamp
    without its gigabytes being read. A folder without weights files has one fixed stamp. Files unchanged since this
    process last stamped them (path, size, inode, mtime) are not read again: a fit asks for its models' stamps more
    than once."""
    files = sorted(Path(folder).glob("*.safetensors")) + sorted(Path(folder).glob("*.bin"))
    stats = [(str(f.absolute()), (st := f.stat()).st_size, st.st_ino, st.st_mtime_ns) for f in files]
    return _stamp(tuple(stats), pieces, piece)


@functools.lru_cache(maxsize=64)
def _stamp(files: tuple, pieces: int, piece: int) -> str:
    h = hashlib.sha256()
    for path, size, _, _ in files:
        h.update(f"{Path(path).name}:{size}".encode())
        with open(path, "rb") as fh:
            if size <= pieces * piece:
                h.update(fh.read())
                continue
            for k in range(pieces):
                fh.seek(k * (size - piece) // (pieces - 1))
                h.update(fh.read(piece))
    return h.hexdigest()[:16]


def tokenizer_hash(tokenizer) -> str:
    """sha256 (first 16 hex digits) of the tokenizer's vocabulary and special tokens."""
    vocab = sorted(tokenizer.get_vocab().items())
    blob = json.dumps([vocab, sorted(map(str, tokenizer.all_special_tokens))], ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def model_fingerprint(model, tokenizer=None) -> dict[str, Any]:
    """What a probe needs to know about the model it reads.

    Returns ``{"name_or_path", "architecture", "hidden_size", "num_layers", "vocab_size",
    "tokenizer_hash"}`` (the last only with a tokenizer).
    """
    cfg = model.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    fp = {
        "name_or_path": str(getattr(cfg, "_name_or_path", "") or ""),
        "architecture": (getattr(cfg, "architectures", None) or [type(model).__name__])[0],
        "hidden_size": int(text_cfg.hidden_size),
        "num_layers": int(text_cfg.num_hidden_layers),
        "vocab_size": int(text_cfg.vocab_size),
    }
    if tokenizer is not None:
        fp["tokenizer_hash"] = tokenizer_hash(tokenizer)
    return fp
