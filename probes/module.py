"""`SemanticProbeModule`: trains the target probe, the draft probe, or both from one dataset.

Batches come from :class:`~datamodules.datamodule.SemanticProbeDataModule` as
``{role: {"features": (B_r, W_r), "label": (B_r,), "writer": (B_r,)}}``; the target probe learns
``q`` from the target's reading of every sample, the draft probe learns ``p`` from the draft's
reading of its own.

Decisions at decode time happen on draft-written steps, so the target probe's metrics are also
reported on those rows alone (``val/target/draft_written/auroc``, ...), and the rare
draft-written rows with a low label (the draft's wrong steps) can be weighted up in the loss.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from torchmetrics import MeanMetric, MetricCollection
from torchmetrics.classification import BinaryAUROC, BinaryCalibrationError
from torchmetrics.wrappers import BinaryTargetTransformer
from torchmetrics.regression import MeanAbsoluteError, MeanSquaredError, PearsonCorrCoef, R2Score
from torchmetrics.utilities import dim_zero_cat

from generation.specs import FeatureSpec, SamplingSpec, StepSpec, is_finite
from probes.config import ProbeConfig, nest_features
from probes.model import SemanticProbe

# The specs travel in the module's hyperparameters (data.input_spec, linked by the fit CLI; ``probe`` as a ProbeConfig
# when a module is built in Python); a checkpoint holding them loads with torch's weights_only unpickler, which needs
# each class allowed: dataclasses of str, int, float, and dicts and tuples of them.
torch.serialization.add_safe_globals([StepSpec, SamplingSpec, FeatureSpec, ProbeConfig])

ROLES = ("target", "draft")
WRITERS = {"target_written": 0, "draft_written": 1}
"""Per-writer metric sets of the target probe, by the ``writer`` code of ``datamodules.labels.shares``."""
LOSSES = ("mse", "bce")
POSITIVE_AT = 0.5
"""Label at or above which a sample counts as positive for AUROC and calibration error."""


FROM_THE_DATA = {
    "hidden_size": "the hidden size of the model it reads (data.build.target / data.build.draft)",
    "features": "data.feature_groups and data.build.layer_ids, pooling, token_stats, top_k, topk_stats",
    "reads": "the model it reads (data.build.target / data.build.draft)",
    "step": "data.build.steps",
    "sampling": "data.build.sampling",
    "labels": "the label build (data.build)",
    "role": "model.roles",
    "training": "model.loss, model.optimizer and the trainer (recorded at export)",
    "features_dtype": "by the label build, which stores pooled hidden states in float16 (a record, not a setting)",
}
"""The probe config's fields the fit fills per role from the data (``input_spec``), and where each is set."""


def _filled_from_the_data(probe: ProbeConfig | dict) -> list[str]:
    """The fields of ``probe`` (``model.probe``) given other values than their defaults although the fit fills them
    from the data, so that a value given there is refused rather than silently replaced."""
    given = ProbeConfig.of(probe)
    default = ProbeConfig()
    return [f"model.probe.{k}={getattr(given, k)!r}: filled per role from the data; set {where}"
            for k, where in FROM_THE_DATA.items() if getattr(given, k) != getattr(default, k)]


class DefinedAUROC(BinaryAUROC):
    """:class:`~torchmetrics.classification.BinaryAUROC`, NaN where the targets hold one class: AUROC is undefined
    there, and torchmetrics warns and gives 0, which a results table shows as a measured 0."""

    def compute(self) -> torch.Tensor:
        target = dim_zero_cat(self.target)
        if target.numel() == 0 or bool(target.min() == target.max()):
            return torch.tensor(float("nan"))
        return super().compute()


class DefinedR2(R2Score):
    """:class:`~torchmetrics.regression.R2Score`, NaN where the targets do not vary (R² is undefined there)."""

    def compute(self) -> torch.Tensor:
        if bool(self.total * self.sum_squared_error - self.sum_error**2 <= 0):  # n·Σy² − (Σy)²: n² times the variance
            return torch.tensor(float("nan"))
        return super().compute()


def regression_metrics() -> MetricCollection:
    """MSE, MAE, R², Pearson on the probability; AUROC and calibration error at label >= 0.5."""
    return MetricCollection(
        {
            "mse": MeanSquaredError(),
            "mae": MeanAbsoluteError(),
            "r2": DefinedR2(),
            "pearson": PearsonCorrCoef(),
            # label >= 0.5 is the positive class ("the model would likely write this meaning");
            # the wrapper tests label > threshold, so the threshold sits just below 0.5.
            "auroc": BinaryTargetTransformer(DefinedAUROC(), threshold=POSITIVE_AT - 1e-6),
            "ece": BinaryTargetTransformer(BinaryCalibrationError(n_bins=10), threshold=POSITIVE_AT - 1e-6),
        },
        compute_groups=False,
    )


class SemanticProbeModule(L.LightningModule):
    """Lightning system around one :class:`SemanticProbe` per role.

    Args:
        probe: architecture shared by the probes (widths, dropout, layer combination). Fields that
            only the data knows (hidden_size, what the probe reads, reads, step, sampling, labels) and the
            role are filled per role from ``input_spec``; with an ``input_spec``, one given another value
            here is refused (:data:`FROM_THE_DATA` says where each is set).
        roles: which probes to train: ``target``, ``draft`` or both.
        input_spec: per role, what the data holds (linked from ``data.input_spec`` by the CLI).
        loss: ``mse`` on the semantic probability (paper) or ``bce`` with soft labels.
        optimizer: optimizer factory (paper: Adam, lr 1e-3). A callable is not saved as a hyperparameter:
            ``load_from_checkpoint`` builds the default (Adam) unless given ``optimizer=...`` again (a resumed fit
            restores the optimizer's state, learning rate included, from the checkpoint).
        lr_scheduler: learning-rate scheduler factory taking the optimizer, stepped once an epoch (e.g.
            ``torch.optim.lr_scheduler.CosineAnnealingLR`` with ``T_max``), or Lightning's
            ``lightning.pytorch.cli.ReduceLROnPlateau`` with the ``monitor`` it watches (``val/loss``); None
            (default, the paper's) keeps the learning rate constant. Not saved as a hyperparameter, as ``optimizer``.
        draft_low_label_weight: loss weight of the target probe's draft-written rows whose label is
            below 0.5 (the draft's wrong steps: a small share of the rows, and the steps a decoder must
            refuse). 1.0 = the paper's unweighted loss.
    """

    def __init__(
        self,
        probe: ProbeConfig = ProbeConfig(),  # noqa: B008  (LightningCLI shows the default)
        roles: list[str] = ["target", "draft"],  # noqa: B006  (LightningCLI shows it; never mutated)
        input_spec: Optional[dict[str, dict[str, Any]]] = None,
        loss: str = "mse",
        optimizer: OptimizerCallable = torch.optim.Adam,
        lr_scheduler: Optional[LRSchedulerCallable] = None,
        draft_low_label_weight: float = 1.0,
    ) -> None:
        super().__init__()
        errors = []
        if isinstance(roles, str) or not isinstance(roles, (list, tuple)) or not roles or any(
                r not in ROLES for r in roles) or len(set(roles)) != len(roles):
            errors.append(f"roles={roles!r}: expected a non-empty list from {list(ROLES)} without repeats")
            roles = []
        if not isinstance(probe, (ProbeConfig, dict)):
            errors.append(f"probe={probe!r}: expected a ProbeConfig (or a dict of its fields)")
        if not callable(optimizer):
            errors.append(f"optimizer={optimizer!r}: expected a callable that takes the parameters (e.g. "
                          "torch.optim.Adam, or functools.partial(torch.optim.AdamW, lr=1e-3))")
        if lr_scheduler is not None and not callable(lr_scheduler):
            errors.append(f"lr_scheduler={lr_scheduler!r}: expected a callable that takes the optimizer (e.g. "
                          "functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=12)), or None")
        if loss not in LOSSES:
            errors.append(f"loss={loss!r}: expected one of {list(LOSSES)}")
        missing = [r for r in roles if input_spec is not None and r not in input_spec]
        if missing:
            errors.append(f"input_spec lacks roles {missing}; it has {sorted(input_spec or {})}")
        if not (is_finite(draft_low_label_weight) and draft_low_label_weight > 0):
            errors.append(f"draft_low_label_weight={draft_low_label_weight!r}: expected a finite number > 0")
        if input_spec is not None and isinstance(probe, (ProbeConfig, dict)):
            errors += _filled_from_the_data(probe)
        if errors:
            raise ValueError("invalid SemanticProbeModule arguments: " + "; ".join(errors))
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
        self.roles = list(roles)
        self.loss_name = loss
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self.draft_low_label_weight = float(draft_low_label_weight)
        self.probe_configs = {r: self._role_config(probe, r, (input_spec or {}).get(r)) for r in self.roles}
        self.probes = nn.ModuleDict({r: SemanticProbe(c) for r, c in self.probe_configs.items()})
        if all(c.input_size for c in self.probe_configs.values()):  # the model summary's sizes and FLOPs
            self.example_input_array = {r: torch.zeros(1, c.input_size) for r, c in self.probe_configs.items()}
        # metric set -> the name it logs under: each probe on all its rows, the target probe per writer
        self.metric_names = {r: r for r in self.roles}
        if "target" in self.roles:
            self.metric_names.update({f"target_{w}": f"target/{w}" for w in WRITERS})
        self.metrics = nn.ModuleDict(
            {f"{stage}_{key}": regression_metrics() for stage in ("val", "test") for key in self.metric_names}
        )
        self.val_mse = MeanSquaredError()
        self.test_mse = MeanSquaredError()
        # each probe's loss on the val/test rows, gathered over the ranks when computed (a per-rank mean logged
        # unsynced was rank 0's alone under DDP)
        self.eval_losses = nn.ModuleDict({f"{stage}_{r}": MeanMetric() for stage in ("val", "test")
                                          for r in self.roles})

    @staticmethod
    def _role_config(probe: ProbeConfig, role: str, spec: Optional[dict[str, Any]]) -> ProbeConfig:
        probe = ProbeConfig.of(probe)
        if spec is not None and "features" not in spec:  # checkpoints before config format 6: feature fields flat
            spec = nest_features(spec)
        filled = {k: copy.deepcopy(spec[k]) for k in FROM_THE_DATA if k in (spec or {}) and k != "role"}
        return replace(probe, role=role, **filled)

    def forward(self, **features: torch.Tensor) -> dict[str, torch.Tensor]:
        """Semantic probability of each row, per role: ``module(target=x)`` gives ``{"target": (B,)}`` (any of the
        module's roles, each with its ``(B, W)`` features)."""
        return {role: self.probes[role](x) for role, x in features.items()}

    def setup(self, stage: str) -> None:
        """Before fitting, standardise each probe's inputs with the training rows' moments (from the datamodule)."""
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if stage == "fit" and dm is not None and hasattr(dm, "feature_moments"):
            if missing := [r for r in self.probes if r not in dm.input_spec]:
                raise ValueError(f"the module trains probes for {list(self.probes)} but the datamodule streams roles "
                                 f"{list(dm.input_spec)} (missing {missing}); give both the same roles")
            for role, probe in self.probes.items():
                _check_streamed(role, probe.config, dm.input_spec[role], dm.data_dir)
                probe.set_standardization(*dm.feature_moments(role))

    def _loss(self, logits: torch.Tensor, label: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        if self.loss_name == "bce":
            per_row = F.binary_cross_entropy_with_logits(logits, label, reduction="none")
        else:
            per_row = (torch.sigmoid(logits) - label) ** 2
        if weight is None:
            return per_row.mean()
        return (per_row * weight).sum() / weight.sum()

    def _weights(self, role: str, part: dict) -> torch.Tensor | None:
        """Per-row loss weights: ``draft_low_label_weight`` on the target probe's low-label draft-written rows."""
        if role != "target" or self.draft_low_label_weight == 1.0 or "writer" not in part:
            return None
        low = (part["writer"] == WRITERS["draft_written"]) & (part["label"] < POSITIVE_AT)
        return torch.where(low, self.draft_low_label_weight, 1.0).to(part["label"].dtype)

    def _shared_step(self, batch: dict, stage: str) -> torch.Tensor | None:
        total, n = 0.0, 0
        for role, part in batch.items():
            if role not in self.probes:
                continue
            logits = self.probes[role].logits(part["features"])
            loss = self._loss(logits, part["label"], self._weights(role, part) if stage == "train" else None)
            bs = part["label"].numel()
            if stage == "train":  # not synced: under DDP a batch may lack a role on one rank only (a sync would hang)
                self.log(f"{stage}/{role}/loss", loss, batch_size=bs, on_step=True, on_epoch=True)
            else:  # gathered at the epoch's end, where every rank computes it
                self.eval_losses[f"{stage}_{role}"].update(loss.detach(), bs)
                prob = torch.sigmoid(logits).detach()
                self.metrics[f"{stage}_{role}"].update(prob, part["label"])
                if role == "target" and "writer" in part:
                    for name, code in WRITERS.items():
                        rows = part["writer"] == code
                        if bool(rows.any()):
                            self.metrics[f"{stage}_target_{name}"].update(prob[rows], part["label"][rows])
                getattr(self, f"{stage}_mse").update(prob, part["label"])
            total, n = total + loss * bs, n + bs
        if n == 0:  # the data streams roles this module does not train, and the batch holds only those
            if self._trainer is not None and self.trainer.world_size > 1:  # a rank that skipped would hang the others
                raise ValueError(f"{stage} batch has no rows for roles {self.roles}; it has {sorted(batch)}: under "
                                 f"DDP, stream only the roles the module trains (data.roles={self.roles})")
            return None  # skipped: no step, nothing logged
        loss = total / n
        self.log(f"{stage}/loss", loss, batch_size=n, prog_bar=True, on_step=stage == "train", on_epoch=True,
                 sync_dist=True)
        return loss + self._idle_probes(batch, loss) if stage == "train" else loss

    def _idle_probes(self, batch: dict, like: torch.Tensor) -> torch.Tensor | float:
        """Under DDP, zero times the parameters of each probe whose role the batch lacks: DDP waits for a gradient of
        every parameter on every rank (``find_unused_parameters=False``, its default), and a rank whose batch held no
        row of a role hung the others. One process: 0.0, so the optimizer skips such a probe as before."""
        if self._trainer is None or self.trainer.world_size == 1:
            return 0.0
        idle = [p for r, probe in self.probes.items() if r not in batch for p in probe.parameters()]
        return sum((0.0 * p.sum() for p in idle), like.new_zeros(()))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor | None:
        return self._shared_step(batch, "train")

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._shared_step(batch, "val")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep torch's random state (dropout draws) with the checkpoint: Lightning keeps none."""
        checkpoint["rng_states"] = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            checkpoint["rng_states"]["cuda"] = torch.cuda.get_rng_state_all()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A trainer resuming a fit from ``checkpoint`` restores its random state when the first resumed epoch starts;
        a module only loaded from it (``load_from_checkpoint``, or a test or validation from it) keeps the caller's."""
        if self._trainer is not None and self._trainer.state.fn == "fit":
            self._resumed_rng = checkpoint.get("rng_states")

    def on_train_epoch_start(self) -> None:
        """A resumed run's first epoch starts from the random state its checkpoint kept, so it draws the dropout
        masks the uninterrupted run drew from there (with the data order, :class:`~datamodules.stream.EpochLoader`,
        it trains as that run did)."""
        states, self._resumed_rng = getattr(self, "_resumed_rng", None), None
        if states is not None:
            torch.set_rng_state(states["cpu"])
            if "cuda" in states and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(states["cuda"])

    def on_validation_epoch_end(self) -> None:
        self._log_epoch_metrics("val")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._shared_step(batch, "test")

    def on_test_epoch_end(self) -> None:
        self._log_epoch_metrics("test")

    def predict_step(self, batch: dict, batch_idx: int) -> dict[str, dict[str, torch.Tensor]]:
        """``trainer.predict``: each role's probabilities on a batch of the stream, beside its labels and writers:
        ``{role: {"q": (B_r,), "label": (B_r,), "writer": (B_r,)}}`` (the datamodule predicts on the test split)."""
        return {r: {"q": self.probes[r](part["features"]), "label": part["label"], "writer": part["writer"]}
                for r, part in batch.items() if r in self.probes}

    def _log_epoch_metrics(self, stage: str) -> None:
        overall = getattr(self, f"{stage}_mse")
        if self._any_rows(overall):
            self.log(f"{stage}/mse", overall.compute(), prog_bar=True, sync_dist=True)
        overall.reset()
        for key, name in self.metric_names.items():
            collection = self.metrics[f"{stage}_{key}"]
            if self._any_rows(collection["mse"]):
                self.log_dict({f"{stage}/{name}/{k}": v for k, v in collection.compute().items()}, sync_dist=True)
                if key in self.roles:
                    self.log(f"{stage}/{name}/loss", self.eval_losses[f"{stage}_{key}"].compute(), sync_dist=True)
            collection.reset()
            if key in self.roles:
                self.eval_losses[f"{stage}_{key}"].reset()

    def _any_rows(self, metric) -> bool:
        """Whether any rank updated ``metric`` (a MeanSquaredError): its ``compute()`` gathers across ranks, so every
        rank must make the same choice (one rank without rows of a writer skipped it, and the others waited)."""
        total = metric.total.detach().clone()
        if self._trainer is not None and self.trainer.world_size > 1:
            total = self.trainer.strategy.reduce(total, reduce_op="sum")
        return bool(total > 0)

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        config = {"scheduler": scheduler}
        if monitor := getattr(scheduler, "monitor", None):  # Lightning's ReduceLROnPlateau names its metric
            config["monitor"] = monitor
        return {"optimizer": optimizer, "lr_scheduler": config}


def _check_streamed(role: str, cfg: ProbeConfig, given: dict[str, Any], data_dir) -> None:
    """Refuse a probe whose features differ from those the datamodule streams (groups, statistics, k, source; the
    layers and pooling of the hidden states it reads)."""
    keys = ("groups", "token_stats", "topk_stats", "top_k", "source", "hidden_norm") + \
        (("layer_ids", "pooling") if cfg.features.needs_hidden else ())
    probe = {k: getattr(cfg.features, k) for k in keys}
    data = {k: getattr(given["features"], k) for k in keys}
    if probe != data:
        raise ValueError(
            f"the {role} probe reads feature groups {list(cfg.features.groups)} (token statistics "
            f"{list(cfg.features.token_stats)}) but the datamodule streams {list(given['features'].groups)} (token "
            f"statistics {list(given['features'].token_stats)}) from {data_dir}; differing: "
            + ", ".join(f"{k}: probe {probe[k]!r}, data {data[k]!r}" for k in keys if probe[k] != data[k])
            + "; set data.feature_groups to the probe's groups, or build the module from the datamodule's input_spec"
        )
