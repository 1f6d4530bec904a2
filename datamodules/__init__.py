"""Label pipeline and streaming data for SemanticSpec probes (see docs/design.md)."""
