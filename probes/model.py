"""`SemanticProbe`: the paper's MLP over a step's feature groups, plain torch, built from its config; and its exported
folder (``model.safetensors`` + ``config.json`` + a model card): written atomically (:func:`export_probe`), read with
every check of its files (:func:`probe_config`: the config's fields and role; :func:`read_folder`: the weights' names,
shapes and values; each refusal naming the file), and loaded checked against the model it reads and the role it is
used in (:func:`load_probe`, the one loader: its fingerprint, layers and source). Nothing unpickles: weights are
safetensors, the config is JSON."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import NamedTuple, Optional

import torch
from huggingface_hub import PyTorchModelHubMixin
from safetensors.torch import load_file
from torch import nn

from generation.fingerprints import model_fingerprint, tokenizer_hash
from generation.paths import atomic_path
from generation.specs import layer_problems
from probes.config import FINGERPRINT_FIELDS, ROLES, NewerFormatError, OtherModelError, ProbeConfig


def portable_config(config: ProbeConfig) -> ProbeConfig:
    """``config`` with the paths it records (the model's ``name_or_path``, the judge's) relative to the repository
    when inside it, else their last part (:func:`~generation.paths.portable_paths`): informative only (loading
    compares the other fingerprint fields), and an export must not carry the exporting machine's folders."""
    from generation.paths import portable_paths

    return dataclasses.replace(config, reads=portable_paths(config.reads), labels=portable_paths(config.labels))


def expected_shapes(config: ProbeConfig) -> dict[str, tuple[int, ...]]:
    """Name and shape of every tensor a :class:`SemanticProbe` built from ``config`` holds, without building it.

    Lets a loader compare a weights file's header with the config before anything is allocated.
    """
    shapes: dict[str, tuple[int, ...]] = {"input_mean": (config.input_size,), "input_std": (config.input_size,)}
    width = config.input_size
    if config.layer_combine == "weighted_sum" and config.hidden_width:
        shapes["layer_logits"] = (len(config.features.layer_ids),)
        width = config.input_size - config.hidden_width + config.hidden_size
    for i, d in enumerate([*config.hidden_dims, 1]):
        shapes[f"mlp.{3 * i}.weight"], shapes[f"mlp.{3 * i}.bias"] = (d, width), (d,)
        width = d
    return shapes


def _config_of(config) -> ProbeConfig:
    """``config`` (a :class:`ProbeConfig` or a dict of its fields) as a config, or a TypeError saying what to pass."""
    if not isinstance(config, (ProbeConfig, dict)):
        raise TypeError(f"config: expected a ProbeConfig or a dict of its fields, got {type(config).__name__}; an "
                        "exported probe's folder loads with probes.load_probe or SemanticProbe.from_pretrained")
    return ProbeConfig.of(config)


def _check_exportable(state: dict[str, torch.Tensor], config: ProbeConfig) -> None:
    """Refuse to write a probe whose export :func:`load_probe` would refuse: tensors other than those ``config``
    implies (a config edited after the probe was built), or NaN/inf weights."""
    expected, found = expected_shapes(config), {k: tuple(v.shape) for k, v in state.items()}
    if found != expected:
        wrong = sorted(k for k in set(found) | set(expected) if found.get(k) != expected.get(k))
        raise ValueError(f"the probe's tensors are not those its config describes ({', '.join(wrong)}: "
                         f"{[found.get(k) for k in wrong]} held, {[expected.get(k) for k in wrong]} described); an "
                         "export of it would not load. Build the probe from the config it is exported with")
    check_values(state, "the probe", fix="Train it again, or export the weights of an earlier epoch")


class SemanticProbe(nn.Module, PyTorchModelHubMixin, library_name="semanticspec-probes", tags=["semanticspec"]):
    """Maps a step's features to the probability that the reading model writes its meaning.

    Paper (SemanticSpec, Sec. 3): MLP ``d -> 2048 -> 512 -> 256 -> 1``, ReLU, dropout 0.3, sigmoid,
    over pooled hidden states. Here the input is the flat concatenation of the config's feature
    groups (``hidden``: ``L*D`` columns; ``token_stats``, ``topk_stats``: one column per statistic), standardised
    by the buffers ``input_mean``/``input_std`` (set from the training rows by
    :meth:`set_standardization`; identity until then). ``hidden_dims=[]`` gives a linear probe.
    Several layers are concatenated or mixed by a learned softmax-weighted sum.

    Args:
        config: the probe's :class:`ProbeConfig`, or a dict of its fields (today's layout unless it says its
            ``format_version``).
    """

    def __init__(self, config: ProbeConfig):
        super().__init__()
        config = _config_of(config)  # a config.json is read by probe_config
        self.config = config
        self.register_buffer("input_mean", torch.zeros(config.input_size))
        self.register_buffer("input_std", torch.ones(config.input_size))
        n_layers = len(config.features.layer_ids)
        width = config.input_size
        if config.layer_combine == "weighted_sum" and config.hidden_width:
            self.layer_logits = nn.Parameter(torch.zeros(n_layers))
            width = config.input_size - config.hidden_width + config.hidden_size
        blocks: list[nn.Module] = []
        for d in config.hidden_dims:
            blocks += [nn.Linear(width, d), nn.ReLU(), nn.Dropout(config.dropout)]
            width = d
        blocks.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*blocks)  # keep expected_shapes() in step with this layout

    @torch.no_grad()
    def set_standardization(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """Standardise inputs as ``(x - mean) / std`` per column (no-op unless ``config.standardize``).

        Columns with (near) zero spread keep a unit scale, so a constant column stays finite.
        """
        if not self.config.standardize:
            return
        if mean.shape != self.input_mean.shape or std.shape != self.input_std.shape:
            raise ValueError(f"standardisation statistics of shape {tuple(mean.shape)}/{tuple(std.shape)}; "
                             f"the probe reads {self.config.input_size} columns")
        self.input_mean.copy_(mean)
        self.input_std.copy_(torch.where(std > 1e-6, std, torch.ones_like(std)))

    def save_pretrained(self, save_directory, *, config=None, **kwargs):
        """huggingface_hub's ``save_pretrained`` (and so ``push_to_hub``), writing this probe's config as it is now in
        today's layout, its paths made portable (:func:`portable_config`), beside a card written from it
        (``config``, if given, replaces the ``config.json`` only; a ``README.md`` already in ``save_directory`` is
        kept, as huggingface_hub keeps it, while :func:`~probes.model.export_probe` always writes a fresh one). The
        mixin wrote the config the probe was built from: a probe loaded from an older format, or whose config was
        changed since, got a ``config.json`` its card contradicted."""
        if not isinstance(save_directory, (str, os.PathLike)) or not str(save_directory):
            raise ValueError(f"save_directory={save_directory!r}: expected a folder path")
        config = portable_config(self.config if config is None else _config_of(config))
        _check_exportable(self.state_dict(), config)
        # an export's weights are float32, whatever the MLP runs in (a probe loaded in float16 lost no precision)
        probe = self if self.mlp_dtype == torch.float32 else copy.deepcopy(self).float()
        return super(SemanticProbe, probe).save_pretrained(save_directory, config=config, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *, role: str | None = None, map_location: str = "cpu",
                        **kwargs):
        """huggingface_hub's ``from_pretrained`` with :func:`~probes.load_probe`'s checks of the files: a local
        folder (``~`` expanded) is read by :func:`probe_config` and :func:`read_folder`, every refusal naming the
        file (the mixin parsed its ``config.json`` first, a bare JSON error); a Hub repository through the mixin,
        its snapshot checked alike. ``role``: the role the probe is used in (:func:`check_role`); the weights are
        always checked exactly (``strict`` has no effect).

        Raises:
            FileNotFoundError, ValueError: as :func:`probe_config` and :func:`read_folder`.
        """
        from generation.loading import checked_device, hub_id

        name = str(pretrained_model_name_or_path)
        folder = Path(name).expanduser()
        device = checked_device(map_location, "map_location")
        if folder.exists() or not hub_id(name):  # a path: a missing one is named as missing, never sent to the Hub
            return read_folder(folder, probe_config(folder, role)).to(device).eval()
        return super().from_pretrained(pretrained_model_name_or_path, role=role, map_location=map_location, **kwargs)

    @classmethod
    def _from_pretrained(cls, *, model_id: str, revision, cache_dir, force_download: bool, local_files_only: bool,
                         token, map_location: str = "cpu", strict: bool = False, role: str | None = None,
                         **model_kwargs):
        """A Hub repository's snapshot (``config.json``, ``model.safetensors``) read as :meth:`from_pretrained` reads a
        folder (the mixin calls this for what is not a local folder). The model it will read is not known here:
        :func:`~probes.load_probe` checks that too."""
        from huggingface_hub import snapshot_download

        folder = snapshot_download(repo_id=model_id, revision=revision, cache_dir=cache_dir,
                                   force_download=force_download, local_files_only=local_files_only, token=token,
                                   allow_patterns=["config.json", "model.safetensors"])
        return cls.from_pretrained(folder, role=role, map_location=map_location)

    def generate_model_card(self, *args, **kwargs):
        """The exported ``README.md``: a card written from the config (``probes.card``), not the Hub's template."""
        from probes.card import model_card

        return model_card(portable_config(self.config))

    def _checked(self, features: torch.Tensor) -> torch.Tensor:
        """``features`` as (B, input_size) float32, or a ValueError naming the widths the probe reads."""
        cfg, f = self.config, self.config.features
        if not isinstance(features, torch.Tensor):
            raise TypeError(f"probe features must be a torch.Tensor, got {type(features).__name__}")
        x = features.float()
        if x.dim() == 3 and f.groups == ("hidden",) and x.shape[1:] == (len(f.layer_ids), cfg.hidden_size):
            x = x.flatten(1)
        if x.dim() != 2 or x.shape[-1] != cfg.input_size:
            got = f"shape {tuple(features.shape)}" if x.dim() != 2 else f"{features.shape[-1]} per row"
            raise ValueError(
                f"probe expects {cfg.input_size} features per row, a (batch, {cfg.input_size}) input (groups "
                f"{list(f.groups)}: {len(f.layer_ids)} layers x hidden_size={cfg.hidden_size} for hidden, "
                f"{len(f.token_stats)} token statistics, {len(f.topk_stats)} top-k statistics), got {got}"
            )
        return x

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Pre-sigmoid scores. ``features``: (B, input_size) flat, or (B, L, D) for a hidden-only probe. Returns
        (B,)."""
        cfg = self.config
        x = (self._checked(features) - self.input_mean) / self.input_std
        if hasattr(self, "layer_logits"):
            h, rest = x[:, : cfg.hidden_width], x[:, cfg.hidden_width :]
            h = h.view(x.shape[0], len(cfg.features.layer_ids), cfg.hidden_size)
            h = (torch.softmax(self.layer_logits, 0)[None, :, None] * h).sum(1)  # (B, D)
            x = torch.cat([h, rest], dim=1)
        return self.mlp(x.to(self.mlp_dtype)).squeeze(-1).float()

    @property
    def mlp_dtype(self) -> torch.dtype:
        """The dtype the MLP runs in: its weights' (``probe.mlp.half()`` runs it in float16; the inputs are
        standardized in float32 first, and the outputs are float32)."""
        return next(self.mlp.parameters()).dtype

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Semantic probability in [0, 1] per row. Returns (B,)."""
        return torch.sigmoid(self.logits(features))

    def predict(self, features: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` for inference, with little per-call overhead: the decoder's probe call.

        Under ``torch.inference_mode``, ``features`` moved to the probe's device and the MLP run as plain
        ``linear``/``relu_`` calls over its layers' weights (no module dispatch, no dropout, no autograd
        bookkeeping, one shape comparison), in :attr:`mlp_dtype`: the same ops as :meth:`forward` in eval mode, so
        the same numbers. In training mode (dropout), with a layer mix, or for an MLP edited into another layout
        it is :meth:`forward`.

        Returns:
            (B,) probabilities, an inference tensor on the probe's device.
        """
        with torch.inference_mode():
            x = features.to(self.input_mean.device)
            linears = self._linears
            if self.training or "layer_logits" in self._parameters or linears is None:
                return self(x)
            if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.config.input_size:
                x = self._checked(x)
            x = ((x - self.input_mean) / self.input_std).to(linears[0].weight.dtype)
            for m in linears[:-1]:
                x = torch.nn.functional.linear(x, m.weight, m.bias).relu_()
            last = linears[-1]
            return torch.nn.functional.linear(x, last.weight, last.bias).squeeze(-1).float().sigmoid_()

    @property
    def _linears(self) -> list[nn.Linear] | None:
        """The MLP's ``Linear`` layers in order, when it has the layout this class builds (``Linear``, ``ReLU``,
        ``Dropout``, ..., ``Linear``); None for an MLP edited into another layout (:meth:`predict` then runs
        :meth:`forward`). Found again only when the MLP's modules change (:meth:`predict` runs per decoder step)."""
        layers = tuple(self.mlp)
        cached = self.__dict__.get("_linear_cache")
        if cached is None or cached[0] != layers:
            n = len(layers) // 3
            plain = len(layers) == 3 * n + 1 and isinstance(layers[-1], nn.Linear) and all(
                isinstance(layers[3 * i], nn.Linear) and isinstance(layers[3 * i + 1], nn.ReLU)
                and isinstance(layers[3 * i + 2], nn.Dropout) for i in range(n))
            cached = (layers, [layers[3 * i] for i in range(n + 1)] if plain else None)
            self.__dict__["_linear_cache"] = cached
        return cached[1]


PROBE_DTYPES = ("auto", "float32", "float16")
"""``probe_dtype`` values: the dtype a probe's MLP runs in (the decoders' ``probe_dtype``)."""


def resolve_probe_dtype(value: str, device: torch.device) -> torch.dtype:
    """The dtype a probe's MLP runs in on ``device`` for ``probe_dtype=value``.

    ``auto`` is float16 where a float16 matrix-vector product is fast: on CUDA, and on x86 CPUs whose kernels
    PyTorch built for AVX2 or AVX-512 (which convert float16 in registers). A batch-1 probe call reads every
    weight once, and the models' forwards evict them from the CPU's caches between calls, so halving the bytes
    about halves the call, with the same decisions (``python -m benchmarks.probe_cost``, docs/benchmarks.md).
    Elsewhere (no SIMD kernels) float16 is several times slower, so ``auto`` keeps float32.

    Raises:
        ValueError: a value outside :data:`PROBE_DTYPES`, naming it.
    """
    if value not in PROBE_DTYPES:
        raise ValueError(f"probe_dtype={value!r}; expected one of {list(PROBE_DTYPES)}")
    if value == "auto":
        fast = device.type == "cuda" or (device.type == "cpu" and torch.backends.cpu.get_cpu_capability() in
                                         ("AVX2", "AVX512"))
        value = "float16" if fast else "float32"
    return getattr(torch, value)


def run_probe(probe, x: torch.Tensor) -> list[float]:
    """A probe's outputs for the rows of ``x`` (moved to the probe's device), as floats.

    A :class:`SemanticProbe` runs its :meth:`~SemanticProbe.predict` (no per-call overhead); any other module (a
    probe of the caller's own) is called.
    """
    predict = getattr(probe, "predict", None)
    if predict is not None:
        out = predict(x).tolist()
    else:
        device = next(probe.parameters(), torch.empty(0)).device
        out = probe(x.to(device)).float().cpu().tolist()
    if any(v != v for v in out):  # NaN: no threshold keeps it, so every such step would be refused without a word
        role = getattr(getattr(probe, "config", None), "role", None) or "a"
        warnings.warn(f"the {role} probe scored NaN: its input held NaN or inf (e.g. a float16 overflow in the "
                      "model's hidden states); such a step is refused", RuntimeWarning, stacklevel=2)
    return out


# --------------------------------------------------------------------------- an exported probe's files


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


def probe_config(path: str | os.PathLike, role: Optional[str] = None) -> ProbeConfig:
    """The config of the exported probe at ``path``, read without its weights (what
    :func:`~probes.load_probe` checks first).

    Raises:
        FileNotFoundError: ``path`` does not exist, lacks ``config.json`` or ``model.safetensors``, or is one of
            them.
        ValueError: ``config.json`` is no valid probe config, or the probe's role is not ``role`` (None: any).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; pass the folder of an exported probe (config.json + "
                                "model.safetensors)")
    if path.is_file():  # e.g. ".../target/config.json": the probe is the folder
        raise FileNotFoundError(f"{path} is a file; pass the folder of an exported probe (config.json + "
                                f"model.safetensors), e.g. {path.parent}")
    missing = [f for f in ("config.json", "model.safetensors") if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{path} is not an exported probe: missing {', '.join(missing)}")
    config = _read_config(path / "config.json")
    check_role(config, role, where=f"probe at {path}")
    return config


_REDO = "re-export the probe (probes.model.export_probe) or restore the file"
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


def nonfinite(state: dict[str, torch.Tensor]) -> list[str]:
    """The names of ``state``'s floating-point tensors that hold NaN or infinite values (a diverged training's): what
    the loader refuses and the fit does not export."""
    return [k for k, v in state.items() if v.is_floating_point() and not bool(v.isfinite().all())]


def nonfinite_probes(probes) -> str:
    """The tensors of ``probes`` (``{role: probe}``) holding NaN or infinite values, as ``"target: mlp.0.weight, ..."``
    (the first three), or ``""``: a diverged training's probes, which the loader refuses."""
    bad = [f"{role}: {name}" for role, probe in probes.items() for name in nonfinite(probe.state_dict())]
    return ", ".join(bad[:3]) + (", ..." if len(bad) > 3 else "")


def _read_weights(file: Path) -> dict:
    """The tensors of ``file`` (CPU), their values checked (:func:`check_values`)."""
    from safetensors import SafetensorError

    try:
        state = load_file(str(file), device="cpu")
    except SafetensorError as e:
        raise ValueError(f"{file} is not a readable safetensors file ({e}); {_REDO}") from None
    check_values(state, str(file))
    return state


def check_values(state: dict[str, torch.Tensor], where: str, fix: str = _REDO.capitalize()) -> None:
    """Refuse a probe's tensors (``where``: the file they were read from, or the probe in memory) holding NaN or
    infinite values as the float32 probe holds them (a float64 file's 1e300 is infinite there), or an ``input_std``
    not positive everywhere, naming the tensors and ``fix``."""
    if bad := nonfinite({k: v.float() if v.is_floating_point() else v for k, v in state.items()}):
        raise ValueError(f"{where} holds NaN or infinite values in {bad}; the probe would refuse or accept every "
                         f"step blindly. {fix} (a diverged training gives such weights)")
    if "input_std" in state and not bool((state["input_std"] > 0).all()):
        raise ValueError(f"{where} holds an input_std that is not positive everywhere (training sets each at least "
                         f"1e-6); the probe would divide by it and score every step NaN. {fix}")


def read_folder(path: Path, config: ProbeConfig) -> SemanticProbe:
    """The probe exported at ``path`` whose config (:func:`probe_config`) is ``config``, on the CPU: the weights
    file's header checked to hold exactly the tensors ``config`` implies before anything is allocated, and their
    values as they load."""
    weights = path / "model.safetensors"
    _check_header(weights, config)
    probe = SemanticProbe(config)
    probe.load_state_dict(_read_weights(weights), strict=False)  # names and shapes checked in the header
    return probe


def check_probe_matches(config: ProbeConfig, model, tokenizer=None, where: str = "probe") -> None:
    """Raise if a probe with ``config`` cannot read ``model``'s hidden states: it was exported for another model
    (:class:`~probes.config.OtherModelError`, naming each differing field), it reads layers the model does not have,
    or it reads hidden states of another source than a transformers model after its final norm, a server's say
    (ValueError, naming the ids and the range, or both sources). With ``model`` None only ``tokenizer``'s vocabulary
    hash is checked (a served model's).

    Used by :func:`load_probe` (the decoders' loader) and by the live-validation callback and the evaluation, which
    check a probe against models they load themselves.
    """
    reads = config.reads
    actual = model_fingerprint(model, tokenizer) if model is not None else {"tokenizer_hash": tokenizer_hash(tokenizer)}
    problems = [f"{k}: probe has {reads[k]!r}, model has {actual[k]!r}" for k in FINGERPRINT_FIELDS
                if k in reads and k in actual and reads[k] != actual[k]]  # the checked fields both sides know
    if model is not None and config.hidden_size != actual["hidden_size"] and \
            not any(p.startswith("hidden_size") for p in problems):
        problems.append(f"hidden_size: probe has {config.hidden_size!r}, model has {actual['hidden_size']!r}")
    if problems:
        raise OtherModelError(
            f"{where} was exported for another model ({config.reads.get('name_or_path') or 'unknown'}); "
            + "; ".join(problems)
            + ". Export a probe for this model or load the matching one."
        )
    if model is None:  # a served model's tokenizer: its server's capabilities are checked before its first request
        return
    layers = layer_problems(list(config.features.layer_ids), actual["num_layers"]) if config.features.needs_hidden \
        else []  # a probe of statistics alone reads no layer
    if layers:
        raise ValueError(f"{where} reads layers the model does not have (features.layer_ids): " + "; ".join(layers))
    config.features.check_source("transformers", "final_norm", where=where)


def export_probe(probe, path: str | os.PathLike) -> Path:
    """Write ``probe`` to ``path`` (``model.safetensors``, ``config.json``, model card) atomically.

    The files are written into a temporary sibling directory that then replaces ``path``, so an
    interrupted export leaves either the old probe or the new one, never half of one. Files of an existing ``path``
    that the export does not write (a user's notes, say) are carried over, as ``save_pretrained`` into a folder
    leaves them. The paths the config records are made portable (:func:`~probes.model.portable_config`). A ``path``
    that is a symbolic link to a folder is exported into that folder and stays a link (``save_pretrained`` writes
    through it too).

    Raises:
        ValueError: ``path`` is a file.
    """
    path = Path(path).expanduser()
    if path.is_symlink() and path.is_dir():  # else the link itself was replaced, its folder left with the old probe
        path = path.resolve()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is a file; export a probe into a folder (made if missing)")
    kept = {}
    with atomic_path(path, folder=True) as tmp:
        probe.save_pretrained(tmp)
        for old in path.iterdir() if path.is_dir() else ():
            if not (tmp / old.name).exists():
                (shutil.copytree if old.is_dir() else shutil.copy2)(old, tmp / old.name)
                kept[old.name] = (tmp / old.name).stat().st_mode
    for name, mode in kept.items():  # a user's file keeps its mode (atomic_path gives the export's files the umask's)
        os.chmod(path / name, mode)
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
            shapes the config describes, or holding NaN/inf. Each message names the file and field. A probe in memory
            holding NaN/inf is refused too.
        TypeError: ``probe`` is neither a folder nor a probe module.
    """
    from generation.loading import checked_device

    if dtype is not None and dtype not in PROBE_DTYPES:  # before the folder is read, named as this function's
        raise ValueError(f"dtype={dtype!r}: expected None or one of {list(PROBE_DTYPES)}")
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
    elif isinstance(probe, torch.nn.Module) and isinstance(getattr(probe, "config", None), ProbeConfig):
        where = f"the {role or probe.config.role} probe"
        check_role(probe.config, role, where=where)
        if model is not None or tokenizer is not None:
            check_probe_matches(probe.config, model, tokenizer, where=where)
        check_values(probe.state_dict(), where, fix="Train it again, or load an export")
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
    if model is not None or tokenizer is not None:
        if not any(k in config.reads for k in FINGERPRINT_FIELDS):  # an old export: only the width can be checked
            warnings.warn(
                f"{path / 'config.json'} records no `reads` fingerprint, so this probe cannot be checked against "
                f"the model it is given" + (f" (only hidden_size={config.hidden_size} is)" if model is not None else "")
                + "; re-export it to record the model it reads",
                UserWarning,
                stacklevel=3,
            )
        check_probe_matches(config, model, tokenizer, where=f"probe at {path}")
    return read_folder(path, config)


# --------------------------------------------------------------------------- a decoder's two probes


LABEL_FIELDS = {"step": lambda c: c.step,
                "temperature": lambda c: c.sampling.temperature if c.sampling else None,
                "top_p": lambda c: c.sampling.top_p if c.sampling else None}
"""What a probe's config records about the labels it was trained on: the step they were cut at
(:class:`~generation.specs.StepSpec`) and how they were sampled."""


def labelled_with(probes) -> dict[str, tuple[object, str]]:
    """What the labels of ``probes`` (probes or None) were made with, per :data:`LABEL_FIELDS` field the probes
    record: ``{field: (value, "target probe")}``.

    Raises:
        ValueError: two probes disagree (naming both values): a pair is used on the steps it was trained on.
    """
    seen: dict[str, tuple[object, str]] = {}
    problems = []
    for probe in (p for p in probes if p is not None):
        for key, get in LABEL_FIELDS.items():
            value = get(probe.config)
            if value is None:
                continue
            if key in seen and seen[key][0] != value:
                problems.append(f"the {seen[key][1]} has {key}={seen[key][0]!r}, the "
                                f"{probe.config.role} probe {value!r}")
            seen.setdefault(key, (value, f"{probe.config.role} probe"))
    if problems:
        raise ValueError("a probe is used on the steps it was trained on: " + "; ".join(problems))
    return seen


class Probes(NamedTuple):
    """A decoder's target and draft probes (each None where none is given) and what their labels were made with
    (:func:`labelled_with`)."""

    target: Optional[SemanticProbe]
    draft: Optional[SemanticProbe]
    labelled_with: dict


def load_probes(probes, models, tokenizers, dtype: str = "auto") -> Probes:
    """A decoder's target and draft probes (each a folder, a probe in memory or None), each through
    :func:`load_probe` against its model and tokenizer (None: a served model, checked against its server instead) in
    its role, with its MLP in ``dtype`` (a bad value is refused without a probe too).

    Raises:
        ValueError: what :func:`load_probe` refuses, a bad ``dtype``, or two probes whose labels were made with
            different steps or sampling (:func:`labelled_with`).
    """
    resolve_probe_dtype(dtype, torch.device("cpu"))
    target, draft = (None if p is None else load_probe(p, m, t, role=role, dtype=dtype)
                     for p, m, t, role in zip(probes, models, tokenizers, ("target", "draft")))
    return Probes(target, draft, labelled_with((target, draft)))
