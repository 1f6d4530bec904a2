"""Names of the probes' feature groups and token statistics, and their check; no torch import.

Configs (``probes.config``, the build config) validate against these names without importing torch;
:mod:`generation.features` computes them.
"""

from __future__ import annotations

from collections.abc import Sequence

FEATURE_GROUPS: tuple[str, ...] = ("hidden", "token_stats", "topk_stats")
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
TOPK_STATS: tuple[str, ...] = (
    "mean_logprob",
    "min_logprob",
    "not_top1_share",
    "not_top5_share",
    "not_topk_share",
    "mean_log_rank",
    "mean_topk_entropy",
    "max_topk_entropy",
    "mean_topk_mass",
    "min_topk_mass",
)
"""Top-k statistics this version computes (``topk_stats`` group), in storage order: each is exact from the
token's log-prob and the reading model's k largest log-probs (what a server's top-k answer holds)."""
STAT_GROUPS: dict[str, tuple[str, ...]] = {"token_stats": TOKEN_STATS, "topk_stats": TOPK_STATS}
"""The statistics groups and the names each can hold."""


def check_groups(groups: Sequence[str], stats: Sequence[str] | None, topk: Sequence[str] | None = None) -> list[str]:
    """Problems with a list of feature groups and of their statistics (empty when all are valid).

    Args:
        groups: feature groups, a subset of :data:`FEATURE_GROUPS` in that order.
        stats: the ``token_stats`` names (checked when ``token_stats`` is read); None checks the groups alone
            (the statistics are chosen elsewhere, e.g. by the data).
        topk: the ``topk_stats`` names (checked when ``topk_stats`` is read); None = not checked.
    """
    problems = []
    unknown = [g for g in groups if g not in FEATURE_GROUPS]
    if not groups or unknown or len(set(groups)) != len(groups):
        problems.append(f"feature groups {list(groups)}: expected a non-empty subset of {list(FEATURE_GROUPS)}"
                        + (f" (unknown: {unknown})" if unknown else ""))
    elif list(groups) != [g for g in FEATURE_GROUPS if g in groups]:
        problems.append(f"feature groups {list(groups)}: list them in the order {list(FEATURE_GROUPS)}")
    for group, names in (("token_stats", stats), ("topk_stats", topk)):
        bad = [s for s in names or () if s not in STAT_GROUPS[group]]
        if names is not None and group in groups and (not names or bad):
            problems.append(f"{group} {list(names)}: expected a non-empty subset of {list(STAT_GROUPS[group])}"
                            + (f" (this version cannot compute {bad})" if bad else ""))
    return problems


def require_features(
    wanted_groups: Sequence[str],
    wanted_stats: Sequence[str],
    provided_groups: Sequence[str],
    provided_stats: Sequence[str],
    where: str,
    provider: str,
    wanted_topk: Sequence[str] = (),
    provided_topk: Sequence[str] = TOPK_STATS,
) -> None:
    """Raise naming both lists when ``where`` reads feature groups or statistics that ``provider`` cannot give.

    ``wanted_topk``/``provided_topk`` are the ``topk_stats`` names, checked as ``wanted_stats``/``provided_stats``
    are for ``token_stats``.

    Raises:
        ValueError: a group, or (for ``token_stats`` and ``topk_stats``) a statistic, is missing from what is provided.
    """
    missing = [g for g in wanted_groups if g not in provided_groups]
    for group, wanted, provided in (("token_stats", wanted_stats, provided_stats),
                                    ("topk_stats", wanted_topk, provided_topk)):
        if group in wanted_groups and group in provided_groups:
            missing += [f"{group}.{s}" for s in wanted if s not in provided]
    if missing:
        topk = f", top-k statistics {list(wanted_topk)}" if "topk_stats" in wanted_groups else ""
        has = f", top-k statistics {list(provided_topk)}" if "topk_stats" in provided_groups else ""
        raise ValueError(
            f"{where} reads feature groups {list(wanted_groups)} (token statistics {list(wanted_stats)}{topk}), but "
            f"{provider} provides {list(provided_groups)} (token statistics {list(provided_stats)}{has}); "
            f"missing {missing}. Use a probe trained on features this source provides, or rebuild the data with them."
        )
