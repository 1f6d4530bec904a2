"""The generation core shared by the label build and the decoder; it imports neither.

- :mod:`generation.features`: the probes' feature groups (pooled hidden states, token statistics),
  computed by one function at label-build time and at decode time.
"""
