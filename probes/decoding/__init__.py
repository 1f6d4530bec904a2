"""Internals of the decoder: the batched KV-cache runner and the step writer (see ``probes.decoder``)."""
