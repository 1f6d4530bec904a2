"""`probes` has one public surface (issue 30 item 7): every name of ``__all__`` imports from `probes` itself, and
importing the package (or its torch-free ``probes.config``) still imports no torch."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import probes

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", probes.__all__)
def test_every_public_name_imports_from_probes_and_is_the_defining_modules_object(name):
    namespace: dict = {}
    exec(f"from probes import {name}", namespace)
    defined = getattr(importlib.import_module(probes._SURFACE[name]), name)
    assert namespace[name] is defined and getattr(probes, name) is defined
    assert name in dir(probes)


def test_the_surface_holds_what_a_decode_needs():
    assert {"load_probe", "SemanticSpecDecoder", "ServedDecoder", "summarize", "LoopOptions",
            "ProbePolicy"} <= set(probes.__all__)


def test_an_unknown_name_is_refused_listing_the_public_ones():
    with pytest.raises(AttributeError, match=r"no attribute 'Decoder'.*'SemanticSpecDecoder'"):
        probes.Decoder  # noqa: B018
    from probes import metrics  # a submodule still imports as one

    assert metrics.__name__ == "probes.metrics"


def test_importing_probes_or_its_config_imports_no_torch():
    code = "import sys, probes, probes.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
