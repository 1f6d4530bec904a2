"""`SemanticProbe`: the paper's MLP over a step's feature groups, plain torch, built from its config."""

from __future__ import annotations

import warnings

import torch
from huggingface_hub import PyTorchModelHubMixin
from torch import nn

from probes.config import ProbeConfig


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


class SemanticProbe(nn.Module, PyTorchModelHubMixin, library_name="semanticspec-probes", tags=["semanticspec"]):
    """Maps a step's features to the probability that the reading model writes its meaning.

    Paper (SemanticSpec, Sec. 3): MLP ``d -> 2048 -> 512 -> 256 -> 1``, ReLU, dropout 0.3, sigmoid,
    over pooled hidden states. Here the input is the flat concatenation of the config's feature
    groups (``hidden``: ``L*D`` columns; ``token_stats``, ``topk_stats``: one column per statistic), standardised
    by the buffers ``input_mean``/``input_std`` (set from the training rows by
    :meth:`set_standardization`; identity until then). ``hidden_dims=[]`` gives a linear probe.
    Several layers are concatenated or mixed by a learned softmax-weighted sum.

    Args:
        config: the probe's :class:`ProbeConfig`.
    """

    def __init__(self, config: ProbeConfig):
        super().__init__()
        if isinstance(config, dict):  # from_pretrained hands over the parsed config.json
            config = ProbeConfig.from_dict(config)
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

    def generate_model_card(self, *args, **kwargs):
        """The exported ``README.md``: a card written from the config (``probes.card``), not the Hub's template."""
        from probes.card import model_card

        return model_card(self.config)

    def _checked(self, features: torch.Tensor) -> torch.Tensor:
        """``features`` as (B, input_size) float32, or a ValueError naming the widths the probe reads."""
        cfg, f = self.config, self.config.features
        x = features.float()
        if x.dim() == 3 and f.groups == ("hidden",):
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
