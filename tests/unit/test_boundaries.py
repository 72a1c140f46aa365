"""The core never imports the orchestrator (only trainer.launch.ray imports ray), datapipe
never imports trainer, and no product module imports itself through others."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_loop_loader_and_cli_do_not_import_ray() -> None:
    code = ("import sys, trainer.loop, trainer.cli, trainer.launch.local, datapipe.loader, "
            "monitoring; print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_the_cli_starts_without_the_training_packages() -> None:
    """``memtrain submit`` runs where only the core install is (no torch, numpy, pyarrow):
    the CLI and the config it loads must import without them (the fixture makes them absent)."""
    out = subprocess.run([sys.executable, str(REPO / "tests" / "fixtures" /
                                              "without_training_deps.py"), "submit", "--help"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--address" in out.stdout


@pytest.mark.slow
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


# trainer/'s layers, lowest first: a module imports only from its own layer or below (the
# cycle test above holds each layer free of loops). docs/architecture.md states the same order.
LAYERS: tuple[tuple[str, ...], ...] = (
    # the base: the config, errors, torch's private APIs, logs, fault injection, the batches,
    # what a tensor is underneath
    ("trainer", "trainer.errors", "trainer.config", "trainer.compat", "trainer.faults",
     "trainer.logs", "trainer.batches", "trainer.global_batch", "trainer.tensors"),
    ("trainer.memory",),  # the memory strategies
    ("trainer.models",),  # what is trained, built with its memory transforms
    ("trainer.parallel",),  # how the work is split over ranks
    ("trainer.checkpoint", "trainer.telemetry", "trainer.optim", "trainer.context",
     "trainer.state"),
    ("trainer.oom", "trainer.step"),
    ("trainer.plan",),
    ("trainer.loop",),
    ("trainer.launch",),
    ("trainer.cli",),
)


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of the longest entry that is ``module`` or a package above it
    (``trainer`` itself: only its ``__init__``, so that a new module must be given a layer)."""
    found = [(len(entry), i) for i, entries in enumerate(LAYERS) for entry in entries
             if module == entry or (entry != "trainer" and module.startswith(entry + "."))]
    if not found:
        raise AssertionError(f"{module} has no layer in tests/unit/test_boundaries.py LAYERS")
    return max(found)[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports in trainer/ from a lower layer to a higher one, as "a -> b"."""
    return sorted(f"{module} -> {other}" for module, imported in graph.items()
                  if module.startswith("trainer") for other in imported
                  if other.startswith("trainer") and layer_of(other) > layer_of(module))


def test_trainers_layers_import_only_downwards() -> None:
    graph = import_graph(REPO)
    assert "trainer.plan.auto" in graph and "trainer.memory.planner" not in graph
    assert upward_imports(graph) == []
    # The strategies plan nothing: trainer/memory/ imports nothing from the planner or above.
    assert not any(other.startswith(("trainer.plan", "trainer.step", "trainer.models"))
                   for module, imported in graph.items() if module.startswith("trainer.memory")
                   for other in imported)


def test_the_layer_check_finds_an_upward_import() -> None:
    graph = {"trainer.memory.loss": {"trainer.plan.speed"}, "trainer.plan.speed": {"trainer.step"}}
    assert upward_imports(graph) == ["trainer.memory.loss -> trainer.plan.speed"]
    with pytest.raises(AssertionError, match="trainer.novel has no layer"):
        upward_imports({"trainer.novel": {"trainer.config"}})


MAX_FUNCTION_LINES = 60


def long_functions(root: Path) -> list[str]:
    """Functions of more than ``MAX_FUNCTION_LINES`` lines (signature to last line) in the
    product and bench code, as "path:function (lines)"."""
    found = []
    for package in (*PACKAGES, "bench", "scripts"):
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                    if lines > MAX_FUNCTION_LINES:
                        found.append(f"{path.relative_to(root)}:{node.name} ({lines})")
    return found


def test_no_function_is_longer_than_a_screen() -> None:
    """A function a newcomer reads whole: at most 60 lines. A longer one is split where its
    parts have names."""
    assert long_functions(REPO) == []


# How the work is split over ranks is asked of its ``Parallelism`` (trainer/parallel/): the
# planner plans each way (trainer/plan/) and the config refuses combinations in one line each
# (trainer/config.py); no other module branches on the kind of splitting.
KIND_BRANCH = re.compile(
    r"strategy\s*(?:[!=]=|(?:not\s+)?in\b)|\bis_sharded\(|\bis_ddp\("
    r"|\bworld_size\s*(?:[<>]=?|[!=]=)\s*\d|\d\s*(?:[<>]=?|[!=]=)\s*world_size\b"
    r"|[\"'](?:ddp|fsdp)[\"']\s*(?:[!=]=|in\b)|(?:[!=]=)\s*[\"'](?:ddp|fsdp)[\"']"
    r"|isinstance\([^)]*\b(?:DDP|DistributedDataParallel|DataParallel|ShardedDataParallel|FSDPModule)\b"
    r"|getattr\([^,]+,\s*[\"']module[\"']|set_requires_gradient_sync|\.no_sync\(")
MAY_BRANCH_ON_THE_KIND = ("trainer/parallel/", "trainer/plan/", "trainer/config.py")


def kind_branches(path: str, text: str) -> list[str]:
    """The lines of ``text`` (the module at ``path``) that branch on the kind of splitting."""
    if path.startswith(MAY_BRANCH_ON_THE_KIND):
        return []
    return [f"{path}:{number}: {line.strip()}"
            for number, line in enumerate(text.splitlines(), 1)
            if KIND_BRANCH.search(line) and not line.lstrip().startswith("#")]


def test_only_the_parallelism_branches_on_the_kind_of_splitting() -> None:
    found = [branch for path in sorted((REPO / "trainer").rglob("*.py"))
             for branch in kind_branches(str(path.relative_to(REPO)), path.read_text())]
    assert found == []


def test_the_kind_branch_finder_finds_them() -> None:
    code = ('if cfg.parallel.strategy == "fsdp" and ctx.world_size > 1:\n'
            "    sync = model.no_sync() if isinstance(model, DDP) else None\n"
            "# a comment that says strategy == fsdp\n"
            'hooks = BackwardSteps(optimizer, comm_hook=in_backward == "ddp")\n'
            'inner = getattr(model, "module", model)\n'
            "if 2 <= world_size or strategy in SHARDED:\n"
            "loss = summed_loss(model, batch, policy)\n")
    assert [line.split(": ", 1)[0] for line in kind_branches("trainer/loop.py", code)] == \
        [f"trainer/loop.py:{n}" for n in (1, 2, 4, 5, 6)]
    assert kind_branches("trainer/parallel/ddp.py", code) == []
