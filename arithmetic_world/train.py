"""Train the embedded world's target, draft and judge (small Llama models) on CPU.

    python -m arithmetic_world.train --which target --out /tmp/world
    python -m arithmetic_world.train --which draft judge --out /tmp/world   # judge starts from OUT/target
    python -m arithmetic_world.card --publish /tmp/world                      # into checkpoints/arithmetic

Each model is a standard ``LlamaForCausalLM`` saved with ``save_pretrained`` (safetensors) next
to the shared word-level tokenizer and a model card. The target and draft learn from corpora with
different paraphrase-template preferences (the draft favours phrasings the target rarely uses);
the draft is small and stopped early so it makes real arithmetic mistakes; the judge learns to
answer `` yes``/`` no`` to :data:`~arithmetic_world.tokenizer.JUDGE_TEMPLATE`.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.nn.utils.rnn import pad_sequence
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from arithmetic_world import task
from arithmetic_world.tokenizer import JUDGE_TEMPLATE, build_tokenizer
from generation.cli import fail, one_line_parser
from generation.specs import SamplingSpec
from generation.sampling import generate
from generation.padding import left_pad
from generation.paths import folder_problem

TARGET_STYLE = (0.6, 0.3, 0.05, 0.05)
"""Template weights of the target's corpus (per operation): it prefers templates 0 and 1."""
DRAFT_STYLE = (0.05, 0.05, 0.3, 0.6)
"""Template weights of the draft's corpus: it prefers templates 2 and 3, which the target rarely uses."""


@dataclass
class ModelSpec:
    """Size and training budget of one of the world's models."""

    layers: int
    hidden: int
    heads: int
    steps: int
    batch: int = 64
    lr: float = 2e-3
    max_minutes: float = 60.0
    style: tuple[float, ...] = (0.25, 0.25, 0.25, 0.25)
    eval_every: int = 150
    stop_accuracy: Optional[float] = None
    """Stop once held-out accuracy reaches this (target)."""
    accuracy_band: Optional[tuple[float, float]] = None
    """Keep the last checkpoint whose accuracy lies in this band and stop above it (draft)."""
    extra: dict = field(default_factory=dict)


SPECS = {
    # 18 layers: at this width a forward's cost is mostly per-layer overhead, so a deep target keeps the one-layer
    # draft's cost per token under the world's 0.15 goal (benchmarks.world.decode_cost; docs/benchmarks.md).
    "target": ModelSpec(layers=18, hidden=128, heads=2, steps=3000, lr=3e-3, style=TARGET_STYLE, stop_accuracy=0.975,
                        max_minutes=95),
    "draft": ModelSpec(layers=1, hidden=96, heads=2, steps=2500, style=DRAFT_STYLE, accuracy_band=(0.45, 0.72),
                       eval_every=100, max_minutes=25),
    # Fine-tuned from the target by default: from scratch it learns far slower (docs/benchmarks.md, World).
    "judge": ModelSpec(layers=3, hidden=128, heads=2, steps=1500, lr=1e-3, batch=128, eval_every=250,
                       stop_accuracy=0.985, max_minutes=30),
}

EVAL_SEED = 10_000
"""Seed of the validation problems used while training (benchmarks use other seeds)."""


def build_model(spec: ModelSpec, vocab_size: int, tok) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=4 * spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg)


def lm_example(tok, p: task.Problem) -> tuple[list[int], int]:
    """Token ids of ``<bos> problem \\n\\n trace <eos>`` and where the trace starts (loss mask)."""
    prompt = tok(p.problem + task.STEP_DELIMITER)["input_ids"]  # starts with <bos>
    return prompt + tok(p.trace, add_special_tokens=False)["input_ids"] + [tok.eos_token_id], len(prompt)


def _random_meaning(rng: random.Random, op: Optional[str] = None) -> task.Meaning:
    """A meaning whose numbers all stay in the vocabulary's 0-199 (the result may be wrong)."""
    op = op or rng.choice(task.OPS)
    b = rng.randint(2, 3) if op == "mul" else rng.randint(1, 9)
    a = rng.randint(0, 199 // b if op == "mul" else (199 - b if op == "add" else 199))
    a = max(a, b) if op == "sub" else a
    r = task.apply_op(op, a, b) if rng.random() < 0.8 else rng.randint(0, 199)
    return task.Meaning(op, a, b, max(0, min(199, r)))


def judge_pair(rng: random.Random) -> tuple[str, str, bool]:
    """A pair of steps and whether they mean the same.

    Half are positives (any two templates); negatives change one field (hard: another operation,
    result off by one, operands swapped, operand off by one) or are two unrelated steps, as the
    target and draft write at the same point of a problem.
    """
    m1 = _random_meaning(rng)
    kind = rng.random()
    if kind < 0.45:
        m2 = m1
    elif kind < 0.57:
        m2 = m1._replace(op=rng.choice([o for o in task.OPS if o != m1.op]))
    elif kind < 0.69:
        m2 = m1._replace(result=m1.result + 1 if m1.result == 0 or (m1.result < 199 and rng.random() < 0.5)
                         else m1.result - 1)
    elif kind < 0.77:
        m2 = m1._replace(a=m1.b, b=m1.a) if m1.a != m1.b else m1._replace(b=m1.b + 1)
    elif kind < 0.85:
        m2 = m1._replace(b=m1.b + rng.choice([-1, 1]) if m1.b > 1 else m1.b + 1)
    else:
        m2 = m1
        while m2 == m1:
            m2 = _random_meaning(rng, op=m1.op if rng.random() < 0.5 else None)
    t1, t2 = rng.randrange(task.N_TEMPLATES), rng.randrange(task.N_TEMPLATES)
    return task.render_step(m1, t1), task.render_step(m2, t2), m1 == m2


def judge_example(tok, s1: str, s2: str, same: Optional[bool] = None) -> tuple[list[int], int]:
    """Token ids of the judge prompt (plus the answer when ``same`` is given) and the answer position."""
    prompt = tok(JUDGE_TEMPLATE.format(a=s1.strip(), b=s2.strip()))["input_ids"]  # starts with <bos>
    if same is None:
        return prompt, len(prompt)
    return prompt + tok(" yes" if same else " no", add_special_tokens=False)["input_ids"], len(prompt)


def collate(rows: list[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = pad_sequence([torch.tensor(r, dtype=torch.long) for r, _ in rows], batch_first=True, padding_value=pad_id)
    at = torch.arange(ids.shape[1])
    mask = (at < torch.tensor([len(r) for r, _ in rows])[:, None]).long()
    before = at < torch.tensor([start for _, start in rows])[:, None]  # the prompt: no loss
    return ids, mask, ids.masked_fill(before | (mask == 0), -100)


def eval_solver(model, tok, problems: list[task.Problem], temperature: float = 0.6, top_p: float = 0.95,
                seed: int = 0) -> float:
    """Share of ``problems`` answered correctly when the model samples its trace."""
    model.eval()
    prompts = [lm_example(tok, p)[0][: lm_example(tok, p)[1]] for p in problems]
    g = torch.Generator().manual_seed(seed)
    outs = generate(model, prompts, max_new_tokens=120, sampling=SamplingSpec(temperature, top_p), generator=g,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.train()
    return sum(task.check_answer(tok.decode(o, skip_special_tokens=True),
                                 p.answer) for o, p in zip(outs, problems)) / len(problems)


@torch.no_grad()
def judge_yes_prob(model, tok, pairs: list[tuple[str, str]]) -> torch.Tensor:
    """P(`` yes``) / (P(`` yes``) + P(`` no``)) for each pair, read from the next-token logits."""
    # left-padded, so the answer position is the last one in every row
    ids, mask = left_pad([judge_example(tok, a, b)[0] for a, b in pairs], tok.pad_token_id)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
    yes, no = tok.convert_tokens_to_ids([" yes", " no"])  # one token each in the world's vocabulary
    return torch.softmax(logits[:, [yes, no]].float(), -1)[:, 0]


def eval_judge(model, tok, n: int = 1000, seed: int = EVAL_SEED) -> float:
    rng = random.Random(seed)
    pairs = [judge_pair(rng) for _ in range(n)]
    model.eval()
    p = judge_yes_prob(model, tok, [(a, b) for a, b, _ in pairs])
    model.train()
    return float(((p > 0.5) == torch.tensor([s for _, _, s in pairs])).float().mean())


def train(which: str, out: Path, seed: int = 0, threads: int = 1, log: Callable[[str], None] = print,
          init_from: Optional[Path] = None) -> dict:
    """Train one of ``target``, ``draft``, ``judge`` and save it to ``out/which``. Returns its card facts.

    ``init_from`` starts from a saved model instead of random weights (the world's judge starts
    from the trained target: a judge that already reads every template).
    """
    spec = SPECS[which]
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    tok = build_tokenizer()
    model = _start_model(spec, tok, init_from)
    opt, sched = _optimizer(model, spec)
    rng = random.Random(seed + 1)
    cfg = task.TaskConfig(min_ops=2, max_ops=6, template_weights={op: spec.style for op in task.OPS})
    eval_problems = task.generate_problems(200, EVAL_SEED, replace(cfg, min_ops=4, max_ops=4))
    evaluate = (lambda: eval_judge(model, tok)) if which == "judge" else (lambda: eval_solver(model, tok,
                                                                                              eval_problems))
    # the last run's record goes first: a run stopped after its first save leaves new weights and no record (which
    # the card's --publish refuses), not new weights beside the old run's record
    (out / which / "training.json").unlink(missing_ok=True)
    history, saved, t0 = [], None, time.time()
    bar = tqdm(range(spec.steps), desc=f"train {which}", mininterval=10)
    for step in bar:
        if which == "judge":
            rows = [judge_example(tok, *judge_pair(rng)) for _ in range(spec.batch)]
        else:
            rows = [lm_example(tok, task.make_problem(rng, cfg)) for _ in range(spec.batch)]
        loss = _step(model, opt, sched, rows, tok.pad_token_id)
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        last = step == spec.steps - 1 or (time.time() - t0) / 60 > spec.max_minutes
        if (step + 1) % spec.eval_every == 0 or last:
            acc = evaluate()
            history.append({"step": step + 1, "minutes": round((time.time() - t0) / 60, 2),
                            "loss": round(loss.item(), 4), "accuracy": acc})
            log(f"[{which}] step {step + 1} loss {loss.item():.4f} held-out accuracy {acc:.3f} "
                f"({history[-1]['minutes']} min)")
            band = spec.accuracy_band
            if band is None or band[0] <= acc <= band[1]:
                save(model, tok, out / which)
                saved = history[-1]
            stop = spec.stop_accuracy is not None and acc >= spec.stop_accuracy
            if stop or (band is not None and acc > band[1]) or last:
                break
    if saved is None:  # never entered the band: keep the last model and say so in the card
        save(model, tok, out / which)
        saved = history[-1]
    facts = {"which": which, "spec": asdict(spec), "seed": seed, "threads": threads, "saved_at": saved,
             "history": history,
             "parameters": sum(p.numel() for p in model.parameters())}
    (out / which / "training.json").write_text(json.dumps(facts, indent=2))
    return facts


def _start_model(spec: ModelSpec, tok, init_from: Optional[Path]) -> LlamaForCausalLM:
    """A new model of ``spec``'s size, or the model saved at ``init_from`` (``spec`` then records where it came
    from and takes its size)."""
    if init_from is None:
        return build_model(spec, len(tok), tok)
    model = LlamaForCausalLM.from_pretrained(init_from, local_files_only=True)
    spec.extra["init_from"] = str(init_from)
    init_facts = Path(init_from) / "training.json"
    if init_facts.is_file():  # which step of which model the judge started from
        spec.extra["init_saved_at"] = json.loads(init_facts.read_text()).get("saved_at")
    spec.layers, spec.hidden = model.config.num_hidden_layers, model.config.hidden_size
    spec.heads = model.config.num_attention_heads
    return model


def _optimizer(model, spec: ModelSpec) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with 50 warm-up steps, then a cosine decay to a tenth of ``spec.lr`` over ``spec.steps``."""
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = 50
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / spec.steps)))),
    )
    return opt, sched


def _step(model, opt, sched, rows: list, pad_token_id: int) -> torch.Tensor:
    """One optimizer step on ``rows`` (gradients clipped to norm 1); returns the loss."""
    ids, mask, labels = collate(rows, pad_token_id)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss


def save(model, tok, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)


def main(argv: Optional[list[str]] = None) -> None:
    ap = one_line_parser("python -m arithmetic_world.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--which", nargs="+", default=["draft", "target", "judge"], choices=sorted(SPECS),
                    help="models to train, in order; the judge starts from OUT/target when it exists")
    ap.add_argument("--out", type=Path, required=True,
                    help="the training folder: each model is saved to OUT/<role> (publish finished models into the "
                         "world with `python -m arithmetic_world.card --publish OUT`)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the corpus and the initial weights")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--max-minutes", type=float, default=None, help="override every model's time budget")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="start from this saved model (e.g. the judge from the target)")
    ap.add_argument("--steps", type=int, default=None, help="override the number of optimizer steps")
    ap.add_argument("--lr", type=float, default=None, help="override the peak learning rate")
    ap.add_argument("--layers", type=int, default=None,
                    help="override the number of transformer layers (a judge then starts afresh, not from OUT/target)")
    args = ap.parse_args(argv)
    if problems := _option_problems(args):
        fail("python -m arithmetic_world.train", "; ".join(problems))
    for w in args.which:
        for key in ("max_minutes", "steps", "lr", "layers"):
            if getattr(args, key) is not None:
                setattr(SPECS[w], key, getattr(args, key))
        init = args.init_from
        if w == "judge" and init is None and args.layers is None and (args.out / "target" / "model.safetensors"
                                                                      ).is_file():
            init = args.out / "target"  # a judge that already reads every template learns in minutes (not resized)
        try:
            train(w, args.out, seed=args.seed, threads=args.threads, init_from=init)
        except KeyboardInterrupt:
            print(f"python -m arithmetic_world.train: interrupted while training the {w}; {args.out / w} holds its "
                  "last saved checkpoint, if any, and no training.json: train it again to finish", file=sys.stderr)
            raise SystemExit(130) from None


def _option_problems(args) -> list[str]:
    """What is wrong with the options, each naming the value (checked before anything is trained or written)."""
    out = [f"--{k} {getattr(args, k)}: expected an integer >= 1" for k in ("threads", "steps", "layers")
           if getattr(args, k) is not None and getattr(args, k) < 1]
    out += [f"--{k.replace('_', '-')} {getattr(args, k)}: expected a number > 0" for k in ("lr", "max_minutes")
            if getattr(args, k) is not None and not 0 < getattr(args, k) < math.inf]
    if not 0 <= args.seed < 2**63:  # torch's seed is a signed 64-bit integer: a traceback past it
        out.append(f"--seed {args.seed}: expected an integer from 0 to 2**63 - 1")
    if args.init_from is not None and len(args.which) > 1:  # every model named would start from the one folder
        out.append(f"--init-from {args.init_from} with --which {' '.join(args.which)}: it starts one model; train "
                   "the others in their own command")
    elif args.init_from is not None and not (args.init_from / "config.json").is_file():
        out.append(f"--init-from {args.init_from}: expected a saved model's folder (with config.json)")
    elif args.init_from is not None and args.layers is not None:
        out.append(f"--layers {args.layers} with --init-from {args.init_from}: the model keeps the layers it was saved "
                   "with; leave one of them out")
    elif args.init_from is not None and (problem := _init_problem(args.init_from)):
        out.append(f"--init-from {args.init_from}: {problem}")
    if problem := folder_problem(args.out, "--out"):  # checked now: a model is first saved after minutes of training
        out.append(problem)
    return out


def _init_problem(folder: Path) -> str | None:
    """Why ``folder`` holds no world model to start from (a Llama of the world's vocabulary whose weights file reads),
    or None: transformers fills in a default Llama for any other config.json and trains it."""
    from safetensors import SafetensorError, safe_open

    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        return f"its config.json cannot be read ({e})"
    if not isinstance(cfg, dict) or cfg.get("architectures") != ["LlamaForCausalLM"]:
        return "not a saved world model (its config.json names no LlamaForCausalLM)"
    if cfg.get("vocab_size") != (vocab := len(build_tokenizer())):
        return f"a model of vocab_size {cfg.get('vocab_size')!r}, not the world tokenizer's {vocab}"
    try:
        with safe_open(str(folder / "model.safetensors"), "pt"):
            pass
    except (OSError, SafetensorError) as e:
        return f"its model.safetensors cannot be read ({e})"
    return None


if __name__ == "__main__":
    main()
