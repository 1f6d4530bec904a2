"""What a decoder loads before its first call: its probes, checked against the models they read, and the threshold
the evaluation picked for them."""

from __future__ import annotations

import copy
import os
import warnings

import torch

from generation.specs import FEATURE_GROUPS, TOKEN_STATS, TOPK_STATS, is_real, require_features


def load(probe, model, tokenizer, role: str | None = None, probe_dtype: str = "float32"):
    """A probe directory, a ``SemanticProbe`` or None, checked against the model it reads and the role it is used in,
    with its MLP in the dtype ``probe_dtype`` resolves to on its device.

    Args:
        probe: exported probe directory, ``SemanticProbe``, or None (returned as is).
        model: the model whose hidden states the probe reads (fingerprint and ``layer_ids`` checked), or None for a
            served model (its weights cannot be fingerprinted here; the server's capabilities are checked before the
            first request instead).
        tokenizer: that model's tokenizer (None with no model).
        role: ``"target"`` or ``"draft"``: the slot the probe fills; a probe exported with the other
            role is refused, naming both. None checks no role.
        probe_dtype: ``"auto"``, ``"float32"`` or ``"float16"`` (:func:`~probes.model.resolve_probe_dtype`,
            which refuses a bad value even without a probe).

    Raises:
        ValueError: wrong role, another model's probe, layers the model lacks, features the
            decoder cannot compute, or hidden states read from another source or norm convention.
        TypeError: ``probe`` is none of the above.
    """
    from probes.model import resolve_probe_dtype

    if probe is None:
        resolve_probe_dtype(probe_dtype, torch.device("cpu"))  # a bad value is refused without a probe too
        return None
    from probes.export import check_probe_matches, check_role, load_probe

    device = str(next(model.parameters()).device) if model is not None else None
    if isinstance(probe, (str, os.PathLike)):
        probe = load_probe(probe, model, tokenizer, device=device, role=role) if model is not None \
            else load_probe(probe, role=role)
    elif not isinstance(probe, torch.nn.Module) or not hasattr(probe, "config"):
        raise TypeError(f"{role or 'the'} probe must be a path, a SemanticProbe or None, got {type(probe).__name__}")
    else:
        where = f"the {role} probe" if role else f"{probe.config.role} probe"
        check_role(probe.config, role, where=where)
        if model is not None:  # the same checks as load_probe: width, model/tokenizer when recorded; layers
            check_probe_matches(probe.config, model, tokenizer, where=where)
            probe = probe.to(device)
        probe = probe.eval()
    if model is not None:
        c = probe.config  # refuse features this decoder cannot compute, naming both lists
        f = c.features
        require_features(list(f.groups), list(f.token_stats), FEATURE_GROUPS, TOKEN_STATS, where=f"{c.role} probe",
                         provider="SemanticSpecDecoder", wanted_topk=list(f.topk_stats), provided_topk=TOPK_STATS)
        # in-process: hidden states from transformers, after the final norm; a probe of a server's states is refused
        c.features.check_source("transformers", "final_norm", where=f"SemanticSpecDecoder ({c.role} probe)")
    # the MLP in the dtype asked for: the probe itself when it already is, else a copy (the caller's probe, a module
    # being trained, say, is left as it was); inputs are still standardised in float32 (SemanticProbe.predict)
    dtype = resolve_probe_dtype(probe_dtype, next(probe.buffers(), next(probe.parameters(), torch.empty(0))).device)
    if getattr(probe, "mlp_dtype", dtype) != dtype:
        probe = copy.deepcopy(probe)
        probe.mlp.to(dtype)
    return probe


THRESHOLD_FILE = "threshold.json"
"""The threshold ``python -m semanticspec.evaluate`` picked for a probe pair, in the export folder beside the pair's
``target/`` and ``draft/``."""
THRESHOLD_FORMAT = 1
"""Format version of :data:`THRESHOLD_FILE`: ``{"format_version", "tau", "rule", "target_probe_sha256", ...}``."""


def stored_tau(target_probe) -> float | None:
    """The threshold picked for ``target_probe`` (an exported probe directory), from :data:`THRESHOLD_FILE` in the
    folder above it; None when there is none, when ``target_probe`` is no directory, or when the file was written for
    other weights (then with a warning, naming the file).

    A decoder given no policy decides at this ``tau``; an explicit policy (or a request's threshold) wins.
    """
    import json
    from pathlib import Path

    if not isinstance(target_probe, (str, os.PathLike)):
        return None
    path = Path(target_probe).parent / THRESHOLD_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        tau, version = data["tau"], data["format_version"]
    except (ValueError, KeyError, TypeError) as e:
        warnings.warn(f"{path}: not a threshold file ({e}); deciding at the default tau", stacklevel=3)
        return None
    from generation.fingerprints import sha256_file

    why = None
    if not (is_real(tau) and 0 <= tau <= 1):  # NaN fails the range
        why = f"tau={tau!r} is no threshold in [0, 1]"
    elif isinstance(version, bool) or not isinstance(version, int) or version > THRESHOLD_FORMAT:
        why = f"format_version={version!r}: this version reads {THRESHOLD_FORMAT} and older"
    elif data.get("target_probe_sha256") != sha256_file(Path(target_probe) / "model.safetensors"):
        why = "it was written for other probe weights"
    if why is not None:
        warnings.warn(f"{path}: {why}; deciding at the default tau", stacklevel=3)
        return None
    return float(tau)
