"""Names of the probes' feature groups and token statistics, and their check; no torch import.

Configs (``probes.config``, the build config) validate against these names without importing torch;
:mod:`generation.features` computes them.
"""

from __future__ import annotations

from collections.abc import Sequence

FEATURE_GROUPS: tuple[str, ...] = ("hidden", "token_stats")
"""Feature groups a probe can read, in the order they are concatenated into its input."""
TOKEN_STATS: tuple[str, ...] = (
    "mean_logprob",
    "min_logprob",
    "mean_entropy",
    "max_entropy",
    "not_top1_share",
    "not_top5_share",
    "mean_log_rank",
)
"""Token statistics this version computes (``token_stats`` group), in storage order."""


def check_groups(groups: Sequence[str], stats: Sequence[str] | None) -> list[str]:
    """Problems with a list of feature groups and of token statistics (empty when both are valid).

    ``stats=None`` checks the groups alone (the statistics are chosen elsewhere, e.g. by the data).
    """
    problems = []
    unknown = [g for g in groups if g not in FEATURE_GROUPS]
    if not groups or unknown or len(set(groups)) != len(groups):
        problems.append(f"feature groups {list(groups)}: expected a non-empty subset of {list(FEATURE_GROUPS)}"
                        + (f" (unknown: {unknown})" if unknown else ""))
    elif list(groups) != [g for g in FEATURE_GROUPS if g in groups]:
        problems.append(f"feature groups {list(groups)}: list them in the order {list(FEATURE_GROUPS)}")
    bad = [s for s in stats or () if s not in TOKEN_STATS]
    if stats is not None and "token_stats" in groups and (not stats or bad):
        problems.append(f"token_stats {list(stats)}: expected a non-empty subset of {list(TOKEN_STATS)}"
                        + (f" (this version cannot compute {bad})" if bad else ""))
    return problems


def require_features(
    wanted_groups: Sequence[str],
    wanted_stats: Sequence[str],
    provided_groups: Sequence[str],
    provided_stats: Sequence[str],
    where: str,
    provider: str,
) -> None:
    """Raise naming both lists when ``where`` reads feature groups or statistics that ``provider`` cannot give.

    Raises:
        ValueError: a group, or (for ``token_stats``) a statistic, is missing from what is provided.
    """
    missing = [g for g in wanted_groups if g not in provided_groups]
    if "token_stats" in wanted_groups and "token_stats" in provided_groups:
        missing += [f"token_stats.{s}" for s in wanted_stats if s not in provided_stats]
    if missing:
        raise ValueError(
            f"{where} reads feature groups {list(wanted_groups)} (token statistics {list(wanted_stats)}), but "
            f"{provider} provides {list(provided_groups)} (token statistics {list(provided_stats)}); missing {missing}. "
            "Use a probe trained on features this source provides, or rebuild the data with them."
        )
