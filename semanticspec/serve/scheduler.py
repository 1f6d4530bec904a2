"""The decode thread behind the endpoint: requests join a running step loop between rounds and leave when done.

One thread owns the models (or the two servers' clients). Requests that decode alike (the same method, sampling and
window: one method) share one :class:`~semanticspec.loop.StepLoop`; a new one is admitted into it between rounds
(:meth:`StepLoop.admit <semanticspec.loop.StepLoop.admit>`), up to ``max_rows`` rows, and each row ends on its
own. A loop admits ``rows_per_loop`` rows in its life at most: the next requests of its method then start a fresh
loop while it drains, so under steady traffic no loop keeps or scans an unbounded number of finished rows. Every row
draws from its own random streams, seeded from its request's ``seed``, so a request decodes the same text whatever
else is running (the batched = one-by-one guarantee of ``generate``, for rows that come at any time). Loops take
turns, event by event. The thread talks to the asyncio side through each request's
callback, which it calls with :class:`Update` objects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from generation.engines.base import EngineError
from semanticspec.config import DecodeConfig
from semanticspec.served import ServedPrompt
from semanticspec.results import Decision, DecodeResult, DecodeStats, StepTrace

log = logging.getLogger(__name__)


@dataclass
class Update:
    """What the decode thread tells a request.

    Attributes:
        planned: the request passed every check and waits for room in a loop (the first update of a good request).
        delta: output text added since the last update ("" on a refused step or the end).
        result: on the end update, the result (its text cut at a stop string); None before.
        finish: on the end update, OpenAI's ``finish_reason`` (``stop``, ``length``), ``error`` (a server failed the
            row), or ``invalid`` (a check refused the request before it decoded).
        error: on an error or invalid end, the message (a server's URL, never a key).
        status: on an error end, the HTTP status it answers with: 502 a server failed the row, 503 the server is
            shutting down, 500 a fault of the endpoint.
        cause: on an error end whose server refused the row's request, the engine's error (a
            :class:`~generation.engines.base.Refused` is the caller's error: the prompt past the server's context).
    """

    planned: bool = False
    prompt_tokens: int = 0
    delta: str = ""
    result: DecodeResult | None = None
    finish: str | None = None
    error: str | None = None
    status: int = 500
    cause: BaseException | None = None


@dataclass
class Job:
    """One request to decode: its prompt (as the decoder reads it, or a function that makes it in the decode thread,
    which owns the tokenizers), config, stop strings and callback."""

    prompt: object
    config: DecodeConfig
    notify: Callable[[Update], None]
    stop: tuple[str, ...] = ()
    stream: bool = True  # told each step's text as it comes; else only the end (whose result holds the text)
    budget: Callable[[int | None], int] | None = None  # no max_tokens given: the budget from the prompt's room
    after_cancel: int = 0  # steps its loop yielded after it was cancelled
    cancelled: bool = False
    ended: bool = False
    text: str = ""  # output text so far (sent, when streamed)
    arrived: float = dataclasses.field(default_factory=time.monotonic)  # when it was made (time.monotonic)
    first_text_at: float | None = None  # when its first output text was decoded (time.monotonic)


class QueueFull(RuntimeError):
    """The scheduler holds ``max_queue`` requests already."""


FINISH = {"eos": "stop", "answer": "stop", "budget": "length", "context": "length", "error": "error"}
"""OpenAI's ``finish_reason`` of each stop reason."""


class _Group:
    """The running loop of one method, its rows' jobs and its events."""

    def __init__(self, dec, plan, job: Job) -> None:
        self.dec = dec
        self.loop = dec.step_loop(plan, plan.inputs, plan.keys)
        self.jobs: dict[int, Job] = {0: job}  # the rows whose end event has not passed yet
        self.events: Iterator = self.loop.serve(plan.method)

    def admit(self, plan, job: Job) -> None:
        i = self.loop.admit(self.dec.row_inputs(plan.inputs, 0), plan.cfg.max_new_tokens, plan.keys[0])
        self.jobs[i] = job

    @property
    def admitted(self) -> int:
        """Rows the loop has admitted in its life."""
        return len(self.loop.rows)

    @property
    def rows(self) -> int:
        return sum(not self.loop.rows[i].done for i in list(self.jobs))


class Scheduler:
    """The decode thread and its queue.

    Args:
        decoder: a :class:`~semanticspec.decoder.SemanticSpecDecoder` or :class:`~semanticspec.served.ServedDecoder`.
        max_rows: rows one loop decodes together (in-process: the batch; served: the rows whose requests are in
            flight, each bounded by the decoder's ``concurrency``).
        max_queue: requests waiting or decoding at once; past it :meth:`submit` raises :class:`QueueFull`.
        rows_per_loop: rows one loop admits in its life (at least ``max_rows``); the next requests of its method then
            start a fresh loop while it drains, which bounds what a loop keeps under steady traffic.
        on_step: called in the decode thread after every tried step (its decision, its seconds), for metrics.
        count_tokens: a text prompt's token count (a decoder that reads text, as two servers do), or None (0).
    """

    def __init__(self, decoder, max_rows: int = 16, max_queue: int = 128,
                 on_step: Callable[[str, float], None] | None = None,
                 count_tokens: Callable[[str], int] | None = None, rows_per_loop: int = 256) -> None:
        for name, v in (("max_rows", max_rows), ("max_queue", max_queue), ("rows_per_loop", rows_per_loop)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r}: expected an integer >= 1")
        if rows_per_loop < max_rows:
            raise ValueError(f"rows_per_loop={rows_per_loop}: expected at least max_rows={max_rows}")
        self.dec, self.max_rows, self.max_queue, self.on_step = decoder, max_rows, max_queue, on_step
        self.rows_per_loop = rows_per_loop
        self.count_tokens = count_tokens
        self.inbox: queue.Queue[Job] = queue.Queue()
        self.waiting: deque[tuple[Job, object]] = deque()  # planned, waiting for room in their loop
        self.groups: dict[object, _Group] = {}
        self.pending = 0  # jobs submitted and not ended
        self.cancelled = 0  # rows that left their loop before their end (their client went away)
        self.dropped = 0  # requests whose client went away while they waited for room in a loop
        self.after_cancel = 0  # steps of cancelled rows that their loop yielded after the cancel (its round's own)
        self.max_after_cancel = 0  # the most such steps of one row
        self.joined = 0  # requests admitted into a loop that was already running
        self.loops = 0  # loops started
        self.stopping = False
        self.failure: str | None = None  # why the thread died, if it did
        self.abort_reason: str | None = None  # set when stop() ends the requests left: why
        self.planning: Job | None = None  # the job the decode thread is planning (out of the inbox, in no line yet)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="semanticspec-decode", daemon=True)
        self._thread.start()

    def plan(self, prompt, config: DecodeConfig, budget: Callable[[int | None], int] | None = None):
        """The decoder's plan of one prompt: every check ``generate`` makes, and room in the models' context for the
        prompt and ``max_new_tokens`` (ValueError naming the bad value). ``budget``: the request gave no
        ``max_tokens``, and its budget is ``budget(room)`` (room: the new tokens the prompt leaves, None unknown)."""
        plan = self.dec.plan([prompt], config)
        room = self.dec.prompt_room(plan)
        if room is not None and room < 1:
            raise ValueError(f"the prompt has {self._prompt_tokens(plan.inputs[0][0])} tokens, which leave no room for "
                             f"a new token in {_context(plan)}")
        if budget is not None:
            return plan._replace(cfg=dataclasses.replace(plan.cfg, max_new_tokens=budget(room)))
        if room is not None and config.max_new_tokens > room:
            raise ValueError(f"max_tokens={config.max_new_tokens}: too large; at most {room} new tokens fit after "
                             f"the prompt's {self._prompt_tokens(plan.inputs[0][0])} tokens in {_context(plan)}; use "
                             f"max_tokens <= {room}")
        return plan

    def submit(self, job: Job) -> None:
        """Queue ``job`` (planned again in the decode thread).

        Raises:
            QueueFull: ``max_queue`` jobs are waiting or decoding.
            RuntimeError: the scheduler is stopping or its thread died.
        """
        with self._lock:
            if self.stopping or self.failure:
                raise RuntimeError(self.failure or "the server is shutting down")
            if self.pending >= self.max_queue:
                raise QueueFull(f"{self.pending} requests are queued or decoding (max_queue={self.max_queue})")
            self.pending += 1
            self.inbox.put(job)

    @property
    def queued(self) -> int:
        """Requests waiting for room in a loop."""
        return len(self.waiting) + self.inbox.qsize()

    @property
    def running(self) -> int:
        """Rows decoding now."""
        return sum(g.rows for g in list(self.groups.values()))

    def stop(self, timeout: float, reason: str = "the server shut down before this request finished") -> None:
        """Admit nothing more; let the rows decoding now finish for up to ``timeout`` seconds, then end the rest with
        an error saying ``reason`` (status 503)."""
        with self._lock:
            self.stopping = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.abort(reason)
            self._thread.join(1.0)  # its rows leave at the next round; one waiting on a server ends with the process

    def abort(self, reason: str) -> None:
        """End every request left with an error saying ``reason`` (status 503), now: answered here, as a served round
        may take longer than the time left; their rows leave their loops at the next round."""
        self.abort_reason = reason
        jobs = [j for g in list(self.groups.values()) for j in list(g.jobs.values())]
        planning = [j for j in (self.planning,) if j is not None]  # its plan may wait on a server past the grace
        for j in jobs + planning + [j for j, _ in list(self.waiting)] + list(self.inbox.queue):
            j.cancelled = True
            self._end(j, self._cancelled())

    # ---------------------------------------------------------------- the decode thread

    def _run(self) -> None:
        import torch

        try:
            with torch.inference_mode():  # as generate(): the mode is per thread
                while not (self.stopping and not self.groups and not self.waiting and self.inbox.empty()):
                    self._take(block=not self.groups and not self.waiting)
                    self._place()
                    for key in list(self.groups):
                        self._advance(key)
        except Exception as e:  # noqa: BLE001 - a fault of the scheduler itself: every open request learns why
            log.exception("the decode thread failed")
            self._fail_all(e)

    def _fail_all(self, e: Exception) -> None:
        """End every open request with the thread's fault: those decoding, those waiting for room and those still in
        the inbox (set under the lock, so nothing is submitted after them)."""
        with self._lock:
            self.failure = f"the decode thread failed: {type(e).__name__}: {e}"
        jobs = [j for g in self.groups.values() for j in g.jobs.values()]
        for j in jobs + [j for j, _ in self.waiting] + list(self.inbox.queue):
            self._end(j, Update(finish="error", error=self.failure))

    def _take(self, block: bool) -> None:
        """Move new jobs from the inbox to the waiting line, planned (a plan that fails ends its job)."""
        try:
            job = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if not job.ended:  # abort() answers the jobs in the inbox where they are, and the one planned here
                self.planning = job
                try:
                    with self._guard(job, "planning"):
                        prompt = job.prompt() if callable(job.prompt) else job.prompt
                        plan = self.plan(prompt, job.config, job.budget)
                        tokens = self._prompt_tokens(plan.inputs[0][0])
                        self._tell(job, Update(planned=True, prompt_tokens=tokens))
                        self.waiting.append((job, plan))
                finally:
                    self.planning = None
            try:
                job = self.inbox.get_nowait()
            except queue.Empty:
                return

    @contextlib.contextmanager
    def _guard(self, job: Job, what: str):
        """Run a block of one job's work: a refusal (ValueError) ends it as ``invalid``, a server that failed it (an
        :class:`~generation.engines.base.EngineError`: a prompt counted on a server that is gone) as a 502 ``error``
        with the engine's error as its cause, any other fault as a 500 ``error`` (logged with its traceback); the
        thread and the other jobs go on."""
        try:
            yield
        except ValueError as e:
            self._end(job, Update(finish="invalid", error=str(e)))
        except EngineError as e:
            log.warning("a request failed while %s: %s", what, e)
            self._end(job, Update(finish="error", error=str(e), status=502, cause=e))
        except Exception as e:  # noqa: BLE001 - a fault of this request ends it, not the thread
            log.exception("a request failed while %s", what)
            self._end(job, Update(finish="error", error=f"{type(e).__name__}: {e}"))

    def _prompt_tokens(self, first) -> int:
        """The first prompt's tokens in the target's tokenizer: its ids in-process, its server's count served (else
        the endpoint's own tokenizer's, 0 without one)."""
        if isinstance(first, ServedPrompt):
            if first.tokens is not None:
                return first.tokens
            return self.count_tokens(first.text) if self.count_tokens is not None else 0
        return len(first)

    def _place(self) -> None:
        """Admit waiting jobs, in order, into their method's loop while it has room (a new loop if none runs)."""
        left = deque()
        while self.waiting:
            job, plan = self.waiting.popleft()
            if job.cancelled or self.abort_reason is not None:  # after abort(): those it saw, and any planned as it ran
                self.dropped += self.abort_reason is None  # a shutdown's are not clients gone
                self._end(job, self._cancelled())
                continue
            key = (plan.method, plan.sampling, plan.loop, plan.step, plan.spare, plan.cfg.judge_suffix)
            g = self.groups.get(key)
            if g is not None and g.admitted >= self.rows_per_loop:  # it drains under a key of its own
                self.groups[(key, self.loops)] = self.groups.pop(key)
                g = None
            if g is not None and g.rows >= self.max_rows:
                left.append((job, plan))
                continue
            with self._guard(job, "joining a loop"):
                if g is None:
                    self.groups[key] = _Group(self.dec, plan, job)
                    self.loops += 1
                else:
                    g.admit(plan, job)
                    self.joined += 1
        self.waiting = left

    def _advance(self, key) -> None:
        """One event of a loop: a row's step or end, told to its job; cancelled jobs leave their loop. A fault in the
        loop ends its rows' jobs with an error (their rows share its batch) and the other loops go on."""
        g = self.groups[key]
        for i, j in g.jobs.items():
            if j.cancelled and not g.loop.rows[i].done:
                g.loop.cancel(i, self.abort_reason or "cancelled: the client went away")
                self.cancelled += self.abort_reason is None  # a shutdown's are not clients gone
        try:
            e = next(g.events)
        except StopIteration:
            del self.groups[key]
            return
        except Exception as ex:  # noqa: BLE001 - this loop's fault ends its rows, not the thread
            log.exception("a decode loop failed")
            del self.groups[key]
            for j in g.jobs.values():
                self._end(j, Update(finish="error", error=f"the decode failed: {type(ex).__name__}: {ex}"))
            return
        job = g.jobs[e.prompt]
        if e.end:
            del g.jobs[e.prompt]
            self._finish(job, e, g.loop.rows[e.prompt])
        elif job.ended:  # answered at a stop string: the rest of its round's window is dropped
            pass
        elif job.cancelled:
            job.after_cancel += 1
            self.after_cancel += 1
            self.max_after_cancel = max(self.max_after_cancel, job.after_cancel)
        else:
            self._step(g, e, job)

    def _step(self, g: _Group, e, job: Job) -> None:
        if self.on_step is not None:
            self.on_step(str(e.step.decision), e.step.seconds or 0.0)
        text, hit = cut_at_stop(e.text, job.stop)
        if hit:
            g.loop.cancel(e.prompt, "stop")
            row = g.loop.rows[e.prompt]
            self._send(job, text)
            stats = stats_through(row.trace, e.step, row.stats)
            self._end(job, Update(finish="stop", result=DecodeResult(text, row.trace, stats, "answer")))
        else:  # hold back an end that may start a stop string the next step completes
            self._send(job, text[:len(text) - held_back(text, job.stop)])

    def _send(self, job: Job, text: str) -> None:
        """Tell a streaming job the text past what it was sent."""
        if len(text) > len(job.text):
            if not job.text:
                job.first_text_at = time.monotonic()
            delta, job.text = text[len(job.text):], text
            if job.stream:
                self._tell(job, Update(delta=delta))

    def _cancelled(self) -> Update:
        return Update(finish="error", error=self.abort_reason or "cancelled", status=503)

    def _finish(self, job: Job, e, row) -> None:
        """The end of a row: the text its steps did not carry (a last bonus token, a held-back end), then its end
        update."""
        result = e.result
        if job.ended:  # answered at a stop string
            return
        if job.cancelled:
            self._end(job, self._cancelled())
            return
        if result.stop_reason == "error":
            self._end(job, Update(finish="error", error=result.error, result=result, status=502, cause=row.cause))
            return
        text, hit = cut_at_stop(e.text, job.stop)
        self._send(job, text)
        self._end(job, Update(finish="stop" if hit else FINISH[result.stop_reason],
                              result=dataclasses.replace(result, text=job.text)))

    def _end(self, job: Job, update: Update) -> None:
        """A job's last update (once)."""
        with self._lock:  # stop() ends jobs from another thread
            if job.ended:
                return
            job.ended = True
            self.pending -= 1
        self._tell(job, update)

    def _tell(self, job: Job, update: Update) -> None:
        """Call a job's callback; one that raises (its listener is gone) cancels that job only."""
        try:
            job.notify(update)
        except Exception:  # noqa: BLE001
            log.exception("a request's callback failed")
            job.cancelled = True


def _context(plan) -> str:
    """The models' context as a refusal of a prompt's room names it: with the positions the decoder keeps free."""
    kept = f"{plan.spare} position" + ("" if plan.spare == 1 else "s")
    return (f"the models' context, of which the decoder keeps {kept} free (the target's bonus token; "
            "in-process, SpecReason's judge turn too)")


def held_back(text: str, stop: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` may begin a stop string (held back from a stream until the next
    step says whether the stop string completes: vLLM's detokenizer holds back the same)."""
    return max((k for s in stop for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)


def stats_through(trace: list[StepTrace], step: StepTrace, stats: DecodeStats) -> DecodeStats:
    """``stats`` counted over ``trace`` up to and including ``step`` (a row a stop string ended inside a window:
    the window's later steps are not the answer's), its seconds the steps' own."""
    upto = trace[:next((k for k, t in enumerate(trace) if t is step), len(trace) - 1) + 1]
    kept = [t for t in upto if t.decision != Decision.REJECT]
    drafted = [t for t in upto if t.writer == "draft"]
    return dataclasses.replace(
        stats, steps=len(kept), output_tokens=sum(t.n_tokens for t in kept),
        draft_tokens=sum(t.n_tokens for t in drafted if t.decision.kept),
        draft_steps_proposed=len(drafted), draft_steps_accepted=sum(t.decision.kept for t in drafted),
        wall_s=sum(t.seconds or 0.0 for t in upto))


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` up to the first of the ``stop`` strings in it (left out, as OpenAI's API does), and whether one was."""
    cut = min((k for k in (text.find(s) for s in stop if s) if k >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)
