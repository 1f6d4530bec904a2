"""SemanticSpec probes: the probe, its LightningModule, export/load and the decoder."""

from probes.config import ProbeConfig
from probes.export import check_probe_matches, export_probe, load_probe, model_fingerprint
from probes.model import SemanticProbe

__all__ = ["ProbeConfig", "SemanticProbe", "check_probe_matches", "export_probe", "load_probe", "model_fingerprint"]
