"""The core never imports the orchestrator (only trainer.launch.ray imports ray), datapipe
never imports trainer, and no product module imports itself through others."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_loop_loader_and_cli_do_not_import_ray() -> None:
    code = ("import sys, trainer.loop, trainer.cli, trainer.launch.local, datapipe.loader, "
            "monitoring; print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_datapipe_does_not_import_trainer() -> None:
    code = "import sys, datapipe.loader, datapipe.corpus; print('trainer' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


PACKAGES = ("trainer", "datapipe", "monitoring")


def import_graph(root: Path) -> dict[str, set[str]]:
    """Every product module under ``root`` and the product modules it imports: at the top, under
    ``TYPE_CHECKING`` or inside a function (each is a dependency a reader must follow)."""
    def name_of(path: Path) -> str:
        parts = path.relative_to(root).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    files = {name_of(path): path for package in PACKAGES for path in (root / package).rglob("*.py")}

    def product_module(name: str) -> str | None:
        while name and name not in files:  # `from trainer.x import f`: the module trainer.x
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in files.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module)
                imported.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = {m for m in map(product_module, imported) if m and m != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_no_product_module_imports_itself_through_others() -> None:
    graph = import_graph(REPO)
    assert len(graph) >= 30 and "trainer.loop" in graph["trainer.launch.local"]
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle_through_a_type_checking_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
