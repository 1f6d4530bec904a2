"""SemanticSpec probes: the probe (`probes.model`), its config, LightningModule, fit CLI, export/load and the decoder."""
