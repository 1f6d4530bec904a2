"""Label pipeline and streaming data for SemanticSpec probes (see ../shared/DESIGN.md)."""
