"""The house keeps its layers: every import inside ``appliance`` points down (or sideways where
allowed), never up, and no two modules import each other in a circle.

Layers (see ``appliance/core.py``), in one sentence: the core (errors, config, core, files) is
below the model, the model below the engines, the engines below synthesis (text beside it), and
the service wings sit on synthesis in this order: messages and audio, then ops, then the request
core (service), then the transports, then the daemon's wiring, then the command line::

    errors, config, core, files  <-  model  <-  engines  <-  synth  <-  messages, audio  <-  ops
        <-  service  <-  transports  <-  daemon  <-  cli          (text beside synth; build beside service)

The test parses every module with :mod:`ast` (imports inside functions and under
``TYPE_CHECKING`` count too) and fails naming the offending file, line and edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "appliance"

#: layer -> the layers it may import (itself always allowed).
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "config": {"errors"},
    "core": {"errors"},
    "files": set(),
    "data": set(),
    "model": {"errors", "config", "core", "data"},
    "engines": {"errors", "config", "core", "model"},
    "text": {"errors", "config", "core", "data"},
    "synth": {"errors", "config", "core", "engines", "text"},
    "build": {"errors", "config", "core", "data", "model", "engines", "text", "synth"},
    "messages": {"errors", "config", "core", "text"},
    "audio": {"errors", "config", "core", "files"},
    "ops": {"errors", "config", "core", "files", "text", "synth", "messages", "audio", "model"},  # model: reverify (no torch)
    "service": {"errors", "config", "core", "files", "text", "synth", "messages", "audio", "ops"},
    "transports": {"errors", "config", "core", "files", "text", "synth", "messages", "audio", "ops", "service"},
    # build: the daemon rebuilds a bad engine at start (build sits beside service, below the daemon)
    "daemon": {"errors", "config", "core", "files", "text", "synth", "build", "messages", "audio", "ops", "service",
               "transports"},
    "cli": {"errors", "config", "core", "files", "data", "model", "engines", "text", "synth", "build",
            "messages", "audio", "ops", "service", "transports", "daemon"},
    "__main__": {"cli"},
    "__init__": set(),
}

#: The largest a module in ``appliance/`` may grow, in lines.
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _layer(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(mod: str, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every ``appliance`` import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "appliance"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "appliance":
                continue
            for a in node.names:   # "from pkg import module" names a module
                sub = f"{target}.{a.name}"
                out.append((node.lineno, sub if sub in _MODS else target))
    return out


_MODS = _modules()


def test_imports_point_down():
    bad = []
    for mod, path in sorted(_MODS.items()):
        src = _layer(mod)
        for line, target in _imports(mod, path):
            dst = _layer(target)
            if dst != src and dst not in ALLOWED[src]:
                bad.append(f"{path.relative_to(PKG.parent)}:{line}: {src} imports {dst} ({target})")
    assert not bad, "imports that point up or sideways:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph = {m: {t for _, t in _imports(m, p) if t in _MODS and t != m} for m, p in _MODS.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_every_module_has_a_layer():
    unknown = sorted({_layer(m) for m in _MODS} - set(ALLOWED))
    assert not unknown, f"modules outside the known layers: {unknown}; add them to ALLOWED"


def test_modules_stay_small():
    big = [f"{p.relative_to(PKG.parent)}: {n} lines" for p in PKG.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not big, f"modules over {MAX_LINES} lines (split them by responsibility):\n" + "\n".join(big)


#: ``appliance/engines/`` sub-packages that a box without torch loads: the shared contract, sampler
#: and selection (``engines/*.py``), llama.cpp, ONNX Runtime and TensorRT (its buffers and copies
#: through cuda-python, its sampling numpy's). Only ``engines/torch/`` (the reference and export
#: path) imports torch.
TORCH_WINGS = {"torch"}
#: The chooser opens the one backend picked at load, torch's too, inside the function that picks it.
CHOOSERS = {"appliance.engines.select"}


def _torch_modules() -> set[str]:
    """Modules of the package that import torch at their top level or in a function."""
    out = set()
    for mod, path in _MODS.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n.split(".")[0] == "torch" for n in names):
                out.add(mod)
    return out


def test_engines_without_torch_never_reach_torch():
    """Each engines module outside ``TORCH_WINGS`` imports neither torch nor, directly, a module
    that does (imports inside functions count: a lazy one still loads torch when it runs)."""
    torchy = _torch_modules()
    bad = []
    for mod, path in sorted(_MODS.items()):
        parts = mod.split(".")
        if (parts[:2] != ["appliance", "engines"] or (len(parts) > 3 and parts[2] in TORCH_WINGS)
                or mod in CHOOSERS):
            continue
        if mod in torchy:
            bad.append(f"{path.relative_to(PKG.parent)} imports torch")
        for line, target in _imports(mod, path):
            if target in torchy:
                bad.append(f"{path.relative_to(PKG.parent)}:{line}: imports {target}, which imports torch")
    assert not bad, "engines modules a torch-free box loads reach torch:\n" + "\n".join(sorted(set(bad)))
