"""Each wing has one public surface: every name of ``probes.__all__`` (the probe) and ``semanticspec.__all__`` (the
decoder) imports from the package itself, and importing either package (or the torch-free ``probes.config``) imports
no torch."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import probes
import semanticspec

ROOT = Path(__file__).resolve().parents[1]
SURFACES = [(probes, name) for name in probes.__all__] + [(semanticspec, name) for name in semanticspec.__all__]


@pytest.mark.parametrize("package,name", SURFACES, ids=lambda x: getattr(x, "__name__", x))
def test_every_public_name_imports_from_its_package_and_is_the_defining_modules_object(package, name):
    namespace: dict = {}
    exec(f"from {package.__name__} import {name}", namespace)
    defined = getattr(importlib.import_module(package._SURFACE[name]), name)
    assert namespace[name] is defined and getattr(package, name) is defined
    assert name in dir(package)


def test_the_surfaces_hold_what_a_decode_needs():
    assert {"load_probe"} <= set(probes.__all__)
    assert {"SemanticSpecDecoder", "ServedDecoder", "summarize", "ProbePolicy", "DecodeConfig"} <= set(
        semanticspec.__all__)


def test_an_unknown_name_is_refused_listing_the_public_ones():
    with pytest.raises(AttributeError, match=r"no attribute 'Decoder'.*'SemanticSpecDecoder'"):
        semanticspec.Decoder  # noqa: B018
    with pytest.raises(AttributeError, match=r"no attribute 'SemanticSpecDecoder'.*'load_probe'"):
        probes.SemanticSpecDecoder  # noqa: B018
    from probes import model  # a submodule still imports as one

    assert model.__name__ == "probes.model"


def test_importing_the_packages_or_the_probe_config_imports_no_torch():
    code = "import sys, probes, probes.config, semanticspec; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
