"""Build logparse's generated catalogue from vLLM's own source, one release at a time.

Run by hand (it reads vLLM sources, which kvscope does not ship)::

    pip download vllm==0.32.0 --no-deps --only-binary :all: -d wheels/   # one wheel per release
    python -m logparse.catalogue.generate wheels/*.whl [extracted-source-dirs...]

Each argument is a release: a vLLM wheel (its ``vllm/**/*.py`` are read from the zip)
or a folder holding ``vllm/``; the release is read from the wheel's name or the
folder's name (``.../0.32.0/vllm``). Every logger call (``logger.info``/``warning``/
``debug``/``error``/``exception``/``critical``, their ``*_once`` forms, and the older
``print_warning_once``) is read with :mod:`ast`; its message, whether a ``%`` format
string with arguments, an f-string, a ``+`` concatenation, a ``.format`` call or a
local variable assigned one of those, becomes a template of literal parts and
placeholders (the conversion and the argument's source text). Identical templates of
one level are one entry listing the releases and files they appear in. The output,
``logparse/catalogue/vllm_templates.json.gz``, is read by :mod:`logparse.catalogue`,
which turns each template into a regular expression when first needed.

Plugins print into vLLM's log too (tpu-inference on TPUs, vllm-ascend on NPUs, vllm-omni's
stages, vllm-gaudi). Their logger calls are added to the existing catalogue, one release
of each, without the vLLM wheels again::

    git -C tpu-inference archive v0.27.0 tpu_inference | tar -x -C src/tpu-inference-0.27.0
    python -m logparse.catalogue.generate --plugin tpu-inference=src/tpu-inference-0.27.0

Each becomes a release named ``tpu-inference 0.27.0`` under ``plugins``; a template it
prints lists that release's index under ``g`` (a template vLLM prints too keeps its
vLLM releases under ``r``).
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import re
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

from logparse.catalogue import CATALOGUE_PATH, Part, is_matchable

LEVELS = {"debug": "DEBUG", "info": "INFO", "warning": "WARNING", "warn": "WARNING", "error": "ERROR",
          "exception": "ERROR", "critical": "CRITICAL", "fatal": "CRITICAL"}
LOGGER_NAMES = {"logger", "_logger", "LOGGER", "log"}
ONCE_HELPERS = {"print_warning_once": "WARNING", "print_info_once": "INFO", "log_once": "INFO"}
# %-conversions: flags, width, precision, length, type
_PERCENT = re.compile(r"%(?:\((?P<key>[^)]*)\))?[#0\- +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[hlL]?(?P<type>[diouxXeEfFgGcrsa%])")
_FORMAT_FIELD = re.compile(r"\{([^{}]*)\}")
_RELEASE = re.compile(r"(\d+\.\d+(?:\.\d+)?(?:\.post\d+)?)")


def level_of(call: ast.Call) -> str | None:
    """The log level of a logger call, or None when ``call`` is not one."""
    func = call.func
    if isinstance(func, ast.Name):
        return ONCE_HELPERS.get(func.id)
    if not isinstance(func, ast.Attribute):
        return None
    owner = func.value
    name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else None
    if name not in LOGGER_NAMES:
        return None
    method = func.attr.removesuffix("_once")
    return LEVELS.get(method)


def percent_parts(fmt: str, args: list[ast.expr]) -> list[Part]:
    """``"took %.2f s (%s)"`` with its arguments as parts."""
    parts: list[Part] = []
    pos, index = 0, 0
    for m in _PERCENT.finditer(fmt):
        parts.append(fmt[pos:m.start()])
        pos = m.end()
        kind = m.group("type")
        if kind == "%":
            parts.append("%")
            continue
        if m.group("key") is not None:
            parts.append([kind, m.group("key")])
            continue
        arg = ast.unparse(args[index]) if index < len(args) else "?"
        index += 1
        parts.append([kind, arg])
    parts.append(fmt[pos:])
    return parts


def format_parts(fmt: str, args: list[ast.expr], keywords: dict[str, ast.expr]) -> list[Part]:
    """``"{} took {:.2f}".format(a, b)`` as parts."""
    parts: list[Part] = []
    pos, index = 0, 0
    text = fmt.replace("{{", "\x00").replace("}}", "\x01")
    for m in _FORMAT_FIELD.finditer(text):
        parts.append(text[pos:m.start()])
        pos = m.end()
        field, _, spec = m.group(1).partition(":")
        field = field.split("!")[0]
        if field == "":
            arg = ast.unparse(args[index]) if index < len(args) else "?"
            index += 1
        elif field.isdigit():
            arg = ast.unparse(args[int(field)]) if int(field) < len(args) else "?"
        else:
            arg = ast.unparse(keywords[field]) if field in keywords else field
        parts.append([_spec_kind(spec), arg])
    parts.append(text[pos:])
    return [p.replace("\x00", "{").replace("\x01", "}") if isinstance(p, str) else p for p in parts]


def _spec_kind(spec: str) -> str:
    """The placeholder kind a format spec implies: ``.2f`` -> f, ``d``/``,`` -> d, else s."""
    if spec and spec[-1] in "deEfFgGx%":
        return "d" if spec[-1] == "d" else "x" if spec[-1] == "x" else "f"
    if spec.endswith(",") or spec.endswith("_"):
        return "d"
    return "s"


def expr_parts(node: ast.expr, local: dict[str, ast.expr], depth: int = 0) -> list[Part] | None:
    """A message expression as parts, or None when it has no literal text to match."""
    if depth > 8:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        parts: list[Part] = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif isinstance(value, ast.FormattedValue):
                spec = ""
                if isinstance(value.format_spec, ast.JoinedStr):
                    spec = "".join(str(v.value) for v in value.format_spec.values if isinstance(v, ast.Constant))
                kind = "r" if value.conversion == ord("r") else _spec_kind(spec)
                parts.append([kind, ast.unparse(value.value)])
        return parts
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left = expr_parts(node.left, local, depth + 1)
        right = expr_parts(node.right, local, depth + 1)
        return [*(left or [["s", ast.unparse(node.left)]]), *(right or [["s", ast.unparse(node.right)]])]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant) \
            and isinstance(node.left.value, str):
        args = list(node.right.elts) if isinstance(node.right, ast.Tuple) else [node.right]
        return percent_parts(node.left.value, args)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format" \
            and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str):
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        return format_parts(node.func.value.value, list(node.args), keywords)
    if isinstance(node, ast.Name) and node.id in local:
        return expr_parts(local[node.id], {k: v for k, v in local.items() if k != node.id}, depth + 1)
    return None


_MESSAGE_NODES = (ast.Constant, ast.JoinedStr, ast.BinOp, ast.Call)


def _assigned(node: ast.AST) -> tuple[str, ast.expr] | None:
    """(name, value) of ``name = <message>`` or ``name: str = <message>``."""
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        target, value = node.targets[0].id, node.value
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
        target, value = node.target.id, node.value
    else:
        return None
    return (target, value) if isinstance(value, _MESSAGE_NODES) else None


def _local_strings(function: ast.AST, module: dict[str, list[ast.expr]] | None = None) -> dict[str, list[ast.expr]]:
    """The messages a name can hold where ``logger.info(name)`` is called: each assignment in the
    function (``msg = (...)`` in two branches is two messages; ``msg += ...`` appends to the first),
    the parameter's default (``message: str = "%storch.compile took %.2f s"``), else the module's
    constant of that name."""
    out: dict[str, list[ast.expr]] = {name: list(values) for name, values in (module or {}).items()}
    own: set[str] = set()
    if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
        params = function.args.posonlyargs + function.args.args
        defaults = list(zip(params[len(params) - len(function.args.defaults):], function.args.defaults, strict=True))
        defaults += [(a, d) for a, d in zip(function.args.kwonlyargs, function.args.kw_defaults, strict=True) if d]
        for arg, default in defaults:
            if isinstance(default, _MESSAGE_NODES):
                out[arg.arg], own = [default], own | {arg.arg}
    for node in ast.walk(function):
        found = _assigned(node)
        if found is not None:
            name, value = found
            if name not in own:
                out[name], own = [], own | {name}
            out[name].append(value)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and isinstance(node.op, ast.Add) \
                and node.target.id in own:
            out[node.target.id][0] = ast.BinOp(out[node.target.id][0], ast.Add(), node.value)
    return out


def _module_strings(tree: ast.Module) -> dict[str, list[ast.expr]]:
    """Module-level message constants (``_WARNING = ("No available shared memory ...")``)."""
    out: dict[str, list[ast.expr]] = {}
    for node in tree.body:
        found = _assigned(node)
        if found is not None:
            out.setdefault(found[0], []).append(found[1])
    return out


def merge_literals(parts: list[Part]) -> list[Part]:
    merged: list[Part] = []
    for part in parts:
        if isinstance(part, str):
            if not part:
                continue
            if merged and isinstance(merged[-1], str):
                merged[-1] += part
                continue
        merged.append(part)
    return merged


class _CallFinder(ast.NodeVisitor):
    """One pass over a module: each logger call with the function it sits in."""

    def __init__(self) -> None:
        self.functions: list[ast.AST | None] = [None]
        self.found: list[tuple[str, ast.Call, ast.AST | None]] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node)
        self.generic_visit(node)
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node: ast.Call) -> None:
        level = level_of(node) if node.args else None
        if level is not None:
            self.found.append((level, node, self.functions[-1]))
        self.generic_visit(node)


def calls_in(source: str) -> list[tuple[str, list[Part]]]:
    """(level, parts) of every logger call in one module's source."""
    if "log" not in source and "print_warning_once" not in source:
        return []
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    finder = _CallFinder()
    finder.visit(tree)
    module = _module_strings(tree)
    locals_of: dict[int, dict[str, list[ast.expr]]] = {}
    out: list[tuple[str, list[Part]]] = []
    for level, node, function in finder.found:
        first, rest = node.args[0], list(node.args[1:])
        if isinstance(first, ast.Constant) and isinstance(first.value, str) and rest:
            out.append((level, merge_literals(percent_parts(first.value, rest))))
            continue
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            out.append((level, merge_literals([first.value.replace("%%", "%")])))
            continue
        strings = module
        if function is not None and isinstance(first, ast.Name):
            if id(function) not in locals_of:
                locals_of[id(function)] = _local_strings(function, module)
            strings = locals_of[id(function)]
        # a name holding one of several messages is a template per message
        choices = strings.get(first.id, [first]) if isinstance(first, ast.Name) else [first]
        for choice in choices:
            local = {name: values[0] for name, values in strings.items() if values}
            if isinstance(first, ast.Name):
                local[first.id] = choice
            parts = expr_parts(first, local)
            if parts is not None and rest:  # a computed format string with % arguments
                parts = [q for p in parts for q in (percent_parts(p, rest) if isinstance(p, str) else [p])]
            out.append((level, merge_literals(parts) if parts is not None else []))  # []: a message we cannot read
    return out


# a plugin's distribution name -> the package its logger calls live in
PLUGIN_PACKAGES = {"tpu-inference": "tpu_inference", "vllm-ascend": "vllm_ascend", "vllm-omni": "vllm_omni",
                   "vllm-gaudi": "vllm_gaudi"}


def package_sources(root: Path, package: str) -> Iterator[tuple[str, str]]:
    """(module path, source) of every module of ``package`` under ``root`` (or ``root`` itself)."""
    base = root if (root / package).is_dir() else root.parent
    for file in sorted((base / package).rglob("*.py")):
        yield file.relative_to(base).as_posix(), file.read_text(encoding="utf-8", errors="replace")


def release_sources(path: Path) -> tuple[str, Iterator[tuple[str, str]]]:
    """A release's name and its (module path, source) pairs, from a wheel or a folder."""
    m = _RELEASE.search(path.name if path.suffix == ".whl" else str(path))
    if m is None:
        raise SystemExit(f"{path}: no release number in its name; name the folder after the release (0.32.0/vllm)")
    release = m.group(1)

    def from_wheel() -> Iterator[tuple[str, str]]:
        with zipfile.ZipFile(path) as wheel:
            for name in sorted(wheel.namelist()):
                if name.startswith("vllm/") and name.endswith(".py"):
                    yield name, wheel.read(name).decode("utf-8", errors="replace")

    return release, from_wheel() if path.suffix == ".whl" else package_sources(path, "vllm")


def _release_key(release: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", release))


def generate(paths: list[Path]) -> dict:
    entries: dict[tuple[str, str], dict] = {}
    releases: list[str] = []
    by_content: dict[int, list[tuple[str, list[Part]]]] = {}  # most modules are unchanged from one release to the next
    skipped = 0
    for path in sorted(paths, key=lambda p: _release_key(release_sources(p)[0])):
        release, sources = release_sources(path)
        releases.append(release)
        index = len(releases) - 1
        count = 0
        for module, source in sources:
            key_of_source = hash(source)
            if key_of_source not in by_content:
                by_content[key_of_source] = calls_in(source)
            for level, parts in by_content[key_of_source]:
                if not is_matchable(parts):
                    skipped += 1
                    continue
                key = (level, json.dumps(parts))
                entry = entries.setdefault(key, {"level": level, "parts": parts, "files": [], "releases": []})
                if module not in entry["files"]:
                    entry["files"].append(module)
                if not entry["releases"] or entry["releases"][-1] != index:
                    entry["releases"].append(index)
                count += 1
        print(f"{release}: {count} logger calls", file=sys.stderr)
    templates = sorted(entries.values(), key=lambda e: (e["files"][0], json.dumps(e["parts"])))
    return {"releases": releases, "unmatchable_calls_skipped": skipped,
            "templates": [{"l": e["level"][0], "p": e["parts"], "f": e["files"], "r": _ranges(e["releases"])}
                          for e in templates]}


def _ranges(indices: list[int]) -> list[list[int]]:
    """[0, 1, 2, 5] -> [[0, 2], [5, 5]]: the releases as runs of release indices."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return runs


def add_plugin(data: dict, name: str, path: Path) -> int:
    """Add one plugin release's logger calls (``path`` holds its package, named for the release:
    ``.../tpu-inference-0.27.0``) to a generated catalogue; returns the calls read. Added twice,
    a release is listed once (its calls are merged)."""
    package = PLUGIN_PACKAGES.get(name, name.replace("-", "_"))
    m = _RELEASE.search(path.name)
    label = f"{name} {m.group(1)}" if m else name
    plugins: list[str] = data.setdefault("plugins", [])
    if label not in plugins:
        plugins.append(label)
    index = plugins.index(label)
    rows = {(row["l"], json.dumps(row["p"])): row for row in data["templates"]}
    count = 0
    for module, source in package_sources(path, package):
        for level, parts in calls_in(source):
            if not is_matchable(parts):
                data["unmatchable_calls_skipped"] = data.get("unmatchable_calls_skipped", 0) + 1
                continue
            key = (level[0], json.dumps(parts))
            row = rows.get(key)
            if row is None:
                row = rows[key] = {"l": level[0], "p": parts, "f": [], "r": []}
                data["templates"].append(row)
            if module not in row["f"]:
                row["f"].append(module)
            if index not in row.setdefault("g", []):
                row["g"].append(index)
            count += 1
    data["templates"].sort(key=lambda row: (row["f"][0], json.dumps(row["p"])))
    return count


def _read(path: Path) -> dict:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return dict(json.load(fh))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("releases", nargs="*", type=Path, help="vLLM wheels or folders holding vllm/, one per release")
    parser.add_argument("--plugin", action="append", default=[], metavar="NAME=FOLDER",
                        help="add a plugin release's logger calls to the catalogue (NAME: "
                             f"{', '.join(PLUGIN_PACKAGES)}; FOLDER holds its package, named for the release)")
    parser.add_argument("--out", type=Path, default=CATALOGUE_PATH)
    args = parser.parse_args(argv)
    if not args.releases and not args.plugin:
        parser.error("name vLLM releases, or --plugin NAME=FOLDER to add a plugin's calls to the catalogue")
    data = generate(args.releases) if args.releases else _read(args.out)
    for spec in args.plugin:
        name, sep, folder = spec.partition("=")
        if not sep or not folder:
            parser.error(f"--plugin {spec!r}: write NAME=FOLDER, e.g. tpu-inference=src/tpu-inference-0.27.0")
        print(f"{name} ({folder}): {add_plugin(data, name, Path(folder))} logger calls", file=sys.stderr)
    raw = json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
    with gzip.GzipFile(args.out, "wb", compresslevel=9, mtime=0) as fh:  # mtime 0: the same input, the same bytes
        fh.write(raw)
    print(f"{len(data['templates'])} templates from {len(data['releases'])} releases and "
          f"{len(data.get('plugins', []))} plugin releases "
          f"({data['unmatchable_calls_skipped']} calls with too little literal text skipped) -> {args.out}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
