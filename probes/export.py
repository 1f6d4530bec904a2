"""Export and load probes: ``model.safetensors`` + ``config.json``, atomic, fingerprint-checked.

An export is written atomically; :func:`load_probe` reads one (its files checked by :func:`probes.model.read_folder`,
which ``SemanticProbe.from_pretrained`` uses too) against the model and the role it is used in. Nothing unpickles:
weights are safetensors, the config is JSON.
"""

from __future__ import annotations

import copy
import os
import shutil
import warnings
from pathlib import Path
from typing import Optional

from generation.fingerprints import model_fingerprint
from generation.paths import atomic_path
from generation.specs import layer_problems
from probes.config import FINGERPRINT_FIELDS, OtherModelError, ProbeConfig
from probes.model import check_role, probe_config, read_folder


def check_probe_matches(config: ProbeConfig, model, tokenizer=None, where: str = "probe") -> None:
    """Raise if a probe with ``config`` cannot read ``model``'s hidden states: it was exported for another model
    (:class:`~probes.config.OtherModelError`, naming each differing field), it reads layers the model does not have,
    or it reads hidden states of another source than a transformers model after its final norm, a server's say
    (ValueError, naming the ids and the range, or both sources).

    Used by :func:`load_probe` (the decoders' loader) and by the live-validation callback and the evaluation, which
    check a probe against models they load themselves.
    """
    actual, reads = model_fingerprint(model, tokenizer), config.reads
    problems = [f"{k}: probe has {reads[k]!r}, model has {actual[k]!r}" for k in FINGERPRINT_FIELDS
                if k in reads and k in actual and reads[k] != actual[k]]  # the checked fields both sides know
    if config.hidden_size != actual["hidden_size"] and not any(p.startswith("hidden_size") for p in problems):
        problems.append(f"hidden_size: probe has {config.hidden_size!r}, model has {actual['hidden_size']!r}")
    if problems:
        raise OtherModelError(
            f"{where} was exported for another model ({config.reads.get('name_or_path') or 'unknown'}); "
            + "; ".join(problems)
            + ". Export a probe for this model or load the matching one."
        )
    layers = layer_problems(list(config.features.layer_ids), actual["num_layers"])
    if layers:
        raise ValueError(f"{where} reads layers the model does not have (features.layer_ids): " + "; ".join(layers))
    config.features.check_source("transformers", "final_norm", where=where)


def export_probe(probe, path: str | os.PathLike) -> Path:
    """Write ``probe`` to ``path`` (``model.safetensors``, ``config.json``, model card) atomically.

    The files are written into a temporary sibling directory that then replaces ``path``, so an
    interrupted export leaves either the old probe or the new one, never half of one. Files of an existing ``path``
    that the export does not write (a user's notes, say) are carried over, as ``save_pretrained`` into a folder
    leaves them. The paths the config records are made portable (:func:`~probes.model.portable_config`).

    Raises:
        ValueError: ``path`` is a file.
    """
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is a file; export a probe into a folder (made if missing)")
    with atomic_path(path, folder=True) as tmp:
        probe.save_pretrained(tmp)
        for old in path.iterdir() if path.is_dir() else ():
            if not (tmp / old.name).exists():
                (shutil.copytree if old.is_dir() else shutil.copy2)(old, tmp / old.name)
    return path


def load_probe(probe, model=None, tokenizer=None, device: Optional[str] = None, role: Optional[str] = None,
               dtype: Optional[str] = None):
    """An exported probe (or a probe already in memory), checked against the model it reads and the role it is used
    in: the one way the decoders, the endpoint and the evaluation take a probe.

    From a folder, nothing is allocated before the config is valid and the weights file's header holds exactly the
    tensor shapes the config implies.

    Args:
        probe: the folder holding ``config.json`` and ``model.safetensors``, or a
            :class:`~probes.model.SemanticProbe`, checked the same way: returned as it is when it already is in
            eval mode, on ``device`` and in ``dtype``, else as a converted copy (a module being trained is never
            changed).
        model: the transformers model the probe will read: its fingerprint must match, ``layer_ids`` must index its
            hidden states, and a probe reading hidden states must have been trained on a transformers model's
            (:func:`check_probe_matches`). None checks none of this (a served model: its server's capabilities are
            checked before its first request).
        tokenizer: that model's tokenizer; its vocabulary hash must match when given.
        device: where to put the probe; default the model's device, else CPU for a folder (a module stays where it
            is).
        role: the role the caller uses the probe in (``"target"`` or ``"draft"``); a probe exported with the other
            role is refused. None accepts either.
        dtype: the MLP's dtype, ``"auto"``, ``"float32"`` or ``"float16"``
            (:func:`~probes.model.resolve_probe_dtype`); None keeps the probe's own (an export's is float32).

    Returns:
        The :class:`~probes.model.SemanticProbe`, in eval mode.

    Raises:
        FileNotFoundError: ``probe`` does not exist, lacks ``config.json`` or ``model.safetensors``, or is one of
            them (the message says to pass the folder).
        ValueError: the role or fingerprint differs (the message names every differing field), or a
            file is unreadable or invalid: ``config.json`` not JSON, not a probe config, a field out of
            range (e.g. ``layer_ids``, ``sampling.temperature``) or a newer ``format_version`` than
            this code reads; ``model.safetensors`` truncated, not safetensors (e.g. a pickle), not the
            shapes the config describes, or holding NaN/inf. Each message names the file and field.
        TypeError: ``probe`` is neither a folder nor a probe module.
    """
    import torch

    from probes.model import resolve_probe_dtype

    from generation.loading import checked_device

    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected the transformers model the probe reads, got {type(model).__name__}")
    if tokenizer is not None and not hasattr(tokenizer, "get_vocab"):
        raise TypeError(f"tokenizer: expected the model's tokenizer, got {type(tokenizer).__name__}")
    if device is not None:
        device = checked_device(device, "device")
    elif model is not None:
        device = next(model.parameters()).device
    if isinstance(probe, (str, os.PathLike)):
        probe, mine = _from_folder(Path(probe).expanduser(), model, tokenizer, role), True
        device = device or torch.device("cpu")
    elif isinstance(probe, torch.nn.Module) and hasattr(probe, "config"):
        where = f"the {role or probe.config.role} probe"
        check_role(probe.config, role, where=where)
        if model is not None:
            check_probe_matches(probe.config, model, tokenizer, where=where)
        mine = False
    else:
        raise TypeError(f"{role or 'the'} probe must be a path or a SemanticProbe, got {type(probe).__name__}")
    here = next(probe.buffers(), next(probe.parameters(), torch.empty(0))).device
    device = here if device is None else device
    want = None if dtype is None else resolve_probe_dtype(dtype, device)  # inputs stay float32 (SemanticProbe.predict)
    want = None if getattr(probe, "mlp_dtype", want) == want else want
    if not mine and (probe.training or device != here or want is not None):
        probe = copy.deepcopy(probe)  # the caller's module (one being trained, say) is left as it was
    probe = probe.to(device).eval()
    if want is not None:
        probe.mlp.to(want)
    return probe


def _from_folder(path: Path, model, tokenizer, role: Optional[str]):
    """The probe exported at ``path`` (CPU), its config, header and weights checked before and as it loads."""
    config = probe_config(path, role)
    if model is not None:
        if not any(k in config.reads for k in FINGERPRINT_FIELDS):  # an old export: only the width can be checked
            warnings.warn(
                f"{path / 'config.json'} records no `reads` fingerprint, so this probe cannot be checked against "
                f"the model it is given (only hidden_size={config.hidden_size} is); re-export it to record "
                f"the model it reads",
                UserWarning,
                stacklevel=3,
            )
        check_probe_matches(config, model, tokenizer, where=f"probe at {path}")
    return read_folder(path, config)
