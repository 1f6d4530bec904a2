"""Publish the embedded world's trained models and write their model cards from measured numbers.

    python -m datamodules.arithmetic.card --publish /tmp/world   # copy finished models into checkpoints/arithmetic
    python -m benchmarks.world                                   # measure them
    python -m datamodules.arithmetic.card                        # write every README.md from the measurements

A card says how its model was trained (sizes, steps, minutes, data and template styles, seed, the
command, read from the folder's ``training.json``) and what it measures (accuracy, decode ms/token,
template distribution, judge accuracy, read from ``benchmarks/results/world.json``). Nothing in a
card is typed by hand, so re-training and re-measuring keeps it true.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Optional

from datamodules.arithmetic import models, task
from datamodules.arithmetic.tokenizer import JUDGE_TEMPLATE, build_tokenizer
from datamodules.arithmetic.train import SPECS

RESULTS = models.REPO_ROOT / "benchmarks" / "results" / "world.json"
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
    missing = [f for f in ("config.json", "model.safetensors", "training.json") if not (src / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{src} is missing {', '.join(missing)}; has `train --which {role}` finished?")
    tok = build_tokenizer()
    if (src / "tokenizer.json").is_file():
        old_vocab = json.loads((src / "tokenizer.json").read_text())["model"]["vocab"]
        if old_vocab != tok.get_vocab():
            raise ValueError(
                f"{src / 'tokenizer.json'} has another vocabulary than build_tokenizer(); "
                "the model was trained on other ids"
            )
    tmp = dst.with_name(dst.name + ".publishing")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, tmp / name)  # not copy2: training writes weights owner-only (0600)
    tok.save_pretrained(tmp)
    if (dst / "README.md").is_file():
        shutil.copyfile(dst / "README.md", tmp / "README.md")
    if dst.exists():
        shutil.rmtree(dst)
    tmp.rename(dst)
    return dst


def train_command(role: str, facts: dict) -> str:
    """The training command that reproduces ``facts`` (``training.json``), with the overrides it used."""
    spec, default = facts["spec"], SPECS[role]
    cmd = f"python -m datamodules.arithmetic.train --which {role} --seed {facts['seed']} --out /tmp/world"
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


def _fmt_shares(xs) -> str:
    return " / ".join(f"{x:.2f}" for x in xs)


def _training_section(role: str, folder: Path, facts: dict, cfg: dict) -> list[str]:
    spec, saved = facts["spec"], facts["saved_at"]
    weights_mb = (folder / "model.safetensors").stat().st_size / 1e6
    lines = [
        "## Model",
        "",
        "| | |",
        "|---|---|",
        f"| architecture | `{cfg['architectures'][0]}` (transformers), tied input/output embeddings |",
        f"| layers x width | {cfg['num_hidden_layers']} x {cfg['hidden_size']} ({cfg['num_attention_heads']} heads, "
        f"MLP {cfg['intermediate_size']}) |",
        f"| parameters | {facts['parameters']:,} ({weights_mb:.1f} MB float32 safetensors) |",
        f"| vocabulary | {cfg['vocab_size']} word-level tokens (every number 0-199 is one token), "
        f"context {cfg['max_position_embeddings']} |",
        "",
        "## Training",
        "",
    ]
    if role == "judge":
        lines.append(
            "Data: fresh step pairs every batch from `train.judge_pair`: half the same meaning in two random "
            "templates, the rest mostly hard negatives (another operation on the same numbers, result off by one, "
            "swapped or shifted operands); the loss is on the ` yes`/` no` answer token only."
        )
    if spec.get("extra", {}).get("init_from"):
        lines.append(
            f"\nInitialised from the weights in `{spec['extra']['init_from']}` (a model of the world that already "
            "reads every template), not from random weights; its size is that model's."
        )
    else:
        lines.append(
            "Data: fresh problems every batch from `task.make_problem` with `TaskConfig(min_ops=2, max_ops=6)` "
            "(start 1-20, add/subtract 1-9, multiply by 2-3, every intermediate result in 0-199); the loss "
            "is on the trace and the answer line only, not the problem. Template weights per operation "
            f"(templates 0/1/2/3): **{_fmt_shares(spec['style'])}**."
        )
    stop = (
        f"stop at held-out accuracy >= {spec['stop_accuracy']}"
        if spec.get("stop_accuracy") is not None
        else f"keep the last checkpoint with held-out accuracy in {spec['accuracy_band']}, stop above it"
        if spec.get("accuracy_band")
        else "run all steps"
    )
    lines += [
        "",
        f"- optimizer: AdamW, lr {spec['lr']}, betas (0.9, 0.98), weight decay 0.01, 50 warm-up steps, "
        "cosine decay to 10%, "
        f"gradient clipping 1.0, batch {spec['batch']} {'pairs' if role == 'judge' else 'problems'}",
        f"- budget: {spec['steps']} steps or {spec['max_minutes']} minutes; rule: {stop}; "
        f"evaluation every {spec['eval_every']} steps "
        f"({'1,000 judge pairs' if role == 'judge' else '200 four-operation problems, T=0.6, top-p 0.95'}, "
        "seed 10,000)",
        f"- **shipped checkpoint: step {saved['step']}, after {saved['minutes']} minutes** "
        f"on {facts.get('threads', 1)} CPU thread(s) of a shared 2-core machine "
        f"(held-out {'pair' if role == 'judge' else 'answer'} accuracy {saved['accuracy']:.3f} at that point)",
        f"- seed {facts['seed']}; command: `{train_command(role, facts)}` "
        "then `python -m datamodules.arithmetic.card --publish /tmp/world`",
        "",
        "<details><summary>validation history</summary>",
        "",
        "| step | minutes | loss | held-out accuracy |",
        "|---|---|---|---|",
    ]
    lines += [f"| {h['step']} | {h['minutes']} | {h['loss']} | {h['accuracy']:.3f} |" for h in facts["history"]]
    lines += ["", "</details>", ""]
    return lines


def _measured_section(role: str, r: Optional[dict]) -> list[str]:
    lines = ["## Measured (`python -m benchmarks.world`)", ""]
    if r is None:
        return lines + [
            "Not measured yet: run `python -m benchmarks.world`, then `python -m datamodules.arithmetic.card`.",
            "",
        ]
    dist = r["template_distribution"]
    lines += [
        f"On {r['n_problems']} held-out four-operation problems (seed {r['problem_seed']}), each model sampling at "
        f"T={r['temperature']}, top-p {r['top_p']} with `generation.writer.generate`; decode cost at batch 1 with "
        f"the same code, {r['torch_threads']} CPU thread(s), median over {r['target']['timing_prompts']} prompts "
        f"of {r['target']['timing_new_tokens']} tokens, prefill excluded.",
        "",
        "| model | answer accuracy (95% CI) | decode ms/token | templates written 0/1/2/3 | true steps "
        "| steps as reference |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("target", "draft"):
        m, d = r[name], dist[name]
        mark = " **(this model)**" if name == role else ""
        lines.append(
            f"| {name}{mark} | {m['accuracy']:.3f} ({m['accuracy_ci95'][0]:.2f}-{m['accuracy_ci95'][1]:.2f}) | "
            f"{m['ms_per_token']:.3f} | {_fmt_shares(d['shares'])} | {d['correct_step_share']:.3f} | "
            f"{m['reference_step_share']:.3f} |"
        )
    c = r["judge_confusion"]
    lines += [
        "",
        f"- cost ratio draft/target: **{r['cost_ratio']:.3f}** (goal <= 0.2); style distance between the two "
        f"models' template shares (total variation): {dist['style_distance']:.2f}",
        f"- judge{' **(this model)**' if role == 'judge' else ''}: **{r['judge_accuracy']:.3f}** "
        "agreement with the oracle on "
        f"{r['judge_pairs']} held-out pairs (seed {r['judge_seed']}); yes on same {c['true_yes']}, yes on different "
        f"{c['false_yes']}, no on same {c['false_no']}, no on different {c['true_no']}",
    ]
    if role == "judge":
        lines.append(
            "- judge accuracy by pair kind: "
            + ", ".join(f"{k} {v['accuracy']:.3f} (n={v['n']})" for k, v in r["judge_accuracy_by_kind"].items())
        )
        ms = r.get("judge_on_model_steps", {"pairs": 0})
        if ms["pairs"]:
            lines.append(
                f"- on the models' own steps (the target's and the draft's step at the same position of a benchmark "
                f"problem, {ms['pairs']} pairs, {ms['same_share']:.0%} the same meaning): {ms['accuracy']:.3f} "
                f"(on same {ms['accuracy_on_same']}, on different {ms['accuracy_on_different']})"
            )
            if (ms.get("accuracy_on_different") or 1.0) < 0.9:
                lines.append(
                    "  - most errors here are steps that differ in several numbers at once (another operand *and* "
                    "result), a kind of negative `train.judge_pair` never draws"
                )
        if "judge_pairs_seen_in_training" in r:
            lines.append(
                f"- {r['judge_pairs_seen_in_training']:.0%} of the benchmark pairs also occur in the judge's training "
                "stream (the space of pairs is small), so this is in-distribution agreement, not generalisation."
            )
    if role in ("target", "draft"):
        d = dist[role]
        lines.append(
            f"- this model's steps: {d['steps']} written, {d['malformed_share']:.1%} not a well-formed step; "
            "template shares by operation: " + ", ".join(f"{op} {_fmt_shares(v)}" for op, v in d["by_op"].items())
        )
        lines.append(
            f"- decode {r[role]['ms_per_token']:.3f} ms/token, prefill of a prompt {r[role]['prefill_ms']:.2f} ms"
        )
        lines += [
            "",
            "A trace this model sampled (problem 0 of the benchmark):",
            "",
            "```",
            r[role]["example_trace"],
            "```",
        ]
    if role == "judge" and "judge_decode" in r:
        lines.append(
            f"- decode {r['judge_decode']['ms_per_token']:.3f} ms/token, "
            f"prefill of a prompt {r['judge_decode']['prefill_ms']:.2f} ms"
        )
    missed = [g for g, ok in r["goals"].items() if not ok]
    lines += ["", "Goals of issue 6 missed: " + (", ".join(missed) if missed else "none") + ".", ""]
    return lines


def card_text(role: str, folder: Path, results: Optional[dict]) -> str:
    """The README.md of one model folder, from its ``training.json`` and the benchmark's ``results``."""
    facts = json.loads((folder / "training.json").read_text())
    cfg = json.loads((folder / "config.json").read_text())
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [semanticspec, speculative-decoding, arithmetic, toy-world]",
        "---",
        "",
        f"# SemanticSpec arithmetic world: {role}",
        "",
        f"A small `LlamaForCausalLM` trained from scratch on CPU for the embedded world of semanticspec-probes "
        f'(issue 6; "The embedded world" in docs/design.md). It is {ROLE_TEXT[role]}',
        "",
        "A prompt is `<bos>` + problem + blank line; the trace writes one operation per step, steps separated "
        f"by a blank line, and ends with `{task.ANSWER_MARKER} N` and `<eos>`:",
        "",
        "```",
        "Start with 7. Add 5, then multiply it by 3. What is the result?",
        "",
        "7 + 5 = 12.",
        "",
        "36 is what we get from 12 times 3.",
        "",
        "Answer: 36",
        "```",
        "",
    ]
    lines += _training_section(role, folder, facts, cfg)
    lines += _measured_section(role, results)
    lines += [
        "## Use",
        "",
        "```python",
        "from datamodules.arithmetic.models import load_world  # or AutoModelForCausalLM.from_pretrained(folder)",
        "world = load_world()  # world.target, world.draft, world.judge, world.tokenizer",
        "```",
        "",
        "## Limitations",
        "",
        f"A toy: a closed vocabulary of {cfg['vocab_size']} words and numbers, problems of one shape. "
        "Accuracy is measured "
        'by sampling and has the interval shown; held-out means other seeds, not unseen kinds of problem. "true steps" '
        'are equations that hold; "steps as reference" also do the problem\'s operation at that position.',
        "",
    ]
    return "\n".join(lines)


def write_card(role: str, root: Optional[str | Path] = None, results: Optional[dict] = None) -> Path:
    """Write ``root/role/README.md``; returns its path."""
    folder = models.model_dir(role, root)
    path = folder / "README.md"
    path.write_text(card_text(role, folder, results))
    return path


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--root", type=Path, default=None, help="world folder (default $SEMANTICSPEC_WORLD or checkpoints/arithmetic)"
    )
    ap.add_argument("--publish", type=Path, default=None, help="first copy finished models from this training folder")
    ap.add_argument("--roles", nargs="+", default=list(models.ROLES), choices=models.ROLES)
    ap.add_argument("--results", type=Path, default=RESULTS, help="benchmarks/world.py output to report")
    args = ap.parse_args(argv)
    results = json.loads(args.results.read_text()) if args.results.is_file() else None
    for role in args.roles:
        if args.publish is not None:
            print(f"published {publish(role, args.publish, args.root)}")
        print(f"wrote {write_card(role, args.root, results)}")


if __name__ == "__main__":
    main()
