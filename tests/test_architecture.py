"""The house plan, read from the imports: `service.core` at the ground, the API, the store and the
workers beside each other on it, the CLI on top (docs/development/architecture.md)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The job host (worker/jobs/): it moves jobs through the store, so it alone of the worker may import service.store.
JOB_HOST = "worker.jobs"
NOT_IN_CORE = ("torch", "transformers", "peft", "fastapi", "starlette", "sqlalchemy", "worker")


def modules(package: str) -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for p in sorted((ROOT / package).rglob("*.py"))}


def imports(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # `from service import queue`
    return found


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


ALL = {**modules("service"), **modules("worker")}


@pytest.mark.parametrize("module", sorted(modules("service/core")))
def test_core_stands_on_nothing_of_ours_but_itself(module):
    bad = {i for i in imports(ALL[module]) if any(within(i, p) for p in NOT_IN_CORE)
           or (within(i, "service") and not within(i, "service.core") and i != "service")}
    assert not bad, f"{module} imports {sorted(bad)}"


@pytest.mark.parametrize("module", sorted(modules("worker")))
def test_workers_import_only_the_core_of_the_service(module):
    allowed = ("service.core", "service.store") if within(module, JOB_HOST) else ("service.core",)
    bad = {i for i in imports(ALL[module]) if within(i, "service") and i != "service"
           and not any(within(i, a) for a in allowed)}
    assert not bad, f"{module} imports {sorted(bad)}"


@pytest.mark.parametrize("module", sorted(m for m in modules("worker") if not within(m, JOB_HOST)))
def test_only_the_job_host_stands_on_the_store(module):
    """A loop, an algorithm or an engine reports through the Reporter seam (worker/reporting.py); the
    store adapters that implement it are the job host's (worker/jobs/), and nothing else of the worker
    imports that room."""
    bad = {i for i in imports(ALL[module]) if within(i, JOB_HOST)}
    assert not bad, f"{module} imports {sorted(bad)}"


@pytest.mark.parametrize("module", sorted(modules("service/store")))
def test_the_store_never_imports_the_api(module):
    """The API stands on the store, never the other way: a query that needs a route's knowledge is a bug."""
    bad = {i for i in imports(ALL[module]) if within(i, "service.api")}
    assert not bad, f"{module} imports {sorted(bad)}"


@pytest.mark.parametrize("module", sorted(modules("worker/algos")))
def test_the_maths_imports_nothing_else_of_the_worker(module):
    """worker/algos is pure torch: a loss, an advantage or an influence is testable on hand-made tensors."""
    bad = {i for i in imports(ALL[module]) if within(i, "worker") and i != "worker" and not within(i, "worker.algos")}
    assert not bad, f"{module} imports {sorted(bad)}"


# The runs (a job kind's loop, the session run) and the job host that starts them; everything else is shared.
RUNS = ("worker.loops", "worker.session", JOB_HOST)


@pytest.mark.parametrize("module", sorted(m for m in modules("worker") if not any(within(m, r) for r in RUNS)))
def test_shared_parts_never_import_the_loops(module):
    """An engine, the model room, an environment or a reward serves every loop, so it knows none of them."""
    bad = {i for i in imports(ALL[module]) if within(i, "worker.loops")}
    assert not bad, f"{module} imports {sorted(bad)}"


def test_engines_hold_only_samplers():
    """worker/engines/ is where a sampler lives: each module is a RolloutEngine or serves one that is."""
    engines = {m.removeprefix("worker.engines.") for m in modules("worker/engines") if m != "worker.engines"}
    assert engines == {"hf_engine", "vllm_engine", "folded", "vllm_watchdog"}, sorted(engines)


def test_at_most_eight_loose_modules_in_the_worker():
    """Beside its rooms, the worker keeps only what every room shares; a ninth loose file belongs in a room."""
    loose = sorted(p.name for p in (ROOT / "worker").glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 8, loose


def test_only_the_cli_imports_the_worker():
    found = {m: sorted(i for i in imports(p) if within(i, "worker"))
             for m, p in modules("service").items() if not within(m, "service.cli")}
    assert {m: i for m, i in found.items() if i} == {}


@pytest.mark.parametrize("module", sorted(modules("service/api")))
def test_routes_never_commit(module):
    """The store owns its transactions (service/store/__init__.py): a route's session commits when the
    request ends, and what must follow a commit (telling a worker) is `db.after_commit`."""
    tree = ast.parse(modules("service/api")[module].read_text())
    commits = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "commit"]
    assert not commits, f"{module} commits at lines {commits}"


@pytest.mark.parametrize("package", sorted(str(p.parent.relative_to(ROOT)) for d in ("service", "worker")
                                            for p in (ROOT / d).rglob("__init__.py")))
def test_every_package_says_what_lives_there_and_what_it_may_import(package):
    doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
    assert doc and "import" in doc, f"{package}/__init__.py: a docstring saying what lives there and what it may import"


def test_no_import_circles():
    """Lazy imports inside functions count too: deferring an import hides a circle, it does not break it."""
    graph = {m: {i for i in imports(p) if i in ALL and i != m} for m, p in ALL.items()}
    seen, on_path, circles = set(), [], []

    def visit(m: str) -> None:
        if m in on_path:
            circles.append(on_path[on_path.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        on_path.append(m)
        for n in sorted(graph[m]):
            visit(n)
        on_path.pop()

    for m in sorted(graph):
        visit(m)
    assert not circles, circles


def _dataclass_fields() -> dict[str, list[str]]:
    fields = {}
    for path in ALL.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    (isinstance(d, ast.Name) and d.id == "dataclass")
                    or (isinstance(d, ast.Call) and getattr(d.func, "id", "") == "dataclass") for d in node.decorator_list):
                fields[node.name] = [b.target.id for b in node.body
                                     if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name)]
    return fields


def test_wide_records_are_built_by_keyword():
    """A record of more than four fields read by position is a bug waiting for a reordering."""
    wide = {name for name, f in _dataclass_fields().items() if len(f) > 4}
    positional = []
    for module, path in ALL.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and len(node.args) > 4:
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in wide:
                    positional.append(f"{module}:{node.lineno} {name}")
    assert not positional, positional


def test_no_function_is_over_60_lines():
    long = [f"{m}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)" for m, p in ALL.items()
            for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60]
    assert not long, long
