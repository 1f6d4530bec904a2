"""What every benchmark script shares: its command line, where its figures go and how they are written (markdown
tables, JSON), and the small timing and child-process helpers several scripts measure with.

A script builds its parser here, measures, and hands its report to :func:`write`::

    ap = harness.parser(__doc__, quick="100 problems, writes first-step-quick.json", threads=1, name="first-step")
    args = ap.parse_args(argv)
    ...
    harness.write(report, harness.results_path("first-step", args.quick, args.out), table)

Figures go to ``benchmarks/results/<name>.json`` (``<name>-quick.json`` for ``--quick``, a reduced run
of the same code path), as docs/design.md "Benchmark figures" describes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from tabulate import tabulate

from generation.cli import OneLineErrors
from generation.paths import strict_json

REPO = Path(__file__).resolve().parents[1]
"""The repository's root."""
RESULTS_DIR = REPO / "benchmarks" / "results"
"""The one folder of the benchmarks' figures (``benchmarks/results``)."""


def parser(doc: str, quick: str, threads: int | None = None, threads_help: str = "torch CPU threads", *,
           name: str | None = None, **kwargs: Any) -> argparse.ArgumentParser:
    """The script's argument parser, with ``--quick`` (and ``--threads``, ``--out``) already declared.

    Args:
        doc: the script's module docstring; its first paragraph becomes the description.
        quick: help of ``--quick``: what the reduced run does and where it writes.
        threads: default of ``--threads``; None declares no ``--threads``.
        threads_help: help of ``--threads``.
        name: the figures' name (:func:`results_path`); declares ``--out``, the JSON path that replaces
            ``benchmarks/results/<name>[-quick].json`` (a test's quick run writes outside the repository).
        **kwargs: passed to :class:`argparse.ArgumentParser` (e.g. ``formatter_class``).

    Returns:
        The parser; the script adds its own options.
    """
    prog = _prog()
    if prog:
        kwargs.setdefault("prog", prog)
    ap = OneLineParser(description=doc.split("\n\n")[0], **kwargs)
    ap.add_argument("--quick", action="store_true", help=quick)
    if threads is not None:
        ap.add_argument("--threads", type=count, default=threads, help=threads_help)
    if name is not None:
        ap.add_argument("--out", type=json_path, default=None,
                        help=f"JSON path (default benchmarks/results/{name}[-quick].json)")
    return ap


def count(text: str) -> int:
    """An argparse ``type``: an integer >= 1 (problems, tokens, passes, threads). A count of 0 is refused rather than
    read as "the default", and a negative one rather than run to empty figures."""
    return _integer(text, 1)


def non_negative(text: str) -> int:
    """An argparse ``type``: an integer >= 0 (a seed: ``random.Random(-1)`` is ``random.Random(1)``; a top-k)."""
    return _integer(text, 0)


def port(text: str) -> int:
    """An argparse ``type``: a TCP port, 1 to 65535."""
    value = _integer(text, 1)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value}: expected a port from 1 to 65535")
    return value


def _integer(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= {least}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value}: expected an integer >= {least}")
    return value


def json_path(text: str) -> Path:
    """An argparse ``type``: where a script writes its JSON (and its ``.md``, ``.png`` beside it), checked before the
    run: a ``.json`` path, not a folder, in a folder that exists or can be made."""
    from generation.paths import folder_problem

    path = Path(text).expanduser()
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: is a folder; expected a JSON file's path")
    if path.suffix != ".json":  # the table and the plot go beside it, as its .md and .png
        raise argparse.ArgumentTypeError(f"{text!r}: expected a path ending in .json (the .md and .png go beside it)")
    if problem := folder_problem(path.parent, "its folder"):
        raise argparse.ArgumentTypeError(problem)
    return path


class OneLineParser(OneLineErrors, argparse.ArgumentParser):
    """An argparse parser that refuses bad input in one line naming ``python -m benchmarks.<name>`` (exit 2),
    with the closest known option of a mistyped one, as the package's other CLIs do."""


def _prog() -> str | None:
    """``python -m benchmarks.<name>`` of the script run, or, when a test calls its ``main``, of the outermost
    benchmark module on the call stack (``first_step`` asks for its parser through ``decode``)."""
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    if main is not None and main.name.startswith("benchmarks."):
        return f"python -m {main.name.removesuffix('.__main__')}"
    name, frame = None, sys._getframe(2)
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("benchmarks."):
        name, frame = frame.f_globals["__name__"], frame.f_back
    return f"python -m {name}" if name else None


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports no process listens on now (the OS's picks, held together while picked), for
    servers the script starts: two runs at once then each talk to their own servers."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def child_json(code: str, args: Sequence[str], threads: int, what: str) -> dict:
    """Run ``python -c code *args`` in the repository with ``OMP_NUM_THREADS=threads``; the JSON its last output line
    prints. Fails naming ``what``, with the end of its stderr, when it exits non-zero."""
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if out.returncode:
        raise RuntimeError(f"{what} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def median_seconds(fn: Callable[[], object], n: int = 200, before: Callable[[], object] | None = None) -> float:
    """Median seconds of ``n`` calls of ``fn()``, each after ``before()`` when given (not timed)."""
    times = []
    for _ in range(n):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def results_path(name: str, quick: bool, out: str | Path | None = None) -> Path:
    """``out`` when given, else ``benchmarks/results/<name>.json`` (``<name>-quick.json`` for a quick run)."""
    if out is not None:
        return Path(out)
    return RESULTS_DIR / f"{name}{'-quick' if quick else ''}.json"


def shown(path: Path) -> str:
    """``path`` relative to the working directory when it lies inside it, else as given."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A markdown table (GitHub's format); cells are shown as given, never reparsed as numbers."""
    return tabulate(list(rows), list(header), tablefmt="github", disable_numparse=True)


def write(report: dict, path: Path, table: str | None = None, *, save_table: bool = False,
          also: Sequence[Path] = ()) -> Path:
    """Print the markdown ``table``, write ``report`` as JSON at ``path`` and say what was written.

    Args:
        report: the figures (JSON-serializable).
        path: the JSON file (:func:`results_path`); its folder is created.
        table: the figures as markdown, printed first; None prints nothing.
        save_table: also write ``table`` next to the JSON (same name, ``.md``).
        also: other files the script wrote (a plot), named on the "wrote" line.

    Returns:
        ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(strict_json(report))
    written = [path]
    if table is not None and save_table:
        written.append(path.with_suffix(".md"))
        written[-1].write_text(table + "\n")
    if table is not None:
        print(table)
    print(f"\nwrote {', '.join(shown(p) for p in [*written, *also])}")
    return path
