"""Does ``torch.compile`` with a static cache cut the per-token cost on CPU, and the draft/target cost ratio?

    python -m benchmarks.compile            # 60 decode steps per model (benchmarks/results/compile.json)
    python -m benchmarks.compile --quick    # 20 steps (compile-quick.json)

Whether ``torch.compile`` or a static cache measurably helps on CPU: this times one-token decode steps of the
world's target and draft at batch 1, greedy, three ways: eager with a ``DynamicCache`` (what the package runs), eager
with a ``StaticCache``, and ``torch.compile`` of the forward with a ``StaticCache`` (fixed shapes, so
one compilation). It reports ms per token, the compile time, and the draft/target ratio of each,
which is what bounds speculative decoding's speedup (docs/design.md "Benchmark figures").
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache, StaticCache

from benchmarks import harness
from arithmetic_world import models

PROMPT = "Start with 7. Add 5, then multiply it by 3, then add 2, then subtract 4. What is the result?\n\n"


@torch.no_grad()
def per_token_ms(model, prompt: torch.Tensor, steps: int, mode: str, forward=None) -> float:
    """Mean ms of ``steps`` one-token decode steps after the prompt (greedy)."""
    L = prompt.shape[1]
    if mode == "dynamic":
        cache = DynamicCache(config=model.config)
        out = model(input_ids=prompt, cache=cache, use_cache=True)
    else:
        cache = StaticCache(config=model.config, max_cache_len=L + steps + 1)
        out = model(input_ids=prompt, cache=cache, use_cache=True, cache_position=torch.arange(L))
    forward = forward or model
    tok = out.logits[:, -1:].argmax(-1)
    t0 = time.perf_counter()
    for k in range(steps):
        kw = {} if mode == "dynamic" else {"cache_position": torch.tensor([L + k])}
        out = forward(input_ids=tok, cache=cache, use_cache=True, **kw)
        tok = out.logits[:, -1:].argmax(-1)
    return (time.perf_counter() - t0) / steps * 1000


def main(argv=None) -> dict:
    ap = harness.parser(__doc__, quick="20 steps, writes compile-quick.json", threads=1, name="compile")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = 20 if args.quick else 60
    world = models.load_world(None)
    prompt = torch.tensor([world.tokenizer(PROMPT).input_ids])
    res: dict = {"steps": steps, "threads": args.threads, "models": {}}
    for name in ("target", "draft"):
        m = getattr(world, name)
        row = {}
        for mode in ("dynamic", "static"):
            per_token_ms(m, prompt, steps, mode)  # warm-up
            row[f"eager_{mode}_ms"] = min(per_token_ms(m, prompt, steps, mode) for _ in range(3))
        compiled = torch.compile(m.forward, dynamic=False)
        t0 = time.perf_counter()
        per_token_ms(m, prompt, steps, "static", compiled)  # compiles
        row["compile_s"] = time.perf_counter() - t0
        row["compiled_static_ms"] = min(per_token_ms(m, prompt, steps, "static", compiled) for _ in range(3))
        res["models"][name] = row
    t, d = res["models"]["target"], res["models"]["draft"]
    res["ratio"] = {k: d[k] / t[k] for k in ("eager_dynamic_ms", "eager_static_ms", "compiled_static_ms")}
    harness.write(res, harness.results_path("compile", args.quick, args.out), table(res))
    return res


def table(res: dict) -> str:
    """ms per token of each model and mode, and the draft/target ratios, as markdown."""
    modes = ("eager_dynamic_ms", "eager_static_ms", "compiled_static_ms")
    rows = [[name, *(f"{r[k]:.3f}" for k in modes), f"{r['compile_s']:.1f}"] for name, r in res["models"].items()]
    rows.append(["draft/target", *(f"{res['ratio'][k]:.3f}" for k in modes), ""])
    return harness.table(["model", "eager DynamicCache ms/token", "eager StaticCache", "compiled StaticCache",
                          "compile s"], rows)


if __name__ == "__main__":
    main()
