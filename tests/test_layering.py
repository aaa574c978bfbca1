"""The package's structure: its folders are its layers, no import cycles, no private names read
across packages, and a core that works without the widget libraries."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "qreport_widgets"
WIDGET_LIBRARIES = ("ipywidgets", "bqplot", "traitlets")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every package module ``name`` imports: at the top, inside functions, under TYPE_CHECKING alike."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in modules else source)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 20 and "qreport_widgets.widgets.app" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = import_graph()
    graph["qreport_widgets.core.features"] = graph["qreport_widgets.core.features"] | {"qreport_widgets.widgets.app"}
    assert find_cycle(graph) is not None


def test_the_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    # report.widget() imports the widgets inside the method; storage reads the version module
    assert "qreport_widgets.widgets" in graph["qreport_widgets.report.model_report"]
    assert "qreport_widgets._version" in graph["qreport_widgets.share.storage"]
    assert "qreport_widgets.core.features" in graph["qreport_widgets.observe.detectors.outlier"]  # from .. import features as F


# the package's folders, lowest first: a module imports only from its own folder and those below it
LAYERS = ("core", "observe", "share", "targets", "engines", "tune", "report", "widgets")
BELOW_EVERYTHING = {"qreport_widgets.errors", "qreport_widgets._version"}
ENTRY_POINTS = {"qreport_widgets", "qreport_widgets.analyze", "qreport_widgets.demo"}  # above every layer
AT_THE_ROOT = {"__init__.py", "analyze.py", "errors.py", "_version.py"}
# a core module may build the widgets' views inside the methods that return them (widget(), save_html(), plots)
BUILDS_VIEWS = {"qreport_widgets.report.model_report", "qreport_widgets.share.storage", "qreport_widgets.observe.visualizer"}


def layer_of(name: str) -> int | None:
    parts = name.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for name, targets in graph.items():
        here = layer_of(name)
        if here is None:
            continue
        for target in sorted(targets - BELOW_EVERYTHING):
            there = layer_of(target)
            views = target.startswith("qreport_widgets.widgets") and name in BUILDS_VIEWS
            if (there is None or there > here) and not views:
                found.append(f"{name} -> {target}")
    return found


def test_the_folders_are_layers_and_imports_point_down():
    graph = import_graph()
    assert not upward_imports(graph)
    broken = {**graph, "qreport_widgets.observe.graph": graph["qreport_widgets.observe.graph"] | {"qreport_widgets.tune.run"}}
    assert upward_imports(broken) == ["qreport_widgets.observe.graph -> qreport_widgets.tune.run"]
    root = {path.name for path in PACKAGE.glob("*.py")}
    assert root == AT_THE_ROOT, f"modules at the package root: {sorted(root - AT_THE_ROOT)}"
    assert {path.name for path in PACKAGE.iterdir() if path.is_dir() and (path / "__init__.py").exists()} == {*LAYERS, "demo"}
    for package in (*LAYERS, "demo"):  # each says what it owns and what it may import
        docstring = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text()))
        assert docstring and (package == "demo" or "import" in docstring), package
    entry = {name for name in graph if layer_of(name) is None and name not in BELOW_EVERYTHING}
    assert entry <= ENTRY_POINTS | {n for n in graph if n.startswith("qreport_widgets.demo.")}, entry


def private_names_defined() -> dict[str, set[str]]:
    """``_name`` -> the packages (``qreport_widgets.tune`` ...) whose code defines it (an attribute
    set on ``self``, a method, a module-level name)."""
    found: dict[str, set[str]] = {}
    for name, path in package_modules().items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            defined = None
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined = node.name
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and ast.unparse(node.value) == "self":
                defined = node.attr
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined = node.id
            if defined and defined.startswith("_") and not defined.startswith("__"):
                found.setdefault(defined, set()).add(package)
    return found


def private_reads_across_packages() -> list[str]:
    """Reads of another package's ``_private`` names: ``from .x import _name`` and ``obj._name``
    where ``obj`` is not ``self`` / ``cls`` and no module of the reader's own package defines ``_name``."""
    defined, found = private_names_defined(), []
    for name, path in package_modules().items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("qreport_widgets")):
                found += [f"{name}:{node.lineno} imports {a.name}" for a in node.names if foreign(package, a.name, defined)]
            elif isinstance(node, ast.Attribute) and ast.unparse(node.value) not in ("self", "cls"):
                if foreign(package, node.attr, defined):
                    found.append(f"{name}:{node.lineno} {ast.unparse(node.value)}.{node.attr}")
    return found


def foreign(package: str, attribute: str, defined: dict[str, set[str]]) -> bool:
    """Whether ``attribute`` is a private name of this package's code that ``package`` does not define."""
    private = attribute.startswith("_") and not attribute.startswith("__")
    return private and attribute in defined and package not in defined[attribute]


def test_no_module_reads_another_packages_private_names():
    assert not private_reads_across_packages()
    defined = private_names_defined()  # what analyze() once did: session._weights.share(...)
    assert foreign("qreport_widgets", "_weights", defined) and not foreign("qreport_widgets.tune", "_weights", defined)
    assert not foreign("qreport_widgets", "_parameters", defined)  # torch's own: not this package's business


def test_no_protocol_restates_the_session():
    """The parts of tune/ are given values; the widgets see a session through one protocol."""
    found = set()
    for name, path in package_modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(base) == "Protocol" for base in node.bases):
                found.add(f"{name}.{node.name}")
    assert found == {
        "qreport_widgets.engines.contract.Simulation",  # what an engine's simulation offers
        "qreport_widgets.observe.records.ReportRecord",  # what a detector's record offers
        "qreport_widgets.widgets.protocols.GraphView",
        "qreport_widgets.widgets.protocols.ReportSource",
        "qreport_widgets.widgets.protocols.TuningSession",
    }


def test_core_modules_do_not_import_the_widgets():
    graph = import_graph()
    widget_side = {name for name in graph if name.startswith("qreport_widgets.widgets")}
    # the core may reach the widgets only from the methods that build them
    allowed = BUILDS_VIEWS | {"qreport_widgets"}
    offenders = {name for name, targets in graph.items() if name not in widget_side and targets & widget_side} - allowed
    assert not offenders


def test_the_core_runs_without_ipywidgets_bqplot_and_traitlets(tmp_path):
    script = textwrap.dedent(
        f"""
        import importlib.abc, sys

        BLOCKED = {WIDGET_LIBRARIES!r}

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"{{name}} is blocked for this test")
                return None

        sys.meta_path.insert(0, Block())
        import qreport_widgets as qw
        from qreport_widgets import demo

        batches = demo.demo_batches(4)
        report = qw.analyze(demo.build_demo_model(), batches[0], batches, qconfig_mapping=demo.demo_qconfig_mapping(),
                            progress=False)
        loaded = qw.load_report(report.save({str(tmp_path / "demo.qreport")!r}))
        assert loaded.frame().channels.equals(report.frame().channels)
        assert len(loaded.generate_visualizer().tables().channel_level) > 0
        result = report.session.apply(report.suggested_settings(), label="suggested")
        assert result.ok, result.error
        assert result.output_sqnr_db > report.session.baseline().output_sqnr_db
        loaded_libraries = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded_libraries, loaded_libraries
        try:
            report.widget()
        except ImportError as error:
            print("widget:", error)
        print("core ok", round(result.output_sqnr_db, 2))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "core ok" in done.stdout and "widget: ipywidgets is blocked" in done.stdout


ENGINE_PACKAGES = ("qreport_widgets.engines.fx", "qreport_widgets.engines.pt2e", "qreport_widgets.engines.eager")
REGISTRY = "qreport_widgets.engines"


def _in_engine(name: str) -> bool:
    return any(name == package or name.startswith(package + ".") for package in ENGINE_PACKAGES)


def engine_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Modules outside the engines and their registry that import an engine package: module -> what."""
    found = {name: sorted(t for t in targets if _in_engine(t)) for name, targets in graph.items()}
    return {name: targets for name, targets in found.items() if targets and not _in_engine(name) and name != REGISTRY}


def test_only_the_registry_imports_an_engine_package():
    graph = import_graph()
    assert not engine_imports(graph)
    for importer in ("qreport_widgets.tune.session", "qreport_widgets.tune.diagnosis", "qreport_widgets.widgets.tuning"):
        broken = {**graph, importer: graph[importer] | {"qreport_widgets.engines.fx.engine"}}
        assert engine_imports(broken) == {importer: ["qreport_widgets.engines.fx.engine"]}


def test_no_engine_is_probed_or_named_outside_the_engines():
    """No ``engine.name == ...`` and no ``getattr(engine, ...)`` / ``hasattr`` outside fx/, pt2e/ and
    the registry: optional abilities are methods with defaults on the Engine base class."""
    found = []
    for name, path in package_modules().items():
        if _in_engine(name) or name == REGISTRY:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(isinstance(s, ast.Attribute) and s.attr == "name" and "engine" in ast.unparse(s.value) for s in sides):
                    found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
                if node.args and "engine" in ast.unparse(node.args[0]):
                    found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


def test_every_registered_engine_is_a_package_with_an_engine_module():
    from qreport_widgets.engines import ENGINES
    from qreport_widgets.engines.contract import Engine

    for name, load in ENGINES.items():
        engine = load()
        assert issubclass(engine, Engine) and engine.name == name
        assert engine.__module__ == f"qreport_widgets.engines.{name}.engine"
        assert (PACKAGE / "engines" / name / "__init__.py").exists()
