"""Quiet model loading: transformers' per-load "Loading weights" bars say nothing a user of this package needs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """Within this block transformers draws no progress bars; the previous setting is restored after it."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
