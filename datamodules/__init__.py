"""Training data for SemanticSpec probes: the LightningDataModule and its shard stream at the top; the label
pipeline (`datamodules.labels`), the tasks (`datamodules.tasks`) and the embedded world (`arithmetic_world`)
in subpackages."""
