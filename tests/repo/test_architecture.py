"""The structure docs/architecture.md describes: no import cycles, layers that import downwards only."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import paths

REPO = paths.REPO
PACKAGES = ("storage", "shards", "convert", "llm")


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


# What each top-level package may import of the project, besides itself: `storage` at the bottom,
# `shards` (the shard format both sides share) on it, `convert` and `llm` on both, never each other.
ALLOWED = {
    "storage": set(),
    "shards": {"storage"},
    "convert": {"shards", "storage"},
    "llm": {"shards", "storage"},
}


def layer_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, imported) pairs that import across the layers ALLOWED permits."""
    found = []
    for name, imported in sorted(graph.items()):
        top = name.split(".")[0]
        for module in sorted(imported):
            other = module.split(".")[0]
            if other != top and other not in ALLOWED.get(top, set()):
                found.append((name, module))
    return found


def test_the_layer_rule_finds_planted_violations():
    planted = {
        "shards.meta": {"storage.store", "convert.errors"},  # the format may not need the converter
        "shards.tokenizer": {"llm.errors"},
        "storage.s3": {"shards.errors"},
        "convert.sft.conversion": {"shards.writer", "llm.data"},
        "llm.data": {"shards.meta", "storage"},
    }
    assert layer_violations(planted) == [
        ("convert.sft.conversion", "llm.data"),
        ("shards.meta", "convert.errors"),
        ("shards.tokenizer", "llm.errors"),
        ("storage.s3", "shards.errors"),
    ]


def test_layers_import_downwards_only():
    graph = import_graph()
    assert layer_violations(graph) == []
    assert any(m.startswith("shards") for m in graph["convert.sft.conversion"])  # the rule sees the new layer
    assert any(m.startswith("shards") for m in graph["llm.data.meta_checks"])
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


# The smoke test of the GPU acceptance run imports the benchmark it shrinks (bench/gpu_check.py):
# the one exception.
BENCH_SMOKE_TESTS = {"test_gpu_check_smoke.py"}


# tests/ and bench/ share code only through scenarios/, which imports neither.
APART = (("tests", "bench"), ("bench", "tests"), ("scenarios", "bench"), ("scenarios", "tests"))


def cross_imports(tree: Path) -> list[str]:
    """`file -> module` for each import across APART under `tree` (the suite's modules are imported
    as `tests.…`: tests/ itself is never on sys.path)."""
    found = []
    for side, other in APART:
        names = {other}
        for path in sorted((tree / side).rglob("*.py")):
            if side == "tests" and path.name in BENCH_SMOKE_TESTS and tree == REPO:
                continue
            found += [f"{path.relative_to(tree)} -> {name}" for name in sorted(imports_of(path, names))]
    return found


def test_tests_and_bench_never_import_each_other_nor_does_scenarios():
    assert cross_imports(REPO) == []


def test_the_cross_import_check_finds_planted_imports(tmp_path):
    planted = {
        "tests": "from bench.train import main\n",
        "bench": "from tests.support import forkserver\n",
        "scenarios": "def f():\n    from bench import gpu\n",
    }
    for folder, text in planted.items():
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "planted.py").write_text(text)
    (tmp_path / "tests" / "conftest.py").write_text("")
    (tmp_path / "bench" / "ok.py").write_text("from scenarios import resume\nimport llm.model\n")
    assert cross_imports(tmp_path) == [
        "tests/planted.py -> bench",
        "bench/planted.py -> tests",
        "scenarios/planted.py -> bench",
    ]


# --- checkpointing knows nothing of plots, the memory plan, callbacks or loggers; the weights' reader
# internals


CHECKPOINT_MUST_NOT_IMPORT = ("llm.plots", "llm.memory_plan", "llm.callbacks", "llm.loggers")


def checkpoint_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, import) pairs where llm.checkpoint imports plotting, the memory plan, a callback or a
    logger destination."""
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
    assert checkpoint_violations({"llm.checkpoint.x": {"llm.loggers.metrics_file"}}) != []


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


# --- the floors inside llm/ that docs/architecture.md draws: a module imports its own floor or lower

FLOORS = {
    0: (
        "llm.config",
        "llm.model",
        "llm.composer_model",
        "llm.loss",
        "llm.generate",
        "llm.run_dir",
        "llm.meta_init",
        "llm.errors",
        "llm.startup",
    ),
    1: (
        "llm.checkpoint",
        "llm.data",
        "llm.eval",
        "llm.optim",
        "llm.parallelism",
        "llm.plots",
        "llm.float8",
        "llm.profiling",
    ),
    2: ("llm.weights", "llm.loggers", "llm.memory_plan", "llm.config_reference"),
    3: ("llm.callbacks",),
    4: ("llm.trainer",),
    5: ("llm.commands", "llm.__main__"),
}


def floor_of(name: str, floors: dict[int, tuple[str, ...]] = FLOORS) -> int | None:
    for floor, prefixes in floors.items():
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return floor
    return None


def floor_violations(
    graph: dict[str, set[str]], floors: dict[int, tuple[str, ...]] = FLOORS
) -> list[tuple[str, str]]:
    """(module, import) pairs on the map `floors` where a module imports a higher floor than its own."""
    found = []
    for name, imported in graph.items():
        own = floor_of(name, floors)
        for m in imported:
            other = floor_of(m, floors)
            if own is not None and other is not None and other > own:
                found.append((name, m))
    return sorted(found)


def test_every_llm_module_has_a_floor_on_the_map():
    assert [n for n in module_files() if n.startswith("llm.") and floor_of(n) is None] == []


def test_llm_imports_run_down_the_floors():
    assert floor_violations(import_graph()) == []


def test_the_floor_rule_catches_a_planted_upward_import():
    planted = {"llm.data": {"llm.trainer", "llm.config"}, "llm.trainer": {"llm.data"}}
    assert floor_violations(planted) == [("llm.data", "llm.trainer")]


# --- the floors inside convert/: the stages' sub-packages, the data model at the bottom

CONVERT_FLOORS = {
    0: ("convert.records", "convert.errors", "convert.executor", "convert.scratch", "convert.budget"),
    1: ("convert.filters", "convert.tokens", "convert.demo"),
    2: ("convert.reading", "convert.dedup"),
    3: ("convert.run",),
    4: ("convert.sft",),
    5: ("convert.cli", "convert.__main__"),
}


def test_every_convert_module_has_a_floor_on_the_map():
    files = module_files()
    assert [n for n in files if n.startswith("convert.") and floor_of(n, CONVERT_FLOORS) is None] == []


def test_convert_imports_run_down_the_floors():
    graph = import_graph()
    assert floor_violations(graph, CONVERT_FLOORS) == []
    # the package itself (what every `import convert.x` runs first) stands on the bottom floor
    assert {floor_of(m, CONVERT_FLOORS) for m in graph["convert"]} == {0}
    assert "convert.records" in graph["convert.dedup.selection"]  # the rule sees the data model


def test_the_convert_floor_rule_catches_planted_upward_imports():
    planted = {
        "convert.dedup.selection": {"convert.run.worker", "convert.records"},  # types from a worker
        "convert.records": {"convert.filters.cleaning"},
        "convert.reading.readers": {"convert.filters.cleaning", "convert.dedup.minhash"},
        "convert.demo.corpus": {"convert.cli"},
        "convert.run.conversion": {"convert.dedup.selection", "convert.tokens.packing"},
    }
    assert floor_violations(planted, CONVERT_FLOORS) == [
        ("convert.dedup.selection", "convert.run.worker"),
        ("convert.demo.corpus", "convert.cli"),
        ("convert.records", "convert.filters.cleaning"),
    ]


def private_imports(path: Path, name: str, package: str) -> list[str]:
    """Private names (a leading underscore) that module `name` imports from another module of `package`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == package and node.module != name:
                found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    return found


def test_the_private_import_rule_catches_a_planted_import(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from convert.run.conversion import _BATCH_CHARS, Conversion\n"
        "from convert.records import DIGEST_BYTES\n"
    )
    assert private_imports(planted, "convert.run.ranges", "convert") == [
        "convert.run.conversion._BATCH_CHARS"
    ]
    assert private_imports(planted, "convert.run.conversion", "convert") == []


def test_no_convert_module_imports_a_private_name_of_another():
    found = {
        n: private_imports(p, n, "convert") for n, p in module_files().items() if n.startswith("convert")
    }
    assert {name: names for name, names in found.items() if names} == {}
