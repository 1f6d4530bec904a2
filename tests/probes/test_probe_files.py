"""The exported probe as an artifact: what an export writes and keeps, what a config.json may hold, and the card."""

import os
import stat
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from generation.specs import FeatureSpec
from probes.card import markdown_table
from probes.config import ProbeConfig
from probes.model import SemanticProbe, check_probe_matches, export_probe, load_probe


MODEL = SimpleNamespace(config=SimpleNamespace(hidden_size=8, num_hidden_layers=2, vocab_size=16, architectures=["X"]))
"""What check_probe_matches reads of a model: its config (a transformers model costs seconds to import)."""


def _probe(**kw) -> SemanticProbe:
    return SemanticProbe(ProbeConfig(**{"hidden_size": 8, "hidden_dims": [4], **kw}))


def test_an_export_over_a_folder_keeps_the_modes_of_the_users_files_and_folders(tmp_path):
    """A user's folder in the probe's folder was carried over as 0644 (no one but root could enter it again), and a
    private file (0600) became world-readable."""
    (tmp_path / "p" / "notes").mkdir(parents=True)
    (tmp_path / "p" / "notes" / "a.txt").write_text("mine")
    (tmp_path / "p" / "token").write_text("secret")
    os.chmod(tmp_path / "p" / "token", 0o600)
    os.chmod(tmp_path / "p" / "notes", 0o750)
    export_probe(_probe(), tmp_path / "p")
    mode = lambda name: stat.S_IMODE(os.stat(tmp_path / "p" / name).st_mode)  # noqa: E731
    assert (mode("notes"), mode("token")) == (0o750, 0o600)
    assert (tmp_path / "p" / "notes" / "a.txt").read_text() == "mine" and load_probe(tmp_path / "p")


@pytest.mark.parametrize("field, value", [("labels", [1]), ("labels", [["seed", 1]]), ("sampling", "x"),
                                          ("sampling", [0.6, 0.95])])
def test_an_old_config_with_labels_or_sampling_not_an_object_is_refused_naming_the_field(field, value):
    """Formats 0-3: a sampling of the wrong type loaded as unknown, and labels as dict()'s bare TypeError (or as a
    dict, from a list of pairs); today's format refuses both, naming the field."""
    old = {"format_version": 3, "hidden_size": 8, "labels": {"n_samples": 8}, field: value}
    with pytest.raises(ValueError, match=rf"^invalid ProbeConfig: {field}=.*: expected an object"):
        ProbeConfig.from_dict(old)


def test_a_spec_given_as_a_dict_with_a_bad_field_is_named_once():
    """The field was named, then the whole dict again as "expected a generation.specs.StepSpec", which it may be."""
    with pytest.raises(ValueError) as e:
        ProbeConfig(step={"delimiters": "\n\n"}, sampling={"top_p": 2})
    assert "expected a generation.specs" not in str(e.value)
    assert "step.delimiters=" in str(e.value) and "sampling.top_p=2" in str(e.value)


def test_a_probe_of_statistics_alone_is_not_refused_for_layers_it_does_not_read():
    """FeatureSpec checks layer_ids only for the hidden group; the config and the model check refused a statistics
    probe's layer_ids (none, or deeper than the model) although it reads no layer."""
    features = FeatureSpec(groups=("token_stats",), layer_ids=())
    assert ProbeConfig(features=features).input_size == 7
    deep = ProbeConfig(hidden_size=8, features=FeatureSpec(groups=("token_stats",), layer_ids=(9,)))
    check_probe_matches(deep, MODEL)
    with pytest.raises(ValueError, match=r"reads layers the model does not have"):
        check_probe_matches(ProbeConfig(hidden_size=8, features=FeatureSpec(layer_ids=(9,))), MODEL)


def test_numpy_numbers_the_config_accepts_are_exported(tmp_path):
    """The checks take NumPy numbers; the export's json.dumps did not ("Object of type int64 is not JSON
    serializable", after the training)."""
    probe = _probe(hidden_size=np.int64(8), hidden_dims=[np.int64(4)], dropout=np.float32(0.25),
                   features={"groups": ["hidden", "topk_stats"], "top_k": np.int64(20)},
                   test_metrics={"mse": np.float32(0.5)}, labels={"seed": np.int64(3)})
    loaded = load_probe(export_probe(probe, tmp_path / "p"))
    assert loaded.config == probe.config and loaded.config.labels == {"seed": 3}


def test_an_export_that_would_not_load_is_refused_when_written(tmp_path):
    """A config edited after the probe was built, or NaN weights, were exported: load_probe refused the folder."""
    probe = _probe()
    probe.config.hidden_size = 16
    with pytest.raises(ValueError, match=r"tensors are not those its config describes \(input_mean, input_std"):
        export_probe(probe, tmp_path / "edited")
    probe = _probe()
    with torch.no_grad():
        probe.mlp[0].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"NaN or infinite values in \['mlp.0.weight'\]"):
        export_probe(probe, tmp_path / "nan")
    assert not (tmp_path / "edited").exists() and not (tmp_path / "nan").exists()


def test_a_folder_given_to_the_probe_class_is_a_type_error_saying_how_to_load(tmp_path):
    """It was an AttributeError: 'str' object has no attribute 'input_size'."""
    with pytest.raises(TypeError, match=r"got str; an exported probe's folder loads with probes.load_probe"):
        SemanticProbe(str(tmp_path))


def test_a_pipe_in_a_card_cell_stays_a_pipe_inside_a_code_span():
    """``&#124;`` is shown as written inside a code span (a step delimiter, a path); GFM reads ``\\|`` as ``|``."""
    table = markdown_table(["what", "value"], [("step", "`['|\\n']`")])
    assert "`['\\|\\n']`" in table and "&#124;" not in table
    markdown_it = pytest.importorskip("markdown_it")
    html = markdown_it.MarkdownIt("commonmark").enable("table").render(table)
    assert "<code>['|\\n']</code>" in html


def test_a_bad_dtype_is_named_as_load_probes_own_argument_before_the_folder_is_read(tmp_path):
    """``load_probe(dtype="bf16")`` was refused as ``probe_dtype=`` (the decoders' argument), after the folder."""
    with pytest.raises(ValueError, match=r"^dtype='bf16': expected None or one of \['auto', 'float32', 'float16'\]"):
        load_probe(tmp_path / "no-such-probe", dtype="bf16")


def test_an_export_to_a_link_to_a_folder_writes_into_that_folder_and_keeps_the_link(tmp_path):
    """The link was replaced by a folder holding the new probe, and the folder it named kept the old one."""
    (tmp_path / "v1").mkdir()
    (tmp_path / "latest").symlink_to(tmp_path / "v1", target_is_directory=True)
    export_probe(_probe(), tmp_path / "latest")
    assert (tmp_path / "latest").is_symlink() and (tmp_path / "v1" / "model.safetensors").is_file()
    assert load_probe(tmp_path / "latest").config.hidden_size == 8
