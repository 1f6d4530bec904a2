"""What a step loop's work costs in seconds: the loop computes, the meter measures.

:class:`~semanticspec.loop.StepLoop` reads no clock. It tells its observer, a :class:`Meter`, when a round runs and
for which rows (:meth:`Meter.round`), which phase of a round it is in and for whom (:meth:`Meter.phase`), and when
rows come and end; the meter times them and writes the seconds into each row's
:class:`~semanticspec.results.DecodeStats` and into the steps the round traced. Nothing a row decides reads the
meter."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from semanticspec.rows import Row

PHASES = ("first_step", "draft", "verify", "rewrite")
"""The phases :meth:`Meter.phase` shares out, each to the row stats field of its name and ``_s``; the probes' seconds
inside a phase go to ``probe_s`` instead."""


class Meter:
    """The clocks of one step loop over ``rows``, its two parts (``verifier``, ``proposer``) timing their own forwards
    (``forward_s``, per row ``served_s``) and probes (``probe_s``, seconds so far)."""

    def __init__(self, rows: list[Row], verifier, proposer) -> None:
        self.rows, self.parts = rows, (verifier, proposer)
        self.t_start = time.perf_counter()
        self.t_in = [self.t_start] * len(rows)  # when each row came
        self.t_done: dict[int, float] = {}  # when each finished row was seen finished (end of its round)
        self.pending = [0.0] * len(rows)  # per row: its share of the rounds since its last traced step
        self.stamped = [0] * len(rows)  # per row: trace entries whose seconds are set

    def admitted(self) -> None:
        """A row joined (the last of ``rows``)."""
        self.t_in.append(time.perf_counter())
        self.pending.append(0.0)
        self.stamped.append(0)

    def finished(self, rows_i: Sequence[int]) -> None:
        """Rows ended outside a round (closed at their limit, or cancelled), now unless seen before."""
        now = time.perf_counter()
        for i in rows_i:
            self.t_done.setdefault(i, now)

    @contextmanager
    def round(self, active: Sequence[int]) -> Iterator[None]:
        """A round over the ``active`` rows. Its seconds are shared evenly by them; a row's new steps share what it
        was given since its last step (a step's ``seconds``); a row counts as idle the forwards that ran without
        feeding it (``idle_row_s``); the rows that finished in it are noted finished."""
        t0, total0 = time.perf_counter(), self._forward_s()
        served0 = {i: self._served_s(i) for i in active}
        yield
        now = time.perf_counter()
        total = self._forward_s() - total0
        for i in active:
            r = self.rows[i]
            r.stats.idle_row_s += total - (self._served_s(i) - served0[i])
            self.pending[i] += (now - t0) / len(active)
            if len(r.trace) > self.stamped[i]:
                new = r.trace[self.stamped[i]:]
                for t in new:
                    t.seconds = self.pending[i] / len(new)
                self.pending[i], self.stamped[i] = 0.0, len(r.trace)
            if r.done:
                self.t_done[i] = now

    @contextmanager
    def phase(self, fields: Mapping[int, str]) -> Iterator[None]:
        """A phase of a round for the rows of ``fields``, each mapped to the phase its share counts to
        (:data:`PHASES`). The seconds, less the probes' (which go to the rows not rewriting), are shared evenly by
        the rows that did not fail in it."""
        if bad := sorted(set(fields.values()) - set(PHASES)):
            raise ValueError(f"phase names must be among {PHASES}, got {bad}")
        t0, probe0 = time.perf_counter(), self._probe_s()
        yield
        probe = self._probe_s() - probe0
        seconds = time.perf_counter() - t0 - probe
        ok = [i for i in fields if self.rows[i].error is None]
        for i in ok:
            st, name = self.rows[i].stats, f"{fields[i]}_s"
            setattr(st, name, getattr(st, name) + seconds / len(ok))
        judged = [i for i in ok if fields[i] != "rewrite"]
        for i in judged:
            self.rows[i].stats.probe_s += probe / len(judged)

    def batch_ended(self) -> None:
        """The batch ends now: each row's ``wall_s`` is its share of the batch's seconds, its ``done_idle_row_s`` the
        seconds since it finished."""
        now = time.perf_counter()
        share = (now - self.t_start) / len(self.rows)
        for i, r in enumerate(self.rows):
            r.stats.wall_s, r.stats.done_idle_row_s = share, now - self.t_done.get(i, now)

    def row_ended(self, i: int) -> None:
        """Row ``i`` ends when rows come and go: its ``wall_s`` runs from its admission to the end of the round it
        finished in."""
        self.rows[i].stats.wall_s, self.rows[i].stats.done_idle_row_s = self.t_done[i] - self.t_in[i], 0.0

    def _forward_s(self) -> float:
        return sum(p.forward_s for p in self.parts)

    def _served_s(self, i: int) -> float:
        return sum(p.served_s[i] for p in self.parts)

    def _probe_s(self) -> float:
        return sum(p.probe_s for p in self.parts)
