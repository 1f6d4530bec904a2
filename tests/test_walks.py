"""`python -m tools.walks` on a tiny package written here: visits, stays, returns and literal defaults."""

import json
import textwrap

import pytest

from tools import walks

A = '''
from generation.b import clip, scale


def entry(temperature, other):
    spec = {"temperature": temperature}
    x = scale(temperature)
    return finish(spec, other)


def finish(spec, other):
    return clip(spec)
'''
B = '''
def scale(temperature):
    return helper(temperature)


def helper(t):
    return t * 2


def clip(spec):
    return spec


def sample(logits, top_p=0.95):
    return logits
'''


@pytest.fixture
def tiny_root(tmp_path):
    for folder, name, text in (("probes", "a.py", A), ("generation", "b.py", B)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_text(textwrap.dedent(text))
    return tmp_path


def test_a_value_is_followed_through_every_call_that_passes_it_on(tiny_root, capsys):
    out_file = tiny_root / "walks.json"
    out = walks.main(["--root", str(tiny_root), "--entry", "probes.a:entry=temperature", "--out", str(out_file)])
    w = out["walks"]["temperature"]
    # a.entry -> b.scale -> b.helper (one stay in b) -> back to a.finish -> back to b.clip
    assert [(s["file"], s["functions"], s["return"]) for s in w["path"]] == [
        ("probes/a.py", ["entry"], False), ("generation/b.py", ["scale", "helper"], False),
        ("probes/a.py", ["finish"], True), ("generation/b.py", ["clip"], True)]
    assert (w["visits"], w["stays"], w["files"], w["returns"]) == (5, 4, 2, 2)
    assert out["literal_defaults"]["top_p"] == ["generation.b:14 parameter"]
    assert out["literal_defaults"]["temperature"] == []
    assert json.loads(out_file.read_text()) == out
    assert "| temperature | probes.a:entry | 5 | 4 | 2 | 2 |" in capsys.readouterr().out


def test_an_entry_point_that_does_not_exist_is_reported_not_raised(tiny_root):
    out = walks.main(["--root", str(tiny_root), "--entry", "probes.a:missing=temperature"])
    assert "entry point not found" in out["walks"]["temperature"]["error"]
