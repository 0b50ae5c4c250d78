"""The house rules of the code, checked: no import cycle between fedadapt's modules (imports
inside functions included), no private name imported from another module, one name for a
client's id (``cid``; ``pid`` is a process id), and method families that plug in."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: Where each part of the installed ``fedadapt`` package lives in the repository.
ROOTS = {"fedadapt": REPO / "fedadapt", "fedadapt.strategies": REPO / "strategies",
         "fedadapt.clients": REPO / "clients"}


def modules() -> dict[str, Path]:
    out = {}
    for package, root in ROOTS.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[0] == "catalogue":  # fedadapt/catalogue: the dataset cards (datasets/)
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def imports(name: str, path: Path) -> list[tuple[str, str | None]]:
    """``(module, imported name or None)`` of every import in the module, at any depth."""
    out = []
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            out += [(base, a.name) for a in node.names]
    return out


def test_no_import_cycle():
    mods = modules()
    graph = {}
    for name, path in mods.items():
        deps = set()
        for base, sym in imports(name, path):
            if sym and f"{base}.{sym}" in mods:
                deps.add(f"{base}.{sym}")
            elif base in mods:
                deps.add(base)
        graph[name] = deps - {name}

    def reaches(start: str, goal: str) -> list[str] | None:
        seen, todo = set(), [[start]]
        while todo:
            path = todo.pop()
            for nxt in sorted(graph[path[-1]]):
                if nxt == goal:
                    return path + [nxt]
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(path + [nxt])
        return None

    cycles = [c for name in graph for c in [reaches(name, name)] if c]
    assert not cycles, " -> ".join(cycles[0])


def room(name: str) -> str:
    """The part of the package a module belongs to: its subpackage (``fedadapt.data.loading``:
    ``data``, ``fedadapt.strategies.registry``: ``strategies``) or top-level module
    (``fedadapt.experiment``: ``experiment``)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def two_way_pairs(room_of) -> list[str]:
    """Each pair of rooms that import each other (at any depth, imports inside functions
    included), with its edges; ``room_of(module)`` names a module's room (None: in none)."""
    mods = modules()
    edges: dict[tuple[str, str], list[str]] = {}
    for name, path in mods.items():
        for base, sym in imports(name, path):
            target = f"{base}.{sym}" if sym else base
            while target not in mods and "." in target:
                target = target.rsplit(".", 1)[0]
            if target not in mods:
                continue
            a, b = room_of(name), room_of(target)
            if a is not None and b is not None and a != b:
                edges.setdefault((a, b), []).append(f"{name} -> {target}")
    return [f"{a} <-> {b}: " + "; ".join(sorted(set(edges[(a, b)]) | set(edges[(b, a)])))
            for a, b in sorted(edges) if a < b and (b, a) in edges]


def test_no_two_rooms_import_each_other():
    """The rooms are layers: where one room imports another (at any depth, imports inside
    functions included), the other imports nothing of it."""
    pairs = two_way_pairs(room)
    assert not pairs, "\n".join(pairs)


def federation_room(name: str) -> str | None:
    """A module's room inside ``fedadapt.federation``: its subpackage (``fedadapt.federation.
    server.loop``: ``server``); None outside the federation."""
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["fedadapt", "federation"] else None


def test_no_two_federation_rooms_import_each_other():
    """Inside ``fedadapt.federation`` the rooms (wire, server, client, simulation, ...) are
    layers too: no two of them import each other."""
    rooms = {r for name in modules() if (r := federation_room(name))}
    assert len(rooms) > 1, rooms  # the federation is in rooms
    pairs = two_way_pairs(federation_room)
    assert not pairs, "\n".join(pairs)


def test_no_private_name_is_imported_from_another_module():
    found = [f"{name} imports {base}.{sym}" for name, path in modules().items()
             for base, sym in imports(name, path)
             if base.startswith("fedadapt") and sym and sym.startswith("_")
             and not sym.startswith("__") and not (base == "fedadapt" and sym == "_compat")]
    assert not found, found


def test_a_client_is_cid_everywhere():
    """``pid`` means a process id (the run directory's lock owner), never a client."""
    word = re.compile(r"\bpids?\b")
    found = [f"{path.relative_to(REPO)}:{i}" for path in modules().values()
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if word.search(line) and "getpid" not in line and "process" not in line
             and path.name != "rundir.py"]
    assert not found, found


def test_the_core_never_names_a_family():
    """experiment.py, cli.py and the ClientApp dispatch on the method's family object, never on
    a family's name (or the names of the methods it trains)."""
    names = re.compile(r"\.(family|trainer)\b|[\"'](plugin|sessions)[\"']|hasattr\(\w+, \"exit")
    for path in (REPO / "fedadapt" / "experiment.py", REPO / "fedadapt" / "cli.py",
                 REPO / "clients" / "app.py"):
        hits = [line for line in path.read_text().splitlines() if names.search(line)]
        assert not hits, (path.name, hits)


def test_no_kind_is_asked_its_name():
    """Strategies, settings, fleets and methods are asked for their capabilities, never
    compared with one of their names, outside the module that registers them (a comparison
    with ``"<name>"`` or a tuple of names)."""
    from fedadapt.adapters import load_methods
    from fedadapt.config import SETTINGS
    from fedadapt.federation.simulation.fleet.kinds import fleet_kinds
    from fedadapt.strategies.registry import STRATEGIES

    fleets = set(fleet_kinds()) - {"none"}  # "none" is every group's off switch
    names = set(STRATEGIES) | set(SETTINGS) | fleets | set(load_methods()) | {"custom"}
    registers = {"fedadapt.strategies.registry"}

    def literals(node) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return set().union(*(literals(e) for e in node.elts)) if node.elts else set()
        return set()

    found = []
    for name, path in modules().items():
        if name in registers:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                hit = set().union(*(literals(x) for x in sides)) & names
                asked = any(re.search(r"name|strategy|setting|fleet|method", ast.unparse(x))
                            for x in sides if not literals(x))
                if hit and asked:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} compares with "
                                 f"{sorted(hit)}")
    assert not found, "\n".join(found)
