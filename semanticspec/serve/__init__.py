"""The OpenAI-compatible SemanticSpec endpoint (``python -m semanticspec.serve``):
:func:`~semanticspec.serve.app.build_app` over any decoder, :mod:`.scheduler`'s decode thread admitting requests into
running loops between rounds."""
