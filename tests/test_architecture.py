"""The structure docs/architecture.md describes: no import cycles, layers that import downwards only."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("storage", "convert", "llm")


def module_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            files[name] = path
    return files


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Project modules `path` imports anywhere in it (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import sub` imports pkg (its __init__) and, if it is a module, pkg.sub
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(path, set(files)) - {name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_anywhere_in_the_project():
    assert find_cycle(import_graph()) is None


def test_layers_import_downwards_only():
    graph = import_graph()
    for name, imported in graph.items():
        top = name.split(".")[0]
        if top == "storage":  # the bottom layer: no project imports but its own
            assert all(m.startswith("storage") for m in imported), (name, imported)
        if top == "convert":  # conversion never needs the trainer
            assert not any(m.startswith("llm") for m in imported), (name, imported)
        if top == "llm":  # the trainer reads shards through streaming, not through convert
            assert not any(m.startswith("convert") for m in imported), (name, imported)
    library = [
        n
        for n in graph
        if not n.startswith(("llm.commands", "llm.__main__", "convert.cli", "convert.__main__"))
    ]
    for name in library:  # commands sit on top: the library never imports them
        assert not any(m.startswith("llm.commands") for m in graph[name]), name


def test_no_module_shadows_the_standard_library():
    import sys

    stdlib = set(sys.stdlib_module_names)
    shadowing = [name for name in module_files() if name.rpartition(".")[2] in stdlib]
    assert shadowing == []


# --- checkpointing knows nothing of plots, the memory plan or callbacks; the weights' reader internals


CHECKPOINT_MUST_NOT_IMPORT = ("llm.plots", "llm.memory_plan", "llm.callbacks")


def checkpoint_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, import) pairs where llm.checkpoint imports plotting, the memory plan or a callback."""
    return sorted(
        (name, m)
        for name, imported in graph.items()
        if name == "llm.checkpoint" or name.startswith("llm.checkpoint.")
        for m in imported
        if any(m == bad or m.startswith(bad + ".") for bad in CHECKPOINT_MUST_NOT_IMPORT)
    )


def test_the_checkpoint_rule_catches_a_planted_import():
    planted = {"llm.checkpoint.plan": {"llm.plots", "llm.config"}, "llm.trainer": {"llm.plots"}}
    assert checkpoint_violations(planted) == [("llm.checkpoint.plan", "llm.plots")]
    assert checkpoint_violations({"llm.checkpoint.x": {"llm.callbacks.loss_plot"}}) != []


def test_checkpointing_imports_no_plots_memory_plan_or_callbacks():
    assert checkpoint_violations(import_graph()) == []


def private_weights_imports(path: Path, name: str) -> list[str]:
    """Private names (leading underscore) that `path` imports from llm.weights.* from outside the
    package, and private torch.distributed.checkpoint names imported outside llm.weights.safe_load."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0):
            continue
        private = [a.name for a in node.names if a.name.startswith("_")]
        if node.module.startswith("llm.weights") and not name.startswith("llm.weights"):
            found += [f"{node.module}.{n}" for n in private]
        if node.module.startswith("torch.distributed.checkpoint") and name != "llm.weights.safe_load":
            found += [f"{node.module}.{n}" for n in private]
    return found


def test_the_private_reader_rule_catches_a_planted_import(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from llm.weights.safe_load import _MetadataUnpickler, load_pickle\n"
        "from torch.distributed.checkpoint.state_dict_loader import _load_state_dict\n"
    )
    assert private_weights_imports(planted, "llm.commands.x") == [
        "llm.weights.safe_load._MetadataUnpickler",
        "torch.distributed.checkpoint.state_dict_loader._load_state_dict",
    ]
    assert private_weights_imports(planted, "llm.weights.safe_load") == []


def test_only_the_safe_reader_uses_private_reader_internals():
    found = {name: private_weights_imports(path, name) for name, path in module_files().items()}
    assert {name: names for name, names in found.items() if names} == {}
