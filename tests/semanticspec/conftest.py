"""Helpers of the decoder's tests: stub probes, a decoder built from flat knobs, and stream checks."""

import torch

from generation.specs import TOPK_STATS, FeatureSpec, StepSpec
from generation.steps import DEFAULT_DELIMITERS
from probes.config import ProbeConfig
from semanticspec.decoder import SemanticSpecDecoder
from semanticspec.config import DecodeConfig
from semanticspec.policies import ProbePolicy

GREEDY = {"temperature": 0.0, "max_new_tokens": 24}
SIX = StepSpec(DEFAULT_DELIMITERS, 6)
"""Steps of at most 6 tokens: what most stub probes here were "trained" on."""


class ConstProbe(torch.nn.Module):
    """Stub probe: always ``value`` (1 = accept, 0 = reject), or a function of the features."""

    def __init__(self, hidden_size: int, value=1.0, layer_ids=(-1,), groups=("hidden",), stats=(), role="target",
                 step=None):
        super().__init__()
        self.config = ProbeConfig(hidden_size=hidden_size, hidden_dims=[], role=role, step=step or StepSpec(),
                                  features=FeatureSpec(groups, layer_ids, token_stats=stats, topk_stats=TOPK_STATS))
        self.value = value
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if callable(self.value):
            return self.value(x)
        return torch.full((x.shape[0],), float(self.value))


POLICY = set(ProbePolicy.__dataclass_fields__)
OPTIONS = {"target_first_step", "step", "answer_marker", "token_sd", "token_sd_tokens", "rewrite_in_rounds",
           "bonus_token", "judge_suffix"}
"""The loop settings of a DecodeConfig."""


def make_decoder(target, draft, tok, draft_tokenizer=None, target_probe=None, draft_probe=None, **kw):
    """The decoder with ``kw`` sorted into its policy and its default config's loop settings (the flat knobs tests read
    best); ``delimiters``/``max_step_tokens`` make the config's ``step``."""
    if "delimiters" in kw or "max_step_tokens" in kw:
        kw["step"] = StepSpec(tuple(kw.pop("delimiters", None) or DEFAULT_DELIMITERS),
                              kw.pop("max_step_tokens", None) or StepSpec.max_step_tokens)
    policy = ProbePolicy(**{k: v for k, v in kw.items() if k in POLICY})
    config = DecodeConfig(**{k: v for k, v in kw.items() if k in OPTIONS})
    unknown = set(kw) - POLICY - OPTIONS
    assert not unknown, unknown
    return SemanticSpecDecoder(target, draft, tok, draft_tokenizer, target_probe, draft_probe, policy, config)


def stub_decoder(target, draft, tok, q=1.0, p=1.0, groups=("hidden",), stats=(), layer_ids=(-1,), **kw):
    kw.setdefault("top_k", 0)
    kw.setdefault("max_step_tokens", 6)
    probes = [ConstProbe(m.config.hidden_size, v, layer_ids, groups, stats, role)
              for m, v, role in ((target, q, "target"), (draft, p, "draft"))]
    for probe in probes:  # the probes were "trained" on the steps the test asks for
        probe.config.step = StepSpec(tuple(kw.get("delimiters") or DEFAULT_DELIMITERS), kw["max_step_tokens"])
    return make_decoder(target, draft, tok, target_probe=probes[0], draft_probe=probes[1], **kw)


def texts(results):
    return [r.text for r in results]


def check_stream(events, results, n_prompts: int) -> None:
    """Each prompt's events: its steps in order, each with the output so far, then one end event carrying what
    ``generate`` returned."""
    for k in range(n_prompts):
        mine = [e for e in events if e.prompt == k]
        assert [e.end for e in mine] == [False] * (len(mine) - 1) + [True], k
        end, so_far = mine[-1], ""
        assert end.result.text == results[k].text and end.stop_reason == results[k].stop_reason, k
        assert [e.step for e in mine[:-1]] == end.result.steps, k  # every step tried, refused ones too
        for e in mine[:-1]:
            so_far += e.step.text if e.step.decision != "reject" else ""
            assert e.text == so_far, k
        assert so_far == results[k].text, k  # the world's tokenizer decodes the steps as their texts join
