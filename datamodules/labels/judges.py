"""Equivalence judges: "do these two steps mean the same?", asked in both directions, cached on disk.

Every judge gives ``prob_same(pairs)`` for one direction (the probability that A and B mean the
same, as the judge reads "A, then B"); :meth:`Judge.same` asks both directions and combines them.
Answers are cached by the sha256 of the judge's id and both texts, so a resumed or repeated build
asks nothing twice.

- :class:`LLMJudge`: any transformers causal LM, a prompt template and yes/no log-probabilities.
- :class:`HTTPJudge`: an OpenAI-compatible endpoint (``/v1/chat/completions`` or ``/v1/completions``).
- :class:`NLIJudge`: bidirectional entailment with a sequence-classification model.
- :class:`OracleJudge`: the embedded world's oracle, for audits and tests only.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from generation.padding import left_pad

Pair = tuple[str, str]


class JudgeCache:
    """Answers of one judge on disk: JSONL files of ``{"k": sha256, "p": prob}``, one per writer.

    Each process appends to its own file (``answers-<tag>.jsonl``) and reads all of them, so
    several build ranks can share one cache folder; a line cut by a kill is ignored.
    """

    def __init__(self, folder: str | os.PathLike, tag: str = "0"):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / f"answers-{tag}.jsonl"
        self.memory: dict[str, float] = {}
        for f in sorted(self.folder.glob("answers-*.jsonl")):
            for line in f.read_text().splitlines():
                try:
                    rec = json.loads(line)
                    self.memory[rec["k"]] = float(rec["p"])
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    continue  # a line cut short by a kill

    @staticmethod
    def key(judge_id: str, a: str, b: str) -> str:
        """Content hash of one question: sha256 of the judge id and both texts."""
        return hashlib.sha256(json.dumps([judge_id, a, b]).encode()).hexdigest()

    def put(self, items: dict[str, float]) -> None:
        if not items:
            return
        self.memory.update(items)
        with open(self.path, "a") as f:
            f.write("".join(json.dumps({"k": k, "p": p}) + "\n" for k, p in items.items()))


class Judge:
    """Base class: implement :meth:`_prob_same` (one direction, no cache) and :attr:`id`.

    Args:
        threshold: a pair means the same when the combined probability reaches it.
        combine: how the two directions combine: ``mean`` of both probabilities, or ``both``
            (each direction must pass ``threshold``; bidirectional entailment).
        cache_dir: folder of the answer cache; None keeps answers in memory only.
    """

    id: str = "judge"

    def __init__(self, threshold: float = 0.5, combine: str = "mean", cache_dir: str | os.PathLike | None = None,
                 cache_tag: str = "0"):
        if not 0 < threshold < 1:
            raise ValueError(f"threshold={threshold}; expected 0 < threshold < 1")
        if combine not in ("mean", "both"):
            raise ValueError(f"combine={combine!r}; expected 'mean' or 'both'")
        self.threshold, self.combine = threshold, combine
        self.cache = JudgeCache(cache_dir, cache_tag) if cache_dir is not None else None
        # the answers known so far: the disk cache's (read at start, grown by put) when there is one
        self._memory: dict[str, float] = self.cache.memory if self.cache is not None else {}
        self.calls = 0
        """Questions answered by the model (one direction each)."""
        self.cache_hits = 0
        """Questions answered from the cache."""
        self.seconds = 0.0
        """Time spent asking the model."""

    def _prob_same(self, pairs: Sequence[Pair]) -> list[float]:
        raise NotImplementedError

    def prob_same(self, pairs: Sequence[Pair]) -> list[float]:
        """P(same) for each ``(a, b)`` read in that order, from the cache when it knows it."""
        keys = [JudgeCache.key(self.id, a, b) for a, b in pairs]
        todo = sorted({k: (a, b) for k, (a, b) in zip(keys, pairs) if k not in self._memory}.items())
        self.cache_hits += sum(k in self._memory for k in keys)
        if todo:
            t0 = time.perf_counter()
            probs = self._prob_same([q for _, q in todo])
            self.seconds += time.perf_counter() - t0
            self.calls += len(todo)
            new = {k: float(p) for (k, _), p in zip(todo, probs)}
            self._memory.update(new)
            if self.cache is not None:
                self.cache.put(new)
        return [self._memory[k] for k in keys]

    def score(self, pairs: Sequence[Pair]) -> list[float]:
        """Both directions combined: the mean of P(a~b) and P(b~a), or their minimum for ``both``."""
        if not pairs:
            return []
        probs = self.prob_same(list(pairs) + [(b, a) for a, b in pairs])
        fwd, bwd = probs[: len(pairs)], probs[len(pairs) :]
        return [min(f, b) if self.combine == "both" else (f + b) / 2 for f, b in zip(fwd, bwd)]

    def same(self, pairs: Sequence[Pair]) -> list[bool]:
        """Whether each pair means the same, asked in both directions."""
        return [s >= self.threshold for s in self.score(pairs)]


class OracleJudge(Judge):
    """The embedded world's exact oracle as a judge. For audits and tests only, never for labels."""

    id = "oracle"

    def _prob_same(self, pairs: Sequence[Pair]) -> list[float]:
        from datamodules.tasks.worlds import default_world

        meaning = default_world().meaning
        out = []
        for a, b in pairs:  # malformed steps mean the same only when they are the same text
            ma, mb = meaning(a), meaning(b)
            out.append(float(ma == mb if ma is not None and mb is not None else a.strip() == b.strip()))
        return out


class LLMJudge(Judge):
    """A transformers causal LM answering a yes/no prompt; P(same) = P(yes) / (P(yes) + P(no)).

    Args:
        model: causal LM (eval mode, on its device).
        tokenizer: its tokenizer; its chat template wraps the prompt when it has one.
        template: prompt with ``{a}`` and ``{b}``; the world judge uses
            :data:`~arithmetic_world.tokenizer.JUDGE_TEMPLATE`.
        yes: the answer meaning "same" (its first token is read).
        no: the answer meaning "different".
        batch_size: prompts per forward pass.
        name: identity in the cache key (default: the model's ``name_or_path``).
        **kwargs: :class:`Judge` options.
    """

    def __init__(self, model, tokenizer, template: str, yes: str = " yes", no: str = " no", batch_size: int = 256,
                 name: str | None = None, **kwargs):
        super().__init__(**kwargs)
        if "{a}" not in template or "{b}" not in template:
            raise ValueError(f"template={template!r}; it must contain {{a}} and {{b}}")
        self.model, self.tokenizer, self.template, self.batch_size = model, tokenizer, template, batch_size
        self.yes_id = tokenizer(yes, add_special_tokens=False)["input_ids"][0]
        self.no_id = tokenizer(no, add_special_tokens=False)["input_ids"][0]
        if self.yes_id == self.no_id:
            raise ValueError(f"answers {yes!r} and {no!r} start with the same token; give distinct answers")
        name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.id = f"llm:{name}:{template}:{yes}:{no}"

    def _prompt(self, a: str, b: str) -> list[int]:
        text = self.template.format(a=a.strip(), b=b.strip())
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return list(self.tokenizer(text)["input_ids"])

    @torch.no_grad()
    def _prob_same(self, pairs: Sequence[Pair]) -> list[float]:
        device = next(self.model.parameters()).device
        out: list[float] = []
        for i in range(0, len(pairs), self.batch_size):
            ids, mask = left_pad([self._prompt(a, b) for a, b in pairs[i : i + self.batch_size]],
                                 self.tokenizer.pad_token_id or 0, device)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]  # (B, V)
            out += torch.softmax(logits[:, [self.yes_id, self.no_id]].float(), -1)[:, 0].tolist()
        return out


class NLIJudge(Judge):
    """Bidirectional entailment with a sequence-classification (NLI) model; P(same) = P(entailment).

    Args:
        model: ``AutoModelForSequenceClassification`` model (eval mode).
        tokenizer: its tokenizer (pairs are encoded as ``tokenizer(premise, hypothesis)``).
        entailment_label: index of the entailment class; default: the label whose name contains
            "entail" in ``model.config.id2label``.
        batch_size: pairs per forward pass.
        name: identity in the cache key.
        **kwargs: :class:`Judge` options (``combine`` defaults to ``both``).
    """

    def __init__(self, model, tokenizer, entailment_label: int | None = None, batch_size: int = 64,
                 name: str | None = None, **kwargs):
        kwargs.setdefault("combine", "both")
        super().__init__(**kwargs)
        if entailment_label is None:
            labels = {int(i): str(n) for i, n in model.config.id2label.items()}
            found = [i for i, n in labels.items() if "entail" in n.lower()]
            if len(found) != 1:
                raise ValueError(f"cannot tell the entailment class from id2label={labels}; pass entailment_label")
            entailment_label = found[0]
        self.model, self.tokenizer, self.label, self.batch_size = model, tokenizer, entailment_label, batch_size
        self.id = f"nli:{name or getattr(model.config, '_name_or_path', '') or type(model).__name__}:{entailment_label}"

    @torch.no_grad()
    def _prob_same(self, pairs: Sequence[Pair]) -> list[float]:
        device = next(self.model.parameters()).device
        out: list[float] = []
        for i in range(0, len(pairs), self.batch_size):
            chunk = pairs[i : i + self.batch_size]
            enc = self.tokenizer([a.strip() for a, _ in chunk], [b.strip() for _, b in chunk], padding=True,
                                 truncation=True, return_tensors="pt").to(device)
            out += torch.softmax(self.model(**enc).logits.float(), -1)[:, self.label].tolist()
        return out


class HTTPJudge(Judge):
    """A judge behind an OpenAI-compatible endpoint (a hosted model, or a vLLM, SGLang or llama-cpp-python server).

    The prompt asks for one token; P(same) comes from the returned log-probabilities of the yes and
    no answers when the server gives them, else from the answer text (1.0 or 0.0). Requests go through
    :class:`~generation.engines.connection.Connection` (its retries with backoff, timeouts and key handling), and
    state the whole distribution (greedy, top-p 1 and, on a known engine, its neutral top-k, min-p and repetition
    penalty, :data:`~generation.engines.NEUTRAL_SAMPLING`).

    Args:
        url: base URL, e.g. ``http://127.0.0.1:8000/v1`` (the route is appended).
        model: model name the server expects.
        template: prompt with ``{a}`` and ``{b}``.
        api: ``chat`` (``/chat/completions``) or ``completions`` (``/completions``).
        api_key_env: name of the environment variable holding the API key (never logged); empty = no key.
        timeout: seconds per request attempt.
        retries: attempts per request before failing (connection errors, timeouts, 429 and 5xx are retried).
        concurrency: requests in flight.
        yes: answer meaning "same".
        no: answer meaning "different".
        **kwargs: :class:`Judge` options.
    """

    def __init__(self, url: str, model: str, template: str, api: str = "chat", api_key_env: str = "OPENAI_API_KEY",
                 timeout: float = 30.0, retries: int = 3, concurrency: int = 8,
                 yes: str = "yes", no: str = "no", **kwargs):
        super().__init__(**kwargs)
        if api not in ("chat", "completions"):
            raise ValueError(f"api={api!r}; expected 'chat' or 'completions'")
        if yes.strip().lower() == no.strip().lower():
            raise ValueError(f"answers {yes!r} and {no!r} are the same word; give distinct answers")
        from generation.engines.connection import Connection, public_url

        self.conn = Connection(url, api_key_env=api_key_env, timeout=timeout, retries=retries)
        self.url = public_url(url.rstrip("/")) + ("/chat/completions" if api == "chat" else "/completions")
        self.model, self.template, self.api = model, template, api
        self.concurrency, self.yes, self.no = concurrency, yes.strip().lower(), no.strip().lower()
        self.id = f"http:{self.url}:{model}:{template}"
        self._fields: dict | None = None

    def _sampling_fields(self) -> dict:
        """The endpoint's neutral sampling fields (asked once: which engine serves it)."""
        if self._fields is None:
            from generation.engines import NEUTRAL_SAMPLING
            from generation.engines.connection import identify

            self._fields = dict(NEUTRAL_SAMPLING.get(identify(self.conn)[0] or "", {}))
        return self._fields

    def _ask(self, prompt: str) -> dict:
        """One request (retried by the connection): the answer as a dict.

        Raises:
            Unreachable: the endpoint failed after the retries, naming its URL, never the key.
        """
        from generation.engines.base import Unreachable

        common = {"model": self.model, "max_tokens": 1, "temperature": 0.0, "top_p": 1.0,
                  "extra_body": self._sampling_fields() or None}
        try:
            if self.api == "chat":
                resp = self.conn.client.chat.completions.create(
                    messages=[{"role": "user", "content": prompt}], logprobs=True, top_logprobs=5, **common)
            else:
                resp = self.conn.client.completions.create(prompt=prompt, logprobs=5, **common)
        except self.conn.openai.OpenAIError as e:
            raise Unreachable(self.conn.say(f"judge endpoint {self.url} failed after {self.conn.retries} attempt(s): "
                                            f"{self.conn.say(e)}; check that it is running and reachable"),
                              self.conn.root) from None
        return resp.model_dump()

    def _parse(self, resp: dict) -> float:
        choice = (resp.get("choices") or [{}])[0]
        tops: dict[str, float] = {}
        lp = choice.get("logprobs") or {}
        if self.api == "chat" and lp.get("content"):
            tops = {t["token"]: t["logprob"] for t in lp["content"][0].get("top_logprobs", [])}
        elif self.api == "completions" and lp.get("top_logprobs"):
            tops = dict(lp["top_logprobs"][0])
        yes, no = (sum(math.exp(lp) for t, lp in tops.items() if t.strip().lower() == w) for w in (self.yes, self.no))
        if yes + no > 0:
            return yes / (yes + no)
        text = (choice.get("message") or {}).get("content") if self.api == "chat" else choice.get("text")
        return float(str(text or "").strip().lower().startswith(self.yes))

    def _prob_same(self, pairs: Sequence[Pair]) -> list[float]:
        prompts = [self.template.format(a=a.strip(), b=b.strip()) for a, b in pairs]
        with ThreadPoolExecutor(max(1, self.concurrency)) as pool:
            return [self._parse(r) for r in pool.map(self._ask, prompts)]
