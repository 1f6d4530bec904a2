"""`SemanticProbe`: the paper's MLP over pooled hidden states, plain torch, built from its config."""

from __future__ import annotations

import torch
from huggingface_hub import PyTorchModelHubMixin
from torch import nn

from probes.config import ProbeConfig


class SemanticProbe(nn.Module, PyTorchModelHubMixin, library_name="semanticspec-probes", tags=["semanticspec"]):
    """Maps pooled hidden states of a step to the probability that the model writes its meaning.

    Paper (SemanticSpec, Sec. 3): MLP ``d -> 2048 -> 512 -> 256 -> 1``, ReLU, dropout 0.3, sigmoid.
    ``hidden_dims=[]`` gives a linear probe. Several layers are concatenated or mixed by a learned
    softmax-weighted sum.

    Args:
        config: the probe's :class:`ProbeConfig`.
    """

    def __init__(self, config: ProbeConfig):
        super().__init__()
        if isinstance(config, dict):  # from_pretrained hands over the parsed config.json
            config = ProbeConfig.from_dict(config)
        self.config = config
        n_layers = len(config.layer_ids)
        if config.layer_combine == "weighted_sum":
            self.layer_logits = nn.Parameter(torch.zeros(n_layers))
            width = config.hidden_size
        else:
            width = n_layers * config.hidden_size
        blocks: list[nn.Module] = []
        for d in config.hidden_dims:
            blocks += [nn.Linear(width, d), nn.ReLU(), nn.Dropout(config.dropout)]
            width = d
        blocks.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*blocks)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Pre-sigmoid scores. ``features``: (B, L*D) flattened or (B, L, D). Returns (B,)."""
        cfg = self.config
        x = features.float()
        if x.dim() == 2:
            if x.shape[-1] != cfg.input_size:
                raise ValueError(
                    f"probe expects {cfg.input_size} features per row ({len(cfg.layer_ids)} layers x "
                    f"hidden_size={cfg.hidden_size}), got {x.shape[-1]}"
                )
            x = x.view(x.shape[0], len(cfg.layer_ids), cfg.hidden_size)
        if cfg.layer_combine == "weighted_sum":
            x = (torch.softmax(self.layer_logits, 0)[None, :, None] * x).sum(1)  # (B, D)
        else:
            x = x.flatten(1)  # (B, L*D)
        return self.mlp(x).squeeze(-1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Semantic probability in [0, 1] per row. Returns (B,)."""
        return torch.sigmoid(self.logits(features))
