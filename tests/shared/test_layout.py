"""The house rules that code review alone would let slip: no import circles in `services/` or
`shared/`, and the sampler's rooms (services/sampler/*/) import one way only, top to bottom.
Every import counts, at module level, inside a function or under TYPE_CHECKING: a circle hidden
in a function is still a circle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules() -> dict[str, Path]:
    found = {}
    for package in ("services", "shared"):
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (a `from package import module` names the module)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    child = f"{node.module}.{alias.name}"
                    targets.add(child if child in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circles() -> None:
    modules = _modules()
    # Packages import their children's names through __init__ only where they re-export; a
    # package and its own submodule are not a circle worth naming.
    graph = {name: {t for t in targets if not t.startswith(name + ".") and not name.startswith(t + ".")}
             for name, targets in _imports(modules).items()}
    assert _circles(graph) == []


def test_the_check_sees_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The sampler's rooms, top to bottom (each subpackage's __init__ says what it may import).
# app.py and entrypoint.py wire them together above all of them; config.py, the settings, is
# the floor every room may stand on.
ROOMS = ("api", "observability", "building", "rollouts", "fleet", "storage")


def _room(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["services", "sampler"] or len(parts) < 3:
        return None
    if parts[2] in ROOMS:
        return ROOMS.index(parts[2])
    return {"app": -1, "entrypoint": -1, "config": len(ROOMS)}.get(parts[2])


def test_the_sampler_rooms_import_downwards_only() -> None:
    upward = []
    for name, targets in _imports(_modules()).items():
        here = _room(name)
        if here is None:
            continue
        upward += [f"{name} -> {t}" for t in targets if (there := _room(t)) is not None and there < here]
    assert upward == [], "a room imports one above it:\n" + "\n".join(sorted(upward))


def test_every_sampler_module_lives_in_a_room() -> None:
    loose = [name for name in _modules() if name.startswith("services.sampler.") and _room(name) is None]
    assert loose == [], f"modules outside the rooms (services/sampler/{{{','.join(ROOMS)}}}/): {loose}"


def test_modules_and_functions_stay_short() -> None:
    """A room is split before it grows past 500 lines, a function before it passes 90."""
    long_modules, long_functions = [], []
    for name, path in _modules().items():
        text = path.read_text()
        if text.count("\n") > 500:
            long_modules.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 90:
                long_functions.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long_modules == [] and long_functions == [], long_modules + long_functions

