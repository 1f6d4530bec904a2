"""What the package's command lines share (`python -m probes.fit`, `python -m datamodules.labels.build`,
`python -m semanticspec.serve`, the benchmarks).

They read their arguments once through :func:`normalise_args` (``--key=value`` is ``--key value``;
``-c`` is ``--config``), check every YAML they are given before jsonargparse reads it (a syntax
error then names the file, not ``"<unicode string>"``), answer a mistyped option with the
closest ones the parser knows (:func:`did_you_mean`), and report bad input as one line and exit 2
(:func:`fail`, which every parser's errors go through: :class:`OneLineErrors`). The long jobs that resume (the
label build, also within the fit, and the evaluation) stop on SIGTERM as on Ctrl-C (:func:`sigterm_interrupts`).
"""

from __future__ import annotations

import difflib
import re
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import yaml

_OPTION = re.compile(r"^(--[A-Za-z_][\w.\-]*\+?)=(.*)$", re.DOTALL)


def normalise_args(args: list[str]) -> list[str]:
    """``args`` with each ``--key=value`` split into ``--key value`` and ``-c`` spelled ``--config``.

    Both CLIs look at some options themselves before jsonargparse does (``--config``, ``--ckpt_path``,
    ``--fit_config``, ``--help``); spelling every option one way makes ``--key=value`` and ``--key value``
    mean the same for all of them. ``--print_config=skip_null`` stays whole: its value is optional, so jsonargparse
    reads one only after ``=``. Nothing after a lone ``--`` is touched.
    """
    out: list[str] = []
    for i, a in enumerate(args):
        if a == "--":
            return out + list(args[i:])
        m = _OPTION.match(a)
        if m and m.group(1) != "--print_config":
            out += [m.group(1), m.group(2)]
        elif a == "-c" or a.startswith("-c="):
            out += ["--config"] + ([a[3:]] if a.startswith("-c=") else [])
        else:
            out.append(a)
    return out


def check_yaml_files(args: list[str], flags: tuple[str, ...] = ("--config", "-c")) -> list[tuple[str, dict]]:
    """Parse each YAML file given to ``flags`` in ``args`` (``--config F`` or ``--config=F``); a syntax error is raised
    naming the file and line. Returns each file's name and mapping.

    Raises:
        ValueError: ``FILE: invalid YAML: ... line L, column C``, or a file that is not UTF-8 text.
    """
    given, read = [(a, args[i + 1]) for i, a in enumerate(args[:-1]) if a in flags], []
    for a, value in given + [tuple(a.split("=", 1)) for a in args if a.split("=", 1)[0] in flags and "=" in a]:
        path = Path(value)
        if not path.is_file():
            continue  # jsonargparse says what is wrong with a path, or reads the value as inline YAML
        try:
            with path.open() as f:  # from a stream, YAML's marks carry the file's name
                loaded = yaml.safe_load(f)
        except UnicodeDecodeError as e:  # read as jsonargparse reads it; its error named no file
            raise ValueError(f"{a} {path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
            what = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ValueError(f"{a} {path}: invalid YAML{at}: {what}") from None
        if not isinstance(loaded, dict):  # jsonargparse says "Unexpected config:" and names nothing
            found = "nothing (an empty file)" if loaded is None else f"a {type(loaded).__name__}"
            raise ValueError(f"{a} {path}: expected a YAML mapping of options (key: value lines), found {found}")
        read.append((value, loaded))
    return read


def did_you_mean(message: str, options: list[str], args: list[str] | None = None) -> str:
    """``message`` (an "unrecognized arguments" error, or jsonargparse's "Group 'g' does not accept option 'k'" or
    "Option 'k' is not accepted") with the closest known options of each unknown one; a key no option of ``args``
    (the command line, when given) set is named as a key of its config files."""
    m = re.search(r"nrecognized arguments: (.*)", message)
    group = re.search(r"Group '([\w.]+)' does not accept option '([\w.]+)'", message)
    top = re.search(r"Option '([\w.]+)' is not accepted|unknown key '([\w.]+)'", message)
    key = f"--{group[1]}.{group[2]}" if group else f"--{top[1] or top[2]}" if top else None
    if key and args is not None:
        # "Option 'lr' is not accepted" names no parent: an option given as --model.optimizer.init_args.lr is that
        given = next((a.split("=")[0] for a in args if a.split("=")[0] == key or top and top[1] and
                      a.startswith("--") and a.split("=")[0].endswith("." + top[1])), None)
        files = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--config", "--fit_config")]
        if given:
            key = given
        elif files:
            message = message.rstrip() + f" (a key of {', '.join(files)})"
    if not m and not key:
        return message
    unknown = [w.split("=")[0] for w in m.group(1).split() if w.startswith("--")] if m else [key]
    hints = [f"did you mean {close[0]}?" for word in unknown
             if (close := difflib.get_close_matches(word, options, n=1, cutoff=0.75))]
    return message.rstrip() + ("; " + "; ".join(hints) if hints else "")


def parser_options(parser) -> list[str]:
    """Every ``--option`` a jsonargparse/argparse parser knows."""
    return sorted(s for s in parser._option_string_actions if s.startswith("--"))


def fail(prog: str, message: str) -> NoReturn:
    """Report bad input as one line on stderr and exit 2 (no traceback, no page of usage).

    jsonargparse explains a type error over several lines: the lines that name the key, the types and the value are
    kept; a class that refused its arguments in an Optional field keeps its own message, not the Union's wrapping.
    """
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    noise = ("Subtypes:", "Errors:", "Given value type:")
    text = " ".join(line for line in lines if not line.startswith(noise))
    refused = re.search(r"(invalid \w+: .*?)(?: - Expected a <class 'NoneType'>.*)?$", text)
    generic = ("Does not validate", "Expected a", "Problem with given class_path", "Parser key")  # jsonargparse's
    own = [line[2:] for line in lines if line.startswith("- ") and not line[2:].startswith(generic)
           and not line.endswith(":")]  # a class's own refusal: one whole line among the unions' bullets
    if refused and "Union subtypes" in text:
        text = refused.group(1)
    elif own and "Union subtypes" in text:  # the class's own refusal of its arguments, after what named it
        text = text.split("Does not validate")[0] + own[0]
    print(f"{prog}: error: {text} (see `{prog} --help`)", file=sys.stderr)
    raise SystemExit(2)


@contextmanager
def sigterm_interrupts():
    """Within the block, SIGTERM (a scheduler's stop: SLURM, Kubernetes, ``kill``) stops the command as Ctrl-C does:
    it raises KeyboardInterrupt, so partial files are removed and the command says how to resume, where the default
    would end the process at once, without a word. The handler before is restored after; off the main thread (where
    Python takes no handler) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


class OneLineErrors:
    """Mix into an argparse or jsonargparse parser class, first: its errors are :func:`fail`'s one line naming its
    ``prog``, with the closest known options of a mistyped one."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        from jsonargparse._common import debug_mode_active

        if not getattr(self, "exit_on_error", True) or debug_mode_active():  # jsonargparse asks for an exception
            super().error(message, ex)
        fail(self.prog, did_you_mean(message, parser_options(self), getattr(self, "given_args", None)))


def one_line_parser(prog: str, **kwargs):
    """A jsonargparse ``ArgumentParser`` (``kwargs`` its arguments) with :class:`OneLineErrors`, whose class makes
    parsers named ``prog`` too: jsonargparse makes a nested help's (``--task.help CLASS``) without one, which then said
    ``usage: __main__.py``."""
    from jsonargparse import ArgumentParser

    class OneLineParser(OneLineErrors, ArgumentParser):
        def __init__(self, *args, prog: str = prog, **kw):
            super().__init__(*args, prog=prog, **kw)

    return OneLineParser(**kwargs)
