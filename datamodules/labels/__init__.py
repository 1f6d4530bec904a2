"""The label pipeline: prefixes, sampling backends, reading, judges, clustering, labels, shards and the build
command."""
