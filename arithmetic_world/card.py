"""Publish the embedded world's trained models and write their model cards from measured numbers.

    python -m arithmetic_world.card --publish /tmp/world   # copy finished models into checkpoints/arithmetic
    python -m benchmarks.world                                   # measure them
    python -m arithmetic_world.card                        # write every README.md from the measurements

A card says how its model was trained (sizes, steps, minutes, data and template styles, seed, the
command, read from the folder's ``training.json``) and what it measures (accuracy, decode ms/token,
template distribution, judge accuracy, read from ``benchmarks/results/world.json``). Nothing in a
card is typed by hand, so re-training and re-measuring keeps it true. The front matter is a
:class:`~huggingface_hub.ModelCardData` (with the model's own accuracy as its ``model-index``); the
body is the Jinja template ``card_template.md`` beside this module, rendered by
:meth:`~huggingface_hub.ModelCard.from_template`.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Optional

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from arithmetic_world import models, task
from arithmetic_world.tokenizer import JUDGE_TEMPLATE, build_tokenizer
from arithmetic_world.train import SPECS
from generation.cli import fail, one_line_parser
from generation.paths import REPO_ROOT, atomic_path

RESULTS = REPO_ROOT / "benchmarks" / "results" / "world.json"
COPIED_FILES = ("config.json", "generation_config.json", "model.safetensors", "training.json")
"""What :func:`publish` copies from a training folder; the tokenizer is rebuilt in code instead."""
ROLE_TEXT = {
    "target": "the world's **target**: the larger model whose meaning-level choices speculative decoding "
    "should keep. It writes one arithmetic step per blank-line-separated step and prefers "
    "paraphrase templates 0 and 1.",
    "draft": "the world's **draft**: a one-layer model, stopped early so that it makes real arithmetic "
    "mistakes, trained on a corpus that prefers templates 2 and 3, which the target rarely uses "
    "(a style mismatch that token-level verification punishes and semantic verification need not).",
    "judge": "the world's **equivalence judge**: it answers ` yes` or ` no` to "
    f"`{JUDGE_TEMPLATE!r}` (two steps, any templates), read from the next-token logits of "
    "` yes` and ` no`.",
}


def check_publishable(role: str, src_root: str | Path) -> None:
    """Refuse a model folder that has not finished training: a missing file (FileNotFoundError), or a
    ``training.json`` that is no record of a training (ValueError), each naming the folder or file."""
    src = Path(src_root) / role
    missing = [f for f in ("config.json", "model.safetensors", "training.json") if not (src / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{src} is missing {', '.join(missing)}; has `train --which {role}` finished?")
    facts = _read_json(src / "training.json")
    if not (isinstance(facts, dict) and isinstance(facts.get("spec"), dict)):
        raise ValueError(f"{src / 'training.json'}: no record of a training (a JSON object with its spec); train "
                         f"the model again with `train --which {role}`")


def publish(role: str, src_root: str | Path, dst_root: Optional[str | Path] = None) -> Path:
    """Copy a finished model from ``src_root/role`` to ``dst_root/role``, with the current tokenizer.

    The folder is assembled next to its destination and renamed into place, so a failure leaves
    the old folder whole. The tokenizer is saved from :func:`build_tokenizer` (same vocabulary ids
    as the one training used), so every folder ships the same, current tokenizer.

    Raises:
        FileNotFoundError: naming the folder and file when the model is missing or has not
            finished training (no ``training.json``).
        ValueError: when the folder's tokenizer has other vocabulary ids than :func:`build_tokenizer`.
    """
    src, dst = Path(src_root) / role, models.world_root(dst_root) / role
    check_publishable(role, src_root)
    tok = build_tokenizer()
    if (src / "tokenizer.json").is_file():
        old_vocab = json.loads((src / "tokenizer.json").read_text())["model"]["vocab"]
        if old_vocab != tok.get_vocab():
            raise ValueError(
                f"{src / 'tokenizer.json'} has another vocabulary than build_tokenizer(); "
                "the model was trained on other ids"
            )
    with atomic_path(dst, folder=True) as tmp:  # the old folder is replaced only once the new one is whole
        for name in COPIED_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)  # not copy2: training writes weights owner-only (0600)
        tok.save_pretrained(tmp)
        if (dst / "README.md").is_file():
            shutil.copyfile(dst / "README.md", tmp / "README.md")
    return dst


def train_command(role: str, facts: dict) -> str:
    """The training command that reproduces ``facts`` (``training.json``), with the overrides it used."""
    spec, default = facts["spec"], SPECS[role]
    cmd = f"python -m arithmetic_world.train --which {role} --seed {facts['seed']} --out /tmp/world"
    if facts.get("threads", 1) != 1:
        cmd += f" --threads {facts['threads']}"
    if spec.get("extra", {}).get("init_from"):
        cmd += f" --init-from {spec['extra']['init_from']}"
    keys = ("steps", "lr", "max_minutes") if spec.get("extra", {}).get("init_from") else ("layers", "steps", "lr",
                                                                                          "max_minutes")
    for key in keys:  # with --init-from the layers come from the model it starts from
        if spec[key] != getattr(default, key):
            cmd += f" --{key.replace('_', '-')} {spec[key]}"
    return cmd


TEMPLATE = Path(__file__).with_name("card_template.md")
"""A card's body, a Jinja template (Jinja drops the last newline): ``facts`` is the folder's ``training.json``,
``cfg`` its ``config.json``, ``r`` the benchmark's results or None."""


def card_text(role: str, folder: Path, results: Optional[dict]) -> str:
    """The README.md of one model folder.

    Args:
        role: ``target``, ``draft`` or ``judge``.
        folder: the model's folder, with ``training.json``, ``config.json`` and ``model.safetensors``.
        results: the output of ``benchmarks.world`` (``benchmarks/results/world.json``), or None when
            the models are not measured yet.

    Returns:
        The card's text: Hub front matter, then the sections "Model", "Training", "Measured", "Use"
        and "Limitations".
    """
    facts = _read_json(folder / "training.json")
    spec = facts["spec"]
    if spec.get("stop_accuracy") is not None:
        stop = f"stop at held-out accuracy >= {spec['stop_accuracy']}"
    elif spec.get("accuracy_band"):
        stop = f"keep the last checkpoint with held-out accuracy in {spec['accuracy_band']}, stop above it"
    else:
        stop = "run all steps"
    data = ModelCardData(library_name="transformers", license="apache-2.0", pipeline_tag="text-generation",
                         tags=["semanticspec", "speculative-decoding", "arithmetic", "toy-world"],
                         **_eval_results(role, results))
    card = ModelCard.from_template(
        data, template_path=TEMPLATE, role=role, role_text=ROLE_TEXT[role], answer_marker=task.ANSWER_MARKER,
        facts=facts, spec=spec, cfg=_read_json(folder / "config.json"), r=results, stop=stop,
        weights_mb=(folder / "model.safetensors").stat().st_size / 1e6, command=train_command(role, facts),
        init_from=spec.get("extra", {}).get("init_from"), shares=lambda xs: " / ".join(f"{x:.2f}" for x in xs),
        missed=[g for g, ok in results["goals"].items() if not ok] if results else [])
    return str(card)


def _eval_results(role: str, r: Optional[dict]) -> dict:
    """The model's own measured accuracy as ``ModelCardData`` fields (its ``model-index``), if measured."""
    if r is None:
        return {}
    if role == "judge":
        result = EvalResult(task_type="text-classification", dataset_type="semanticspec-arithmetic-world",
                            dataset_name=f"{r['judge_pairs']} held-out step pairs (seed {r['judge_seed']})",
                            metric_type="accuracy", metric_name="agreement with the oracle",
                            metric_value=r["judge_accuracy"])
    else:
        result = EvalResult(task_type="text-generation", dataset_type="semanticspec-arithmetic-world",
                            dataset_name=f"{r['n_problems']} held-out four-operation problems "
                                         f"(seed {r['problem_seed']})",
                            metric_type="accuracy", metric_name="answer accuracy", metric_value=r[role]["accuracy"])
    return {"model_name": f"semanticspec-arithmetic-{role}", "eval_results": [result]}


def write_card(role: str, root: Optional[str | Path] = None, results: Optional[dict] = None) -> Path:
    """Write ``root/role/README.md``; returns its path."""
    folder = models.model_dir(role, root)
    path = folder / "README.md"
    path.write_text(card_text(role, folder, results))
    return path


def main(argv: Optional[list[str]] = None) -> None:
    ap = one_line_parser("python -m arithmetic_world.card", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--root", type=Path, default=None, help="world folder (default $SEMANTICSPEC_WORLD or checkpoints/arithmetic)"
    )
    ap.add_argument("--publish", type=Path, default=None, help="first copy finished models from this training folder")
    ap.add_argument("--roles", nargs="+", default=list(models.ROLES), choices=models.ROLES,
                    help="the models whose cards are written")
    ap.add_argument("--results", type=Path, default=None,
                    help="benchmarks/world.py output to report (default benchmarks/results/world.json, where measured)")
    args = ap.parse_args(argv)
    prog = "python -m arithmetic_world.card"
    path = args.results or RESULTS
    if args.results is not None and not path.is_file():
        fail(prog, f"--results {path}: {'is a folder' if path.is_dir() else 'no such file'}; give the JSON of "
             "`python -m benchmarks.world`")
    try:
        results = json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError as e:
        fail(prog, f"--results {path}: not valid JSON ({e})")
    if results is not None and not (isinstance(results, dict) and {"n_problems", "goals", "target", "draft"} <=
                                    results.keys()):  # every card shows both models' figures
        fail(prog, f"--results {path}: not the output of `python -m benchmarks.world` (a JSON object with "
             "n_problems, goals, target and draft)")
    if results is not None and (why := _measured_elsewhere(results, args.root, args.publish, args.roles)):
        print(f"{prog}: {path} measured {why}: the cards say the models are not measured yet", file=sys.stderr)
        results = None
    try:
        for role in args.roles if args.publish is not None else ():  # every one before any is copied
            check_publishable(role, args.publish)
        for role in args.roles:
            if args.publish is not None:
                print(f"published {publish(role, args.publish, args.root)}")
            print(f"wrote {write_card(role, args.root, results)}")
    except (OSError, ValueError, KeyError) as e:  # a missing model folder or training.json, an unfinished training
        fail(prog, str(e))


def _measured_elsewhere(results: dict, root: Optional[Path], publish: Optional[Path], roles) -> str | None:
    """Which models ``results`` measured when they are not the ones the cards describe, or None. Those are the world
    folder's, ``roles`` replaced by the ones being published. Results that record the weights they measured
    (``weights``: each model's :func:`~generation.fingerprints.weights_stamp`) are compared by them, so a copy of the
    world states its figures and a model retrained in place does not; older ones by the folder they were measured in
    (as ``benchmarks.world`` records it: relative to the repository, or the folder's name)."""
    from generation.fingerprints import weights_stamp
    from generation.paths import portable_paths

    world = models.world_root(root)
    described = {r: Path(publish if publish is not None and r in roles else world) / r for r in models.ROLES}
    if isinstance(stamps := results.get("weights"), dict):
        other = [r for r, stamp in stamps.items() if r in described and described[r].is_dir()
                 and weights_stamp(described[r]) != stamp]
        return f"other weights of the {' and the '.join(other)}" if other else None
    # publishing replaces the world's models: only figures measured on the published ones describe them now
    here = {portable_paths(str(Path(publish if publish is not None else world).resolve()))}
    measured = results.get("root")
    return None if measured is None or measured in here else f"the models in {measured}"


def _read_json(path: Path):
    """The JSON in ``path`` (ValueError naming the file when it is not JSON)."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); train the model again, or restore the file") from None


if __name__ == "__main__":
    main()
