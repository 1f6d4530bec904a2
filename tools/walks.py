"""How far a parameter travels: follow a value from a public entry point through every call that passes it on.

    python -m tools.walks                      # temperature from the decoder's generate, and literal defaults
    python -m tools.walks --root /path/to/checkout --out walks.json
    python -m tools.walks --entry probes.export:load_probe=path

A static walk over the AST of the package (``generation``, ``probes``, ``datamodules``, ``callbacks``). Inside a
function, the value is the parameter and every name assigned something that carries it (``sampling = {"temperature":
temperature}``, ``spec = SamplingSpec(temperature, top_p)``, ``self.x = spec``, ``spec.temperature``; not the result
of an ordinary call); a call that is given such a holder passes the value on to the callee's matching parameter
(``**kwargs`` of a tainted dict: the parameter with the walked name). Callees are resolved through the module's
imports, the enclosing class (``self.m``) and, for ``obj.m(...)``, every method of that name in the package (all of
them when several classes define it). The calls are visited depth first, in source order, every call site anew (a
function reached from four places is visited four times); each function that receives the value is one *visit* (a
value stored on ``self`` is followed into the class's other methods that read it), consecutive visits in one file
are one *stay*, and a stay in a file the walk had already left is a *return* (issue 19's measure of how often a
reader must come back to a file). A static walk loses the trail where a value goes through a call it cannot resolve
(an object handed to another that calls back into it): count such routes by hand.
"""

from __future__ import annotations

import argparse
import ast
import json
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("generation", "probes", "datamodules", "callbacks")


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    imports: dict[str, str] = field(default_factory=dict)  # local name -> dotted target
    functions: dict[str, ast.FunctionDef] = field(default_factory=dict)  # "f" or "Class.m"


def load_modules(root: Path) -> dict[str, Module]:
    """Every module of the package, with its imports and its functions (``f`` and ``Class.m``)."""
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mod = Module(name, path, ast.parse(path.read_text()))
            mod.imports = _imports(mod.tree)
            mod.functions = _functions(mod.tree)
            mods[name] = mod
    return mods


def _imports(tree: ast.Module) -> dict[str, str]:
    """Local name -> the dotted name it stands for."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
        elif isinstance(node, ast.Import):
            out.update({a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                        for a in node.names})
    return out


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """Top-level functions by name and methods as ``Class.m``; a class name stands for its ``__init__``."""
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{node.name}.{item.name}"] = item
                    if item.name == "__init__":
                        out[node.name] = item  # calling the class runs __init__
    return out


RETURNING: set[int] = set()
"""``id`` of every call node whose callee, given the value, returns it (filled by the walk as it goes)."""


def _holds(expr: ast.AST, tainted: set[str]) -> bool:
    """Whether ``expr`` *is* the value or carries it: a tainted name or ``self.attr``, an attribute of one
    (``spec.temperature``), a literal, comprehension or constructor call (``SamplingSpec(...)``, ``dict(...)``)
    given it, or a call whose callee hands it back. A call to an ordinary function is not: it returns
    something else."""
    if isinstance(expr, ast.Name):
        return expr.id in tainted
    if isinstance(expr, ast.Attribute):
        return (isinstance(expr.value, ast.Name) and f"{expr.value.id}.{expr.attr}" in tainted) \
            or _holds(expr.value, tainted)
    if isinstance(expr, ast.Call):
        return _call_holds(expr, tainted)
    if isinstance(expr, (ast.DictComp, ast.ListComp, ast.SetComp, ast.GeneratorExp)):
        return any(_holds(g.iter, tainted) for g in expr.generators)
    parts = {ast.Dict: lambda e: [v for v in e.values if v is not None], ast.Tuple: lambda e: e.elts,
             ast.List: lambda e: e.elts, ast.Starred: lambda e: [e.value], ast.IfExp: lambda e: [e.body, e.orelse],
             ast.BoolOp: lambda e: e.values}
    get = parts.get(type(expr))
    return get is not None and any(_holds(e, tainted) for e in get(expr))


def _call_holds(call: ast.Call, tainted: set[str]) -> bool:
    if id(call) in RETURNING:  # spec = resolve(temperature, ...): the callee hands the value back
        return True
    if isinstance(call.func, ast.Attribute) and call.func.attr in CONTAINER_METHODS:  # given.items(), d.copy()
        return _holds(call.func.value, tainted)
    name = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")
    if name == "dict" or name[:1].isupper():
        return any(_holds(a, tainted) for a in call.args) or any(_holds(k.value, tainted) for k in call.keywords)
    return False


CONTAINER_METHODS = {"get", "items", "keys", "values", "append", "extend", "pop", "update", "setdefault", "copy",
                     "index", "count", "insert", "remove", "clear", "add", "format", "join", "split", "replace"}


def _names(target: ast.AST) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
        return [f"{target.value.id}.{target.attr}"]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for e in target.elts for n in _names(e)]
    if isinstance(target, ast.Subscript):
        return _names(target.value)
    return []


def taint(fn: ast.FunctionDef, params: set[str]) -> set[str]:
    """The names that hold the value inside ``fn`` (to a fixpoint over its assignments and loops)."""
    tainted = set(params)
    while True:
        before = len(tainted)
        for node in ast.walk(fn):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple) \
                            and len(t.elts) == len(node.value.elts):  # a, b = x, y: element by element
                        tainted.update(n for te, ve in zip(t.elts, node.value.elts) if _holds(ve, tainted)
                                       for n in _names(te))
                    elif _holds(node.value, tainted):
                        tainted.update(_names(t))
        if len(tainted) == before:
            return tainted


class Walker:
    def __init__(self, mods: dict[str, Module], value: str) -> None:
        self.mods, self.value = mods, value
        self.by_method: dict[str, list[tuple[Module, str]]] = {}
        for mod in mods.values():
            for key in mod.functions:
                self.by_method.setdefault(key.rsplit(".", 1)[-1], []).append((mod, key))
        self.visits: list[tuple[str, str]] = []  # (file, function)
        self.stack: list[tuple[str, str]] = []  # the calls being walked (a recursive call is not followed again)

    def resolve(self, mod: Module, cls: str | None, func: ast.expr) -> list[tuple[Module, str]]:
        """The functions a call may run: by name, import, ``self.m``, or every method ``m`` of the package."""
        if isinstance(func, ast.Name):
            if func.id in mod.functions:
                return [(mod, func.id)]
            hit = self._dotted(mod.imports.get(func.id))
            return [hit] if hit else []
        if isinstance(func, ast.Attribute):
            base = func.value
            if isinstance(base, ast.Name) and base.id == "self" and cls and f"{cls}.{func.attr}" in mod.functions:
                return [(mod, f"{cls}.{func.attr}")]
            if isinstance(base, ast.Name) and base.id in mod.imports:
                hit = self._dotted(f"{mod.imports[base.id]}.{func.attr}")
                if hit:
                    return [hit]
            if func.attr not in CONTAINER_METHODS:  # obj.m(...): any method of that name (a runner's decode, ...)
                return [c for c in self.by_method.get(func.attr, []) if "." in c[1]]
        return []

    def _dotted(self, dotted: str | None) -> tuple[Module, str] | None:
        if not dotted:
            return None
        for cut in range(dotted.count("."), 0, -1):
            modname, _, rest = dotted.rpartition(".") if cut == 1 else (".".join(dotted.split(".")[:-cut]), "",
                                                                         ".".join(dotted.split(".")[-cut:]))
            mod = self.mods.get(modname)
            if mod is not None and rest in mod.functions:
                return mod, rest
        return None

    def walk(self, mod: Module, key: str, params: set[str]) -> bool:
        """Walk ``key`` given the value in ``params``; whether it returns the value (or a holder of it)."""
        fn = mod.functions[key]
        if (mod.name, key) in self.stack:
            return False
        self.stack.append((mod.name, key))
        self.visits.append((str(mod.path), key))
        cls = key.split(".")[0] if "." in key else (key if f"{key}.__init__" in mod.functions else None)
        calls = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
        tainted, done = taint(fn, params), set()
        for call in calls:  # in source order; a call that hands the value back taints what it is assigned to
            for target in self.resolve(mod, cls, call.func):
                passed = self._passed(target, call, tainted)
                if passed and (id(call), target[1]) not in done:
                    done.add((id(call), target[1]))
                    if self.walk(*target, passed) and id(call) not in RETURNING:
                        RETURNING.add(id(call))
                        tainted = taint(fn, params)
        stored = {t for t in tainted if t.startswith("self.")} - params
        if cls and stored:  # the value was stored on the object: the methods that read it pass it on
            for other in (k for k in mod.functions if k.startswith(cls + ".") and k not in (key, f"{cls}.__init__")):
                if any(_holds(n, stored) for n in ast.walk(mod.functions[other]) if isinstance(n, ast.Attribute)):
                    self.walk(mod, other, stored)
        self.stack.pop()
        return any(isinstance(n, ast.Return) and n.value is not None and _holds(n.value, tainted) for n in ast.walk(fn))

    def _passed(self, target: tuple[Module, str], call: ast.Call, tainted: set[str]) -> set[str]:
        fn = target[0].functions[target[1]]
        names = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        if names and names[0] in ("self", "cls"):
            names = names[1:]
        kwonly = {a.arg for a in fn.args.kwonlyargs}
        out = set()
        for i, arg in enumerate(call.args):
            if _holds(arg, tainted) and i < len(names):
                out.add(names[i])
        for kw in call.keywords:
            if kw.value is None or not _holds(kw.value, tainted):
                continue
            if kw.arg is None:  # **spread of a dict that holds the value
                if self.value in names or self.value in kwonly:
                    out.add(self.value)
            elif kw.arg in names or kw.arg in kwonly or fn.args.kwarg:
                out.add(kw.arg)
        return out


def defaults(mods: dict[str, Module], name: str) -> list[str]:
    """Every place that gives ``name`` a literal default: a function parameter, a dataclass field, a
    ``.get(name, ...)`` fallback or an ``x or N`` fallback next to the name."""
    out = []
    for mod in mods.values():
        for node in ast.walk(mod.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args
                pos = list(zip(args[len(args) - len(node.args.defaults):], node.args.defaults))
                pairs = pos + [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
                out += [f"{mod.name}:{node.lineno} parameter" for a, d in pairs
                        if a.arg == name and isinstance(d, ast.Constant) and d.value is not None]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name \
                    and isinstance(node.value, ast.Constant) and node.value.value is not None:
                out.append(f"{mod.name}:{node.lineno} field")
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "get" and len(node.args) == 2 \
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value == name \
                    and isinstance(node.args[1], ast.Constant):
                out.append(f"{mod.name}:{node.lineno} .get fallback")
            elif isinstance(node, ast.Dict):
                out += [f"{mod.name}:{node.lineno} dict default" for k, v in zip(node.keys, node.values)
                        if isinstance(k, ast.Constant) and k.value == name and isinstance(v, ast.Constant)
                        and isinstance(v.value, (int, float)) and not isinstance(v.value, bool)]
    return sorted(out)


def measure(root: Path, entry: str, param: str) -> dict:
    mods = load_modules(root)
    RETURNING.clear()  # ids of another tree's nodes mean nothing here
    modname, key = entry.split(":")
    walker = Walker(mods, param)
    walker.walk(mods[modname], key, {param})
    stays, files_left = [], set()
    for path, fn in walker.visits:
        rel = str(Path(path).relative_to(root))
        if stays and stays[-1]["file"] == rel:
            stays[-1]["functions"].append(fn)
            continue
        if stays:
            files_left.add(stays[-1]["file"])
        stays.append({"file": rel, "functions": [fn], "return": rel in files_left})
    return {"entry": entry, "param": param, "visits": len(walker.visits), "stays": len(stays),
            "files": len({s["file"] for s in stays}), "returns": sum(s["return"] for s in stays), "path": stays}


WALKS = (("probes.decoder:SemanticSpecDecoder.generate", "temperature"),)
"""Issue 19's walk: ``temperature`` from the decoder's public entry point."""
DEFAULTS = ("temperature", "top_p", "max_step_tokens", "delimiters")
"""Fields whose literal defaults are counted across the package (the goal: one each)."""


def main(argv: list[str] | None = None) -> dict:
    """Walk each entry's value, count the literal defaults, print both as markdown; returns the figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                    help="checkout to measure (e.g. an older commit checked out with `git worktree add`)")
    ap.add_argument("--entry", action="append", help="module:Class.method=param (repeatable); default: the decoder's")
    ap.add_argument("--out", type=Path, default=None, help="also write the figures (with each walk's path) as JSON")
    args = ap.parse_args(argv)
    walks = [tuple(e.split("=")) for e in args.entry] if args.entry else WALKS
    out: dict = {"walks": {}, "literal_defaults": {}}
    rows = ["| value | entry | visits | stays | files | returns |", "|---|---|---|---|---|---|"]
    for entry, param in walks:
        try:
            r = measure(args.root, entry, param)
        except KeyError as e:
            r = {"entry": entry, "param": param, "error": f"entry point not found: {e}"}
        out["walks"][param] = r
        rows.append(f"| {param} | {entry} | {r.get('visits', '-')} | {r.get('stays', '-')} | {r.get('files', '-')} | "
                    f"{r.get('returns', '-')} |")
        for st in r.get("path", []):
            print(f"  {param}: {'return to ' if st['return'] else ''}{st['file']}: {', '.join(st['functions'])}")
    mods = load_modules(args.root)
    rows += ["", "| field | literal defaults | where |", "|---|---|---|"]
    for name in DEFAULTS:
        found = out["literal_defaults"][name] = defaults(mods, name)
        rows.append(f"| {name} | {len(found)} | {', '.join(found)} |")
    print("\n".join(rows))
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
