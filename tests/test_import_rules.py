"""The package layering, checked on the source's AST (nothing is imported, so
this runs in well under a second):

* engine/ never imports monitor/ or logparse/: the engine publishes events, and
  ``--monitor`` finds the dashboard through the ``kvscope.dashboard`` entry point
  (engine/cli/dashboard.py), not by importing it.
* monitor/ imports from engine/ only the event layer: the events, the view
  folded from them (which carries the budget ledger) and the error type.
* doctor/ (rules over events) is reached by the engine only through the
  ``kvscope.doctor`` entry point; the part of it the monitor's Diagnosis panel
  imports (the fold, the rules, the budget replan) reads from engine/ only the
  event layer, the budget formula and the error type, and loads no torch/numpy.
* The pure scheduler modules import no torch/numpy, no clock and no I/O, and
  load no torch through the engine modules they import; neither do the engine
  modules the monitor may import.

Every ``import`` / ``from`` statement counts, including ones inside functions,
as does ``importlib.import_module("...")`` / ``__import__("...")`` with a
literal name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.paths import ROOT

# What monitor/ may import from engine/, measured: the event wing (engine.events: the
# records and the bus; engine.events.folds.view: EngineView, the reducer the widgets render,
# the budget ledger arriving in it through startup.phase events; engine.events.folds.block_table,
# the fold the view uses), engine.errors (UserError for the CLI) and engine.cli.program
# (the command-line style all three commands share). The rule: the
# monitor reads events, the view and the budget, never core/model internals. Not
# engine.modelspec / engine.budget.memory: modelspec reads model files (GGUF headers), and
# the budget reaches the monitor as event data, not by recomputing it.
MONITOR_MAY_IMPORT_FROM_ENGINE = (
    "engine.events",
    "engine.events.folds.view",
    "engine.errors",
    "engine.events.folds.block_table",
    "engine.cli.program",  # the one command-line style and exit convention shared by all three commands
    "engine.events.feed",  # the live feeds: the in-process bus and a server's GET /events stream
)

# doctor/'s modules the monitor may import (the Diagnosis panel runs the same rules live),
# and what they may import from engine/: the event layer, the budget formula (pure
# arithmetic over the phase records) and the error type. The simulator's what-if
# (doctor.remedies), the inputs and the CLI are engine doctor's alone.
MONITOR_MAY_IMPORT_FROM_DOCTOR = ("doctor.facts", "doctor.rules", "doctor.budget")
DOCTOR_RULES_MAY_IMPORT_FROM_ENGINE = (*MONITOR_MAY_IMPORT_FROM_ENGINE, "engine.budget.memory", "engine.budget.fixes",
                                      "engine.modelspec.config",
                                      "engine.budget.stages")  # the per-stage budget (engine plan -pp), issue 37

# The core wing: deterministic functions of their inputs (time enters as ``now`` or a
# clock argument), so the property tests and the simulator can drive them.
PURE_SCHEDULER_MODULES = tuple(sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "engine" / "core").glob("*.py")))
HEAVY_MODULES = ("torch", "numpy", "triton", "safetensors", "gguf", "tokenizers", "transformers")
CLOCK_MODULES = ("time", "datetime")
IO_MODULES = ("io", "os", "sys", "pathlib", "json", "logging", "structlog", "socket", "select",
              "asyncio", "subprocess", "shutil", "tempfile", "httpx", "urllib")
PURE_FORBIDDEN = HEAVY_MODULES + CLOCK_MODULES + IO_MODULES


def python_files(package: str) -> list[Path]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no Python files under {package}/"
    return files


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str]]:
    return list(imports_in_source(path.read_text(encoding="utf-8"), path))


def imports_in_source(source: str, path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) for every import in ``source`` (the text of
    ``path``); ``from x import y`` yields ``x.y`` too (y may be a submodule) and
    relative imports are resolved against ``path``'s package."""
    tree = ast.parse(source, filename=str(path))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            yield node.lineno, base
            for alias in node.names:
                if alias.name != "*":
                    yield node.lineno, f"{base}.{alias.name}"
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in ("import_module", "__import__"):
                yield node.lineno, node.args[0].value


def top(module: str) -> str:
    return module.split(".")[0]


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def listing(hits: dict[str, str]) -> str:
    """One line per import statement (``from x import y`` matches as x and x.y)."""
    return "\n  " + "\n  ".join(f"{loc} {what}" for loc, what in sorted(hits.items()))


def test_engine_never_imports_monitor_or_logparse() -> None:
    bad: dict[str, str] = {}
    for p in python_files("engine"):
        for line, mod in imports(p):
            if top(mod) in ("monitor", "logparse", "doctor"):
                bad.setdefault(where(p, line), f"imports {mod}")
    assert not bad, ("engine/ must not import monitor/, logparse/ or doctor/ (events are the interface; --monitor "
                     "and engine doctor go through entry points, engine/cli/plugins.py):" + listing(bad))


def _engine_module_of(mod: str) -> str | None:
    """The allowed-list entry ``mod`` falls under, or None."""
    for allowed in MONITOR_MAY_IMPORT_FROM_ENGINE:
        if mod == allowed or mod.startswith(allowed + "."):
            return allowed
    return None


def test_monitor_imports_only_the_event_layer_from_engine() -> None:
    bad: dict[str, str] = {}
    for p in python_files("monitor"):
        for line, mod in imports(p):
            if top(mod) != "engine" or mod == "engine":
                continue
            # ``from engine.events import Event`` also yields engine.events.Event: under an allowed module.
            if _engine_module_of(mod) is None:
                bad.setdefault(where(p, line), f"imports {mod}")
    assert not bad, ("monitor/ may import from engine/ only " + ", ".join(MONITOR_MAY_IMPORT_FROM_ENGINE)
                     + " (it reads events, the view and the budget, never scheduler/runner internals):"
                     + listing(bad))


def _under(mod: str, allowed: tuple[str, ...]) -> bool:
    return any(mod == a or mod.startswith(a + ".") for a in allowed)


def test_monitor_imports_only_the_rules_from_doctor() -> None:
    bad: dict[str, str] = {}
    for p in python_files("monitor"):
        for line, mod in imports(p):
            if top(mod) == "doctor" and mod != "doctor" and not _under(mod, MONITOR_MAY_IMPORT_FROM_DOCTOR):
                bad.setdefault(where(p, line), f"imports {mod}")
    assert not bad, ("monitor/ may import from doctor/ only " + ", ".join(MONITOR_MAY_IMPORT_FROM_DOCTOR)
                     + " (the simulator's what-if and the inputs are engine doctor's):" + listing(bad))


def test_doctor_rules_read_events_and_the_budget_only() -> None:
    """What the Diagnosis panel imports stays as light as the monitor: no scheduler,
    simulator, logparse or monitor, and no torch/numpy through its engine imports."""
    bad: dict[str, str] = {}
    start = []
    for mod in MONITOR_MAY_IMPORT_FROM_DOCTOR:
        module = ROOT / Path(*mod.split(".")).with_suffix(".py")
        # a module, or a package (doctor.rules) with every module in it
        start += [(p, mod) for p in ([module] if module.is_file() else python_files(mod.replace(".", "/")))]
    for p, _ in start:
        for line, imported in imports(p):
            package = top(imported)
            allowed = {"engine": DOCTOR_RULES_MAY_IMPORT_FROM_ENGINE, "doctor": MONITOR_MAY_IMPORT_FROM_DOCTOR}
            forbidden = package in ("monitor", "logparse", *HEAVY_MODULES) or (
                package in allowed and imported != package and not _under(imported, allowed[package]))
            if forbidden:
                bad.setdefault(where(p, line), f"imports {imported}")
    bad.update(heavy_imports_reachable(start))
    assert not bad, ("doctor's rules may import from engine/ only " + ", ".join(DOCTOR_RULES_MAY_IMPORT_FROM_ENGINE)
                     + ", nothing heavy:" + listing(bad))


def test_pure_scheduler_modules_import_no_torch_clock_or_io() -> None:
    bad: dict[str, str] = {}
    for rel in PURE_SCHEDULER_MODULES:
        p = ROOT / rel
        for line, mod in imports(p):
            if top(mod) in PURE_FORBIDDEN:
                kind = ("heavy" if top(mod) in HEAVY_MODULES else "clock" if top(mod) in CLOCK_MODULES else "I/O")
                bad.setdefault(where(p, line), f"imports {mod} ({kind})")
    assert not bad, ("the scheduler core (" + ", ".join(PURE_SCHEDULER_MODULES) + ") must stay pure: no "
                     "torch/numpy, no clock (time comes in as `now`), no I/O:" + listing(bad))


def _engine_file(mod: str) -> Path | None:
    if top(mod) != "engine":
        return None
    base = ROOT / Path(*mod.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def heavy_imports_reachable(start: list[tuple[Path, str]]) -> dict[str, str]:
    """Heavy-library imports reachable from ``start`` by following engine.* imports
    (every package's __init__ included, as Python runs it), function-level ones too."""
    bad: dict[str, str] = {}
    seen: set[Path] = set()
    todo = [*start, (ROOT / "engine" / "__init__.py", "engine/__init__.py")]
    while todo:
        p, via = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        for line, mod in imports(p):
            if top(mod) in HEAVY_MODULES:
                bad.setdefault(where(p, line), f"imports {mod} (reached via {via})")
            target = _engine_file(mod)
            if target is not None and target not in seen:
                todo.append((target, f"{via} -> {mod}"))
    return bad


def test_pure_scheduler_modules_load_no_torch_transitively() -> None:
    """The scheduler core reaches no torch/numpy through the engine modules it imports."""
    bad = heavy_imports_reachable([(ROOT / rel, rel) for rel in PURE_SCHEDULER_MODULES])
    assert not bad, "the scheduler core must load no torch/numpy through its engine imports:" + listing(bad)


def test_monitor_engine_imports_load_no_torch_transitively() -> None:
    """The engine modules the monitor may import reach no torch/numpy either, so
    ``monitor replay`` works on a machine without them."""
    start = [(f, mod) for mod in MONITOR_MAY_IMPORT_FROM_ENGINE if (f := _engine_file(mod)) is not None]
    assert len(start) == len(MONITOR_MAY_IMPORT_FROM_ENGINE), "an allowed engine module no longer exists"
    bad = heavy_imports_reachable(start)
    assert not bad, "the engine modules monitor/ may import must load no torch/numpy:" + listing(bad)


def wing_of(module: str) -> str | None:
    """The wing a module belongs to: monitor, doctor, logparse, or engine's subpackage or
    top-level module (engine.events, engine.budget, engine.llm_engine, ...)."""
    parts = module.split(".")
    if parts[0] in ("monitor", "doctor", "logparse"):
        return parts[0]
    if parts[0] == "engine" and len(parts) > 1:
        return ".".join(parts[:2])
    return None


def test_no_two_wings_import_each_other() -> None:
    """Every arrow runs down: if wing A imports wing B, B imports nothing of A (so a shared
    piece lives in the wing below both, e.g. the /events feed reader in engine.events for
    the monitor and the doctor, the ledger and the roofline beside the phase records)."""
    arrows: dict[tuple[str, str], str] = {}
    for package in ("engine", "monitor", "doctor", "logparse"):
        for p in python_files(package):
            source = wing_of(module_name(p))
            for line, mod in imports(p):
                target = wing_of(mod)
                if source and target and target != source and _wing_exists(target):
                    arrows.setdefault((source, target), where(p, line))
    both_ways = {f"{a} <-> {b}": f"{arrows[(a, b)]} and {arrows[(b, a)]}"
                 for (a, b) in arrows if (b, a) in arrows and a < b}
    assert not both_ways, "two wings import each other (move the shared piece to a wing below both):" + listing(
        both_ways)


def _wing_exists(wing: str) -> bool:
    base = ROOT / Path(*wing.split("."))
    return base.is_dir() or base.with_suffix(".py").is_file()


def test_import_walker_sees_nested_relative_and_importlib_imports() -> None:
    """The rules are only as good as the walker: function-level, relative and
    importlib imports are all found (parsed from a string; nothing is written)."""
    src = (
        "import os\n"
        "def f():\n"
        "    from monitor.app import MonitorApp\n"
        "    import logparse\n"
        "    importlib.import_module('monitor.sources')\n"
        "from . import events\n"
        "from .commands import serve\n"
    )
    found = {mod for _, mod in imports_in_source(src, ROOT / "engine" / "probe.py")}
    assert {"os", "monitor.app", "logparse", "monitor.sources", "engine", "engine.events",
            "engine.commands.serve"} <= found, found
