"""Export and load probes: ``model.safetensors`` + ``config.json``, atomic, fingerprint-checked.

Nothing here unpickles: weights are safetensors, the config is JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional

from safetensors.torch import load_file

from generation.fingerprints import model_fingerprint
from probes.config import FINGERPRINT_FIELDS, ProbeConfig


def fingerprint_mismatches(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """``"field: probe has X, model has Y"`` for every checked field both sides know and that differs."""
    return [
        f"{k}: probe has {expected[k]!r}, model has {actual[k]!r}"
        for k in FINGERPRINT_FIELDS
        if k in expected and k in actual and expected[k] != actual[k]
    ]


def check_probe_matches(config: ProbeConfig, model, tokenizer=None, where: str = "probe") -> None:
    """Raise if a probe with ``config`` cannot read ``model``'s hidden states, naming each differing field.

    Used by :func:`load_probe` and by every consumer handed a probe object (decoder, callback).
    """
    actual = model_fingerprint(model, tokenizer)
    problems = fingerprint_mismatches(config.reads, actual)
    if config.hidden_size != actual["hidden_size"] and not any(p.startswith("hidden_size") for p in problems):
        problems.append(f"hidden_size: probe has {config.hidden_size!r}, model has {actual['hidden_size']!r}")
    if problems:
        raise ValueError(
            f"{where} was exported for another model ({config.reads.get('name_or_path') or 'unknown'}); "
            + "; ".join(problems)
            + ". Export a probe for this model or load the matching one."
        )


def export_probe(probe, path: str | os.PathLike) -> Path:
    """Write ``probe`` to ``path`` (``model.safetensors``, ``config.json``, model card) atomically.

    The files are written into a temporary sibling directory that then replaces ``path``, so an
    interrupted export leaves either the old probe or the new one, never half of one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        probe.save_pretrained(tmp)
        _umask_modes(tmp)
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _umask_modes(folder: Path) -> None:
    """Give ``folder`` and its files the modes a plain mkdir/open would (mkdtemp makes 0700, some writers 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        os.chmod(f, 0o666 & ~umask)


def load_probe(path: str | os.PathLike, model=None, tokenizer=None, device: Optional[str] = None):
    """Load an exported probe, refusing one that was exported for another model.

    Args:
        path: directory holding ``config.json`` and ``model.safetensors``.
        model: the transformers model the probe will read; its fingerprint must match.
        tokenizer: that model's tokenizer; its vocabulary hash must match when given.
        device: where to put the probe (default CPU).

    Returns:
        The :class:`~probes.model.SemanticProbe`, in eval mode.

    Raises:
        FileNotFoundError: ``path`` lacks ``config.json`` or ``model.safetensors``.
        ValueError: the fingerprint differs (the message names every differing field), or a file
            is unreadable: ``config.json`` not JSON or not a probe config, ``model.safetensors``
            truncated, not safetensors (e.g. a pickle) or not the shapes the config describes. Each
            message names the file.
    """
    from safetensors import SafetensorError

    from probes.model import SemanticProbe

    path = Path(path)
    missing = [f for f in ("config.json", "model.safetensors") if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{path} is not an exported probe: missing {', '.join(missing)}")
    redo = "re-export the probe (probes.export.export_probe) or restore the file"
    try:
        config = ProbeConfig.from_dict(json.loads((path / "config.json").read_text()))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / 'config.json'} is not valid JSON ({e.msg}, line {e.lineno}); {redo}") from None
    except (ValueError, TypeError, AttributeError) as e:  # a JSON value that is no probe config
        raise ValueError(f"{path / 'config.json'} is not a probe config: {e}; {redo}") from None
    if model is not None:
        if not any(k in config.reads for k in FINGERPRINT_FIELDS):  # an old export: only the width can be checked
            warnings.warn(
                f"{path / 'config.json'} records no `reads` fingerprint, so this probe cannot be checked against the model "
                f"it is given (only hidden_size={config.hidden_size} is); re-export it to record the model it reads",
                UserWarning,
                stacklevel=2,
            )
        check_probe_matches(config, model, tokenizer, where=f"probe at {path}")
    probe = SemanticProbe(config)
    try:
        state = load_file(str(path / "model.safetensors"), device="cpu")
    except SafetensorError as e:
        raise ValueError(f"{path / 'model.safetensors'} is not a readable safetensors file ({e}): truncated, or not "
                         f"safetensors (a pickled .bin/.pt renamed?); {redo}") from None
    # Version-1 exports predate the standardisation buffers; they read raw inputs (identity buffers).
    optional = {"input_mean", "input_std"} if config.format_version < 2 else set()
    try:
        missing, unexpected = probe.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor of another shape
        raise ValueError(f"{path / 'model.safetensors'} does not hold the weights {path / 'config.json'} describes "
                         f"({str(e).splitlines()[-1].strip()}); {redo}") from None
    missing = [k for k in missing if k not in optional]
    if missing or unexpected:
        raise ValueError(f"{path / 'model.safetensors'} does not hold the weights {path / 'config.json'} describes "
                         f"(missing tensors {missing}, unexpected tensors {unexpected}); {redo}")
    return probe.to(device or "cpu").eval()
