"""`DecodeConfig`: one typed, frozen config of a ``generate`` call, checked where it is built,
read alike by both decoders; keyword arguments change a copy of it."""

import dataclasses

import pytest

from semanticspec import DecodeConfig, ProbePolicy
from semanticspec.policies import RandomPolicy
from tests.conftest import PROMPTS


@pytest.mark.parametrize("field, value, said", [
    ("max_new_tokens", 0, "max_new_tokens=0: expected an integer >= 1"),
    ("max_new_tokens", 2.5, "max_new_tokens=2.5: expected an integer >= 1"),
    ("max_new_tokens", True, "max_new_tokens=True: expected an integer >= 1"),
    ("temperature", -0.1, "temperature=-0.1: expected a finite number >= 0"),
    ("temperature", float("nan"), "temperature=nan: expected a finite number >= 0"),
    ("temperature", 10**400, "temperature=1000000"),  # an int past a float's range: it was an OverflowError
    ("top_p", 0.0, "top_p=0.0: expected a number in (0, 1]"),
    ("top_p", "0.9", "top_p='0.9': expected a number in (0, 1]"),
    ("seed", "7", "seed='7': expected an integer, or a list of one integer per prompt"),
    ("seed", [1, 2.0], "seed[1]=2.0: expected integers (one seed per prompt)"),
    ("method", 3, "method=3: expected a method name or an AcceptancePolicy"),
    ("batch_size", 0, "batch_size=0: expected an integer >= 1, or None"),
    ("allow_sampling_mismatch", 1, "allow_sampling_mismatch=1: expected True or False"),
    ("target_first_step", "yes", "target_first_step='yes': expected True or False"),
    ("token_sd", 1, "token_sd=1: expected True, False or None"),
    ("token_sd_tokens", 0, "token_sd_tokens=0: expected an integer >= 1"),
    ("step", "\n\n", "step='\\n\\n': expected a generation.specs.StepSpec or None"),
    ("answer_marker", "", "answer_marker='': expected a non-empty string or None"),
    ("judge_suffix", None, "judge_suffix=None: expected a non-empty string"),
])
def test_a_bad_field_is_refused_where_the_config_is_built_naming_field_and_value(field, value, said):
    with pytest.raises(ValueError, match="invalid DecodeConfig: " + _escaped(said)):
        DecodeConfig(**{field: value})


def test_an_integer_past_a_floats_range_is_a_bad_value_not_an_overflow():
    """``math.isfinite(10**400)`` raises ``OverflowError``: such a ``ratio_scale`` was one, not the ValueError."""
    with pytest.raises(ValueError, match="ratio_scale=1000.*: expected a finite number > 0"):
        ProbePolicy(ratio_scale=10**400)


def test_every_bad_field_is_named_at_once():
    with pytest.raises(ValueError) as e:
        DecodeConfig(max_new_tokens=0, top_p=2, batch_size=-1)
    assert all(f"{name}=" in str(e.value) for name in ("max_new_tokens", "top_p", "batch_size"))


def test_good_values_build_a_frozen_config_with_the_seeds_as_a_tuple():
    cfg = DecodeConfig(max_new_tokens=8, temperature=0, top_p=1, seed=[3, 4], method=ProbePolicy(tau=0.7))
    assert cfg.seed == (3, 4) and cfg.temperature == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_new_tokens = 9
    assert DecodeConfig(method=RandomPolicy(0.5)).method == RandomPolicy(0.5)


def test_overrides_change_a_copy_and_an_unknown_one_is_named():
    base = DecodeConfig(max_new_tokens=8, seed=1)
    assert DecodeConfig.of(base, {"seed": 2}) == DecodeConfig(max_new_tokens=8, seed=2) and base.seed == 1
    assert DecodeConfig.of(None, {}) == DecodeConfig() and DecodeConfig.of(base) is base
    with pytest.raises(ValueError, match="max_tokens: not a DecodeConfig field; expected some of .*'max_new_tokens'"):
        DecodeConfig.of(base, {"max_tokens": 4})
    with pytest.raises(ValueError, match="invalid DecodeConfig: max_new_tokens=0"):
        DecodeConfig.of(base, {"max_new_tokens": 0})
    with pytest.raises(TypeError, match="config must be a DecodeConfig, got dict"):
        DecodeConfig.of({"max_new_tokens": 4})


def _escaped(text: str) -> str:
    import re

    return re.escape(text)


def test_numpy_numbers_sample_and_bad_sampling_or_arguments_are_named_as_bad_values(tiny_pair):
    """A NumPy temperature is a number, as every other field's; a bad sampling value is named as bad before it is
    compared with the probes'; a policy's bad values are shown as given; a decoder's config and ``prompts()`` refuse
    what is no config or no problems with the one-line errors ``generate`` gives."""
    import numpy as np

    from semanticspec import SemanticSpecDecoder

    target, draft, tok = tiny_pair
    assert DecodeConfig(temperature=np.float32(0.5), top_p=np.float64(0.9)).top_p == 0.9
    dec = SemanticSpecDecoder(target, draft, tok)
    assert dec.sampling(np.float64(0.6), np.float64(0.95)).temperature == 0.6
    for args, said in ((("0.6",), "temperature='0.6': expected a finite number"),
                       ((-1,), "temperature=-1: expected a finite number"), ((None, 2), "top_p=2: expected a number")):
        with pytest.raises(ValueError, match=said):
            dec.sampling(*args)
    with pytest.raises(ValueError, match="ratio_scale='2': expected a finite number > 0; top_k='1': expected an int"):
        ProbePolicy(ratio_scale="2", top_k="1")
    with pytest.raises(TypeError, match="config must be a DecodeConfig, got dict"):
        SemanticSpecDecoder(target, draft, tok, config={"max_new_tokens": 5})
    from arithmetic_world.task import ArithmeticTask

    tasked = SemanticSpecDecoder(target, draft, tok, task=ArithmeticTask())
    for bad in (None, b"ab", 5):
        with pytest.raises(ValueError, match=r"problems=.*: expected a list of problem texts"):
            tasked.prompts(bad)


def test_a_decoders_own_config_is_refused_when_every_call_with_it_would_be(tiny_pair):
    """A default config that no call could run (overlap in-process, a batch size served, an unknown method) is refused
    where the decoder is built, with the words a call's refusal has; a call may still override it."""
    from generation.engines.local import LocalEngine
    from semanticspec import SemanticSpecDecoder, ServedDecoder

    target, draft, tok = tiny_pair
    with pytest.raises(ValueError, match="config: overlap=True: drafting the next window .* is served decoding's"):
        SemanticSpecDecoder(target, draft, tok, config=DecodeConfig(overlap=True, lookahead=2))
    engines = LocalEngine(target, tok), LocalEngine(draft, tok)
    with pytest.raises(ValueError, match="config: batch_size=2: the served decoder runs prompts concurrently"):
        ServedDecoder(*engines, config=DecodeConfig(batch_size=2))
    with pytest.raises(ValueError, match="config: method='hf_target_only' runs transformers' own loop"):
        ServedDecoder(*engines, config=DecodeConfig(method="hf_target_only"))
    lenient = SemanticSpecDecoder(target, draft, tok, config=DecodeConfig(method="target_only", max_new_tokens=3))
    assert len(lenient.generate(PROMPTS[:1], temperature=0.0)) == 1
    # built, then refused by every call: a window for a method that drafts nothing, one the context cannot hold
    with pytest.raises(ValueError, match="config: lookahead=2: method='target_only' drafts no steps"):
        SemanticSpecDecoder(target, draft, tok, config=DecodeConfig(method="target_only", lookahead=2))
    with pytest.raises(ValueError, match="config: lookahead=500: a window of 500 steps"):
        SemanticSpecDecoder(target, draft, tok, config=DecodeConfig(lookahead=500))


def test_a_decoders_own_sampling_other_than_the_probes_is_refused_when_built():
    """``config=DecodeConfig(temperature=0)`` with probes trained at 0.6 was built, and every call refused it."""
    from arithmetic_world.models import load_world
    from semanticspec import SemanticSpecDecoder

    w, probes = load_world(), "checkpoints/arithmetic/probes"
    kw = dict(target_probe=f"{probes}/target", draft_probe=f"{probes}/draft")
    for bad, named in (({"temperature": 0.0}, "temperature=0.0 but the target probe was trained on steps sampled"),
                       ({"top_p": 0.5}, "top_p=0.5 but the target probe")):
        with pytest.raises(ValueError, match=named):
            SemanticSpecDecoder(w.target, w.draft, w.tokenizer, **kw, config=DecodeConfig(**bad))
    with pytest.warns(UserWarning, match="allow_sampling_mismatch=True: temperature=0.0") as seen:
        SemanticSpecDecoder(w.target, w.draft, w.tokenizer, **kw,
                            config=DecodeConfig(temperature=0.0, allow_sampling_mismatch=True))
    assert seen[0].filename == __file__  # the line that built the decoder
    SemanticSpecDecoder(w.target, w.draft, w.tokenizer, **kw, config=DecodeConfig(method="target_only",
                                                                                    temperature=0.0))
