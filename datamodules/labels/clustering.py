"""Meaning groups of one prefix's samples: HDBSCAN proposes, an equivalence judge settles.

Per prefix (docs/design.md "Meaning groups"):

1. Identical texts (up to whitespace) are one item; the rest works on unique texts.
2. HDBSCAN (the ``hdbscan`` package) clusters the items' embeddings (default: the pooled hidden
   states, L2-normalised). Without a judge, noise and low-membership items stay alone.
3. The judge checks every confident cluster member against the cluster's representative (its
   most frequent text); members it rejects become uncertain.
4. The judge compares the representatives of cluster pairs whose centroids are close and merges
   the pairs it calls the same.
5. Uncertain items (noise, low membership, rejected members) are compared with the groups, nearest
   centroid first, each through up to ``votes`` of its most frequent texts; the first group whose
   mean score passes the judge's threshold takes them, else they found a group.

With ``match_numbers`` (default), two texts whose numbers differ are "different" without asking the
judge: the world judge calls a step with a wrong result the same as the right one in a third of
such pairs, which put wrong draft steps into the target's group.

Steps 3-5 are written as generators that yield the pairs they need judged, so
:func:`group_prefixes` asks the judge about many prefixes in one batch.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import numpy as np

METHODS = ("hdbscan+judge", "hdbscan", "judge")


def choices(part, allowed: dict[str, tuple]) -> list[str]:
    """``name=value: expected one of ...`` for each field of ``part`` outside its allowed values."""
    return [f"{k}={getattr(part, k)!r}: expected one of {v}" for k, v in allowed.items() if getattr(part, k) not in v]


def at_least(part, **low: int) -> list[str]:
    """``name=value: expected >= low`` for each field of ``part`` below its lower bound."""
    return [f"{k}={getattr(part, k)}: expected >= {v}" for k, v in low.items() if getattr(part, k) < v]


@dataclass
class ClusteringConfig:
    """How one prefix's samples are grouped by meaning (YAML: ``build.clustering.*``)."""

    method: str = "hdbscan+judge"
    """``hdbscan+judge`` (default), ``hdbscan`` (no judge) or ``judge`` (no HDBSCAN)."""
    min_cluster_size: int = 2
    """HDBSCAN ``min_cluster_size``."""
    membership_threshold: float = 0.5
    """HDBSCAN members below this membership probability go to the judge."""
    verify_members: bool = True
    """Ask the judge whether each confident member means the same as its cluster's representative."""
    merge_distance: float = 2.0
    """Clusters whose centroids (unit-norm embeddings) are closer than this are judged for merging; 2.0 = all pairs."""
    max_candidates: int = 6
    """Most groups an uncertain item is compared with before it founds its own group."""
    votes: int = 1
    """An uncertain item is compared with up to this many members of a candidate group (its most frequent
    texts) and joins it when their mean judge score passes the threshold: one judge error is outvoted."""
    match_numbers: bool = True
    """Two steps whose numbers differ (as multisets) never share a meaning group, whatever the judge says.
    The world judge calls a step with a wrong result "the same" as the right one in 1 of 3 cases;
    turn off for tasks whose paraphrases change numbers (e.g. 0.5 vs 1/2)."""

    def errors(self) -> list[str]:
        """What is wrong, one ``name=value: expected ...`` per bad field."""
        errors = choices(self, {"method": METHODS}) + at_least(self, min_cluster_size=2)
        if not 0 <= self.membership_threshold <= 1:
            errors.append(f"membership_threshold={self.membership_threshold}: expected 0..1")
        return errors + at_least(self, merge_distance=0, votes=1, max_candidates=1)


def normalize_text(text: str) -> str:
    """Whitespace-normalised text: identical normalised texts are one meaning without asking."""
    return " ".join(text.split())


_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def numbers(text: str) -> Counter:
    """The multiset of numbers written in ``text`` (signs ignored: "minus 4" and "- 4" both hold 4)."""
    return Counter(_NUMBER.findall(text))


def prepare_embeddings(emb: np.ndarray) -> np.ndarray:
    """Scale one prefix's embeddings to unit norm (euclidean distance then ranks like cosine)."""
    x = np.asarray(emb, dtype=np.float64).reshape(len(emb), -1)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def run_hdbscan(x: np.ndarray, min_cluster_size: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """HDBSCAN labels (-1 = noise) and membership probabilities of the rows of ``x``."""
    n = len(x)
    if n < max(3, min_cluster_size):
        return np.full(n, -1), np.zeros(n)
    import hdbscan

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = hdbscan.HDBSCAN(min_cluster_size=min_cluster_size, min_samples=1, allow_single_cluster=True,
                                metric="euclidean").fit(x)
    return model.labels_.astype(int), model.probabilities_.astype(float)


Request = list[tuple[str, str]]


def _settle(texts: Sequence[str], emb: np.ndarray, cfg: ClusteringConfig,
            threshold: float = 0.5) -> Generator[Request, list[float], np.ndarray]:
    """Group one prefix's samples; yields pairs to judge, receives their scores, returns group ids."""
    uniq, item_of, counts, items = _unique_items(texts, emb)
    if cfg.method == "judge":
        labels, probs = np.full(len(uniq), -1), np.zeros(len(uniq))
    else:
        labels, probs = run_hdbscan(items, cfg.min_cluster_size)
    if cfg.method == "hdbscan":  # no judge: noise and low-membership items stay alone
        return _renumber(_alone(labels, probs, cfg.membership_threshold)[item_of])
    members, uncertain = _confident_members(labels, probs, counts, cfg.membership_threshold)
    if cfg.verify_members:  # step 3
        yield from _verify_members(members, uncertain, uniq, threshold)
    if len(members) > 1:  # step 4
        members = yield from _merge_close(members, items, uniq, counts, cfg.merge_distance, threshold)
    group_of = yield from _place_uncertain(members, uncertain, items, uniq, counts, cfg, threshold)
    return _renumber(group_of[item_of])


def _unique_items(texts: Sequence[str], emb: np.ndarray) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """Step 1: the distinct normalised texts, each sample's item, each item's count and mean unit embedding."""
    norm = [normalize_text(t) for t in texts]
    uniq = list(dict.fromkeys(norm))
    index = {t: i for i, t in enumerate(uniq)}
    item_of = np.array([index[t] for t in norm], dtype=int)
    counts = np.bincount(item_of, minlength=len(uniq))
    x = prepare_embeddings(emb)
    items = np.stack([x[item_of == i].mean(0) for i in range(len(uniq))]) if len(uniq) else x[:0]
    return uniq, item_of, counts, items


def _alone(labels: np.ndarray, probs: np.ndarray, membership_threshold: float) -> np.ndarray:
    """``labels`` with every noise or low-membership item in a group of its own (changed in place)."""
    nxt = labels.max(initial=-1) + 1
    for i in np.flatnonzero((labels < 0) | (probs < membership_threshold)):
        labels[i], nxt = nxt, nxt + 1
    return labels


def _confident_members(labels: np.ndarray, probs: np.ndarray, counts: np.ndarray,
                       membership_threshold: float) -> tuple[list[list[int]], list[int]]:
    """Per HDBSCAN cluster, its representative (most frequent) then its confident members; and the uncertain
    items (noise, then each cluster's low-membership members)."""
    members: list[list[int]] = []
    uncertain: list[int] = [int(i) for i in np.flatnonzero(labels < 0)]
    for c in sorted(set(labels[labels >= 0].tolist())):
        ms = sorted(np.flatnonzero(labels == c).tolist(), key=lambda i: (-counts[i], -probs[i], i))
        members.append(ms[:1] + [i for i in ms[1:] if probs[i] >= membership_threshold])
        uncertain += [i for i in ms[1:] if probs[i] < membership_threshold]
    return members, uncertain


def _verify_members(members: list[list[int]], uncertain: list[int], uniq: list[str],
                    threshold: float) -> Generator[Request, list[float], None]:
    """Step 3: judge every confident member against its representative; the rejected become uncertain
    (``members`` and ``uncertain`` change in place)."""
    asks = [(g, i) for g, ms in enumerate(members) for i in ms[1:]]
    if not asks:
        return
    answers = yield [(uniq[members[g][0]], uniq[i]) for g, i in asks]
    for (g, i), score in zip(asks, answers):
        if score < threshold:
            members[g].remove(i)
            uncertain.append(i)


def _merge_close(members: list[list[int]], items: np.ndarray, uniq: list[str], counts: np.ndarray,
                 merge_distance: float, threshold: float) -> Generator[Request, list[float], list[list[int]]]:
    """Step 4: judge the representatives of clusters whose centroids are close; return the groups after
    merging the pairs called the same (each sorted most frequent first), or ``members`` when none is close."""
    cents = [items[ms].mean(0) for ms in members]
    asks = [(g, h) for g in range(len(members)) for h in range(g + 1, len(members))
            if np.linalg.norm(cents[g] - cents[h]) <= merge_distance]
    if not asks:
        return members
    answers = yield [(uniq[members[g][0]], uniq[members[h][0]]) for g, h in asks]
    parent = list(range(len(members)))
    for (g, h), score in zip(asks, answers):
        if score >= threshold:
            parent[_root(parent, h)] = _root(parent, g)
    merged: dict[int, list[int]] = {}
    for g, ms in enumerate(members):
        merged.setdefault(_root(parent, g), []).extend(ms)
    return [sorted(ms, key=lambda i: (-counts[i], i)) for ms in merged.values()]


def _root(parent: list[int], a: int) -> int:
    """The root of ``a`` in the union-find forest ``parent``."""
    while parent[a] != a:
        a = parent[a]
    return a


def _place_uncertain(members: list[list[int]], uncertain: list[int], items: np.ndarray, uniq: list[str],
                     counts: np.ndarray, cfg: ClusteringConfig,
                     threshold: float) -> Generator[Request, list[float], np.ndarray]:
    """Step 5, greedy, most frequent first: each uncertain item joins the first of its nearest groups whose
    votes pass the threshold, else founds a group. Returns every item's group."""
    group_of = np.full(len(uniq), -1)
    for g, ms in enumerate(members):
        group_of[ms] = g
    for i in sorted(set(uncertain), key=lambda i: (-counts[i], i)):
        g = yield from _first_accepting(members, i, items, uniq, counts, cfg, threshold)
        if g is None:
            members.append([i])
            g = len(members) - 1
        else:
            members[g].append(i)
        group_of[i] = g
    return group_of


def _first_accepting(members: list[list[int]], i: int, items: np.ndarray, uniq: list[str], counts: np.ndarray,
                     cfg: ClusteringConfig, threshold: float) -> Generator[Request, list[float], int | None]:
    """The first of the ``max_candidates`` groups nearest item ``i`` whose ``votes`` most frequent members the
    judge calls the same as ``i`` on average, or None."""
    order = sorted(range(len(members)), key=lambda g: float(np.linalg.norm(items[members[g]].mean(0) - items[i])))
    for g in order[: cfg.max_candidates]:
        refs = sorted(members[g], key=lambda m: (-counts[m], m))[: cfg.votes]
        scores = yield [(uniq[m], uniq[i]) for m in refs]
        if float(np.mean(scores)) >= threshold:
            return g
    return None

def _score(judge, pairs: list[tuple[str, str]], match_numbers: bool) -> tuple[list[float], list[int]]:
    """The scores of ``pairs``, and which of them the judge answered.

    With ``match_numbers`` a pair whose numbers differ scores 0 without asking the judge.
    """
    ask = [k for k, (a, b) in enumerate(pairs) if not match_numbers or numbers(a) == numbers(b)]
    out = [0.0] * len(pairs)
    for k, s in zip(ask, judge.score([pairs[k] for k in ask]) if ask else []):
        out[k] = float(s)
    return out, ask


def _renumber(groups: np.ndarray) -> np.ndarray:
    """Group ids 0, 1, ... in order of first appearance."""
    seen: dict[int, int] = {}
    return np.array([seen.setdefault(int(g), len(seen)) for g in groups], dtype=np.int32)


def group_prefixes(
    batch: Sequence[tuple[Sequence[str], np.ndarray]],
    judge=None,
    cfg: ClusteringConfig | None = None,
    asked: list | None = None,
) -> list[np.ndarray]:
    """Meaning groups for many prefixes, judging all their open questions in shared batches.

    Args:
        batch: per prefix, the sample texts and their embeddings (n, ...).
        judge: a :class:`~datamodules.labels.judges.Judge` (``score(pairs)`` in both directions and a
            ``threshold``); None only with ``method="hdbscan"``.
        cfg: clustering options.
        asked: when given, every judged pair is appended as ``(a, b, same)`` (audits).

    Returns:
        Per prefix, int32 group ids (0..G-1, in order of first appearance) of its samples.
    """
    cfg = cfg or ClusteringConfig()
    if cfg.errors():
        raise ValueError("invalid ClusteringConfig: " + "; ".join(cfg.errors()))
    if judge is None and cfg.method != "hdbscan":
        raise ValueError(f"method={cfg.method!r} needs a judge; use method='hdbscan' to group without one")
    results: list[np.ndarray | None] = [None] * len(batch)
    threshold = getattr(judge, "threshold", 0.5)
    gens = [_settle(texts, np.asarray(emb), cfg, threshold) for texts, emb in batch]
    pending: dict[int, Request] = {}

    def advance(i: int, answer) -> None:
        try:
            pending[i] = gens[i].send(answer)
        except StopIteration as stop:
            results[i] = stop.value
            pending.pop(i, None)

    for i in range(len(gens)):
        advance(i, None)
    while pending:
        order = sorted(pending)
        flat = [p for i in order for p in pending[i]]
        answers, answered = _score(judge, flat, cfg.match_numbers)
        if asked is not None:  # what the judge itself answered (pairs the numbers check settled are not asked)
            asked.extend((*flat[k], answers[k] >= threshold) for k in answered)
        at = 0
        for i in order:
            n = len(pending[i])
            advance(i, answers[at : at + n])
            at += n
    return results  # type: ignore[return-value]
