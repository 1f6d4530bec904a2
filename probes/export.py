"""Export and load probes: ``model.safetensors`` + ``config.json``, atomic, fingerprint-checked.

Nothing here unpickles: weights are safetensors, the config is JSON.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Optional

from safetensors.torch import load_file

from generation.fingerprints import model_fingerprint
from generation.paths import atomic_path
from generation.specs import layer_problems
from probes.config import FINGERPRINT_FIELDS, ROLES, NewerFormatError, OtherModelError, ProbeConfig


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
    leaves them.
    """
    path = Path(path)
    with atomic_path(path, folder=True) as tmp:
        probe.save_pretrained(tmp)
        for old in path.iterdir() if path.is_dir() else ():
            if not (tmp / old.name).exists():
                (shutil.copytree if old.is_dir() else shutil.copy2)(old, tmp / old.name)
    return path


def check_role(config: ProbeConfig, role: Optional[str], where: str = "probe") -> None:
    """Raise if a probe exported for one role is used as the other (``role=None`` checks nothing).

    Raises:
        ValueError: ``role`` is not ``target``/``draft``, or ``config.role`` differs (naming both).
    """
    if role is None:
        return
    if role not in ROLES:
        raise ValueError(f"role={role!r}: expected one of {ROLES} (or None to accept either)")
    if config.role != role:
        raise ValueError(
            f"{where} was exported with role {config.role!r} (it estimates the {config.role} model's semantic "
            f"probability) but is used as the {role} probe; pass a probe exported with role {role!r} here, "
            f"or this one as the {config.role} probe")


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
        FileNotFoundError: ``probe`` lacks ``config.json`` or ``model.safetensors``, or is one of them (the
            message says to pass the folder).
        ValueError: the role or fingerprint differs (the message names every differing field), or a
            file is unreadable or invalid: ``config.json`` not JSON, not a probe config, a field out of
            range (e.g. ``layer_ids``, ``sampling.temperature``) or a newer ``format_version`` than
            this code reads; ``model.safetensors`` truncated, not safetensors (e.g. a pickle), not the
            shapes the config describes, or holding NaN/inf. Each message names the file and field.
        TypeError: ``probe`` is neither a folder nor a probe module.
    """
    import torch

    from probes.model import resolve_probe_dtype

    if model is not None and device is None:
        device = str(next(model.parameters()).device)
    if isinstance(probe, (str, os.PathLike)):
        probe, mine = _from_folder(Path(probe), model, tokenizer, role), True
        device = device or "cpu"
    elif isinstance(probe, torch.nn.Module) and hasattr(probe, "config"):
        where = f"the {role or probe.config.role} probe"
        check_role(probe.config, role, where=where)
        if model is not None:
            check_probe_matches(probe.config, model, tokenizer, where=where)
        mine = False
    else:
        raise TypeError(f"{role or 'the'} probe must be a path or a SemanticProbe, got {type(probe).__name__}")
    here = next(probe.buffers(), next(probe.parameters(), torch.empty(0))).device
    device = here if device is None else torch.device(device)
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
    from probes.model import SemanticProbe

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
    weights = path / "model.safetensors"
    _check_header(weights, config)
    probe = SemanticProbe(config)
    probe.load_state_dict(_read_weights(weights), strict=False)  # shapes and names checked in the header
    return probe


def probe_config(path: str | os.PathLike, role: Optional[str] = None) -> ProbeConfig:
    """The config of the exported probe at ``path``, read without its weights (what :func:`load_probe` checks first).

    Raises:
        FileNotFoundError: ``path`` lacks ``config.json`` or ``model.safetensors``, or is one of them.
        ValueError: ``config.json`` is no valid probe config, or the probe's role is not ``role`` (None: any).
    """
    path = Path(path)
    if path.is_file():  # e.g. ".../target/config.json": the probe is the folder
        raise FileNotFoundError(f"{path} is a file; pass the folder of an exported probe (config.json + "
                                f"model.safetensors), e.g. {path.parent}")
    missing = [f for f in ("config.json", "model.safetensors") if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{path} is not an exported probe: missing {', '.join(missing)}")
    config = _read_config(path / "config.json")
    check_role(config, role, where=f"probe at {path}")
    return config


_REDO = "re-export the probe (probes.export.export_probe) or restore the file"
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
"""The safetensors dtypes a probe's tensors may have (an integer tensor would truncate its standardisation)."""


def _read_config(file: Path) -> ProbeConfig:
    """``config.json`` as a :class:`ProbeConfig`; every refusal names the file."""
    try:
        return ProbeConfig.from_dict(json.loads(file.read_text()))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e.msg}, line {e.lineno}); {_REDO}") from None
    except NewerFormatError as e:
        raise ValueError(f"{file}: {e}") from None
    except (ValueError, TypeError, AttributeError) as e:  # a JSON value that is no probe config
        raise ValueError(f"{file} is not a probe config: {e}; {_REDO}") from None


def _check_header(file: Path, config: ProbeConfig) -> None:
    """Compare the tensor names and shapes in ``file``'s header with those ``config`` implies, reading no tensor."""
    from safetensors import SafetensorError, safe_open

    from probes.model import expected_shapes

    try:
        with safe_open(str(file), framework="pt") as f:
            found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file} is not a readable safetensors file ({e}): truncated, or not "
                         f"safetensors (a pickled .bin/.pt renamed?); {_REDO}") from None
    expected = expected_shapes(config)
    # A probe that does not standardise reads raw inputs (identity buffers): version-1 exports did not hold them.
    optional = set() if config.standardize else {"input_mean", "input_std"}
    missing = sorted(k for k in expected if k not in found and k not in optional)
    unexpected = sorted(k for k in found if k not in expected)
    wrong = [f"{k} has shape {list(found[k])}, expected {list(v)}" for k, v in expected.items()
             if k in found and found[k] != v]
    wrong += [f"{k} is {t}, expected floating point" for k, t in dtypes.items() if t not in FLOAT_DTYPES]
    if missing or unexpected or wrong:
        what = "; ".join(wrong + [f"missing tensors {missing}"] * bool(missing)
                         + [f"unexpected tensors {unexpected}"] * bool(unexpected))
        raise ValueError(
            f"{file} does not hold the weights {file.parent / 'config.json'} describes ({what}; the config's "
            f"hidden_size={config.hidden_size}, "
            f"features={config.features}, "
            f"hidden_dims={config.hidden_dims}); {_REDO}")


def _read_weights(file: Path) -> dict:
    """The tensors of ``file`` (CPU), refusing NaN or infinite values by tensor name."""
    from safetensors import SafetensorError

    try:
        state = load_file(str(file), device="cpu")
    except SafetensorError as e:
        raise ValueError(f"{file} is not a readable safetensors file ({e}); {_REDO}") from None
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(v.isfinite().all())]
    if bad:
        raise ValueError(f"{file} holds NaN or infinite values in {bad}; the probe would refuse or accept every "
                         f"step blindly. {_REDO.capitalize()} (a diverged training exports such weights)")
    if "input_std" in state and not bool((state["input_std"] > 0).all()):
        raise ValueError(f"{file} holds an input_std that is not positive everywhere (training sets each at least "
                         f"1e-6); the probe would divide by it and score every step NaN. {_REDO.capitalize()}")
    return state
