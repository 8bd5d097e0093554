"""The library's layout is its architecture, checked from the source (every import, those inside
functions included):

    protocol/   imports nothing else of checkpointless
    worker/     the training process: protocol/ only (never control/ or ha/)
    accelerate/ the drop-in Accelerator, on the worker's side: never control/ or ha/
    control/    the supervisor and node agents: protocol/ only (never worker/ or ha/)
    ha/         the etcd coordinator, an add-on above control/

no import cycle between modules, `import checkpointless` loads no control-plane module, the
launcher (its benchmark harness aside) imports only the public faces and only the names they
export, and the sizes hold (files and functions)."""
import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

PKG = ROOT / "checkpointless"
FACES = {"checkpointless", "checkpointless.accelerate", "checkpointless.protocol",
         "checkpointless.worker", "checkpointless.control", "checkpointless.ha"}
MAY_NOT = {"protocol": {"worker", "control", "ha", "accelerate"},
           "worker": {"control", "ha", "accelerate"},
           "accelerate": {"control", "ha"},
           "control": {"worker", "ha", "accelerate"},
           "ha": {"worker", "accelerate"}}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(name: str, tree: ast.AST, is_package: bool) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every import in the tree; a relative
    import resolved against `name`; `from X import y` where X.y is a module gives X.y."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                up = here[:len(here) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            names = [a.name for a in node.names]
            subs = [f"{base}.{n}" for n in names if _is_module(f"{base}.{n}")]
            out += [(s, [], node.lineno) for s in subs]
            rest = [n for n in names if not _is_module(f"{base}.{n}")]
            if rest or not subs:
                out.append((base, rest, node.lineno))
    return out


def _is_module(dotted: str) -> bool:
    p = ROOT.joinpath(*dotted.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def graph(root: Path) -> dict[str, list[tuple[str, list[str], int]]]:
    g = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        name = module_name(path)
        g[name] = imports_of(name, ast.parse(path.read_text()), path.name == "__init__.py")
    return g


def side(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "checkpointless" else None


def wrong_way(g: dict) -> list[str]:
    """Every import that crosses a side the way the layout forbids."""
    bad = []
    for mod, imps in g.items():
        here = side(mod)
        for target, _, line in imps:
            there = side(target)
            if there and there != here and there in MAY_NOT.get(here, ()):
                bad.append(f"{mod}:{line} imports {target}")
            if here == "protocol" and target.startswith("checkpointless") and there != "protocol":
                bad.append(f"{mod}:{line} imports {target}")
    return bad


def cycles(g: dict) -> list[list[str]]:
    """Cycles between modules (a package's __init__ that re-exports its submodules is left out
    as a target: importing a sibling through it is not a cycle of the code)."""
    pkgs = {m for m in g if (ROOT.joinpath(*m.split(".")) / "__init__.py").exists()}
    edges = {m: {t for t, _, _ in imps if t in g and t not in pkgs and t != m}
             for m, imps in g.items()}
    found, state = [], {}

    def visit(m, path):
        state[m] = "open"
        for t in sorted(edges[m]):
            if state.get(t) == "open":
                found.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    return found


def test_no_import_crosses_a_side_the_wrong_way_and_there_is_no_cycle():
    g = graph(PKG)
    assert {side(m) for m in g} >= {"protocol", "worker", "control", "ha", "accelerate"}
    assert wrong_way(g) == []
    assert cycles(g) == []


def test_the_check_catches_a_worker_importing_the_supervisor(tmp_path):
    """The rule fails when broken: a worker module that imports the supervisor inside a
    function, and a cycle made of two function-local imports."""
    src = ("def f():\n    from ..control.supervisor import Supervisor\n"
           "    from . import steploop\n")
    g = graph(PKG)
    g["checkpointless.worker.job"] = imports_of("checkpointless.worker.job", ast.parse(src),
                                                False)
    g["checkpointless.worker.steploop"] = imports_of(
        "checkpointless.worker.steploop", ast.parse("def g():\n    from . import job\n"), False)
    assert wrong_way(g) == ["checkpointless.worker.job:2 imports checkpointless.control.supervisor"]
    assert any(set(c) == {"checkpointless.worker.job", "checkpointless.worker.steploop"}
               for c in cycles(g))


def test_import_checkpointless_loads_no_control_plane_module():
    code = ("import checkpointless, sys; print('\\n'.join(m for m in sys.modules "
            "if m.startswith('checkpointless')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    assert "checkpointless.worker.job" in out and "checkpointless.protocol.keys" in out
    assert [m for m in out if side(m) not in (None, "worker", "protocol")] == []
    # the control plane's names still resolve, lazily
    code = "import checkpointless; print(checkpointless.Supervisor.__module__)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip() == \
        "checkpointless.control.supervisor"


def test_the_launcher_imports_only_the_public_faces_and_their_names():
    exported = {face: set(importlib.import_module(face).__all__) for face in FACES}
    bad = []
    for path in sorted((ROOT / "launcher").rglob("*.py")):
        if "bench" in path.relative_to(ROOT).parts:
            continue
        name = module_name(path)
        for target, names, line in imports_of(name, ast.parse(path.read_text()),
                                              path.name == "__init__.py"):
            if not target.startswith("checkpointless"):
                continue
            where = f"{path.relative_to(ROOT)}:{line}"
            parent, _, last = target.rpartition(".")
            if target not in FACES:
                if parent not in FACES or last not in exported[parent]:
                    bad.append(f"{where} imports {target}")  # not a submodule a face exports
                continue
            bad += [f"{where} takes {n} from {target}" for n in names if n not in exported[target]]
    assert bad == []


def _too_long(root: Path, file_limit: int) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > file_limit:
            out.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    return out


@pytest.mark.parametrize("folder,limit", [("checkpointless", 350), ("launcher", 400)])
def test_files_and_functions_stay_small(folder, limit):
    assert _too_long(ROOT / folder, limit) == []


# The launcher by process, then by layer: a module imports its own folder or a floor below.
# recipe/ and parallel/ are read by both processes; data/ and plan/ by both; train/ is the worker
# process; run/ the launcher process; bench/ drives run/; cli is the front door.
FLOORS = {"recipe": 0, "parallel": 0, "assets": 0, "data": 1, "plan": 1, "train": 2, "run": 3,
          "bench": 4, "cli": 5, "__main__": 5}


def floor(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "launcher":
        return None
    return FLOORS[parts[1]] if len(parts) > 1 else 5


def upward(g: dict) -> list[str]:
    """Every launcher import that climbs to a higher floor, or from models/ into the launcher."""
    bad = []
    for mod, imps in g.items():
        for target, _, line in imps:
            if mod.startswith("models") and target.startswith("launcher"):
                bad.append(f"{mod}:{line} imports {target}")
            here, there = floor(mod), floor(target)
            if here is not None and there is not None and there > here:
                bad.append(f"{mod}:{line} imports {target}")
    return bad


def launcher_graph() -> dict:
    return {**graph(ROOT / "launcher"), **graph(ROOT / "models")}


def test_the_launcher_imports_downward_only_and_has_no_cycle():
    g = launcher_graph()
    assert {m.split(".")[1] for m in g if m.count(".") >= 1 and m.startswith("launcher.")} \
        <= set(FLOORS) | {"bench"}
    assert upward(g) == []
    assert cycles(g) == []


def test_the_launcher_check_catches_a_worker_importing_the_launch():
    """The rule fails when broken: the worker's loop importing the launch inside a function,
    and two function-local imports making a cycle inside train/."""
    g = launcher_graph()
    g["launcher.train.loop"] = imports_of(
        "launcher.train.loop", ast.parse("def f():\n    from launcher.run.launch import train\n"
                                         "    from launcher.train import optim\n"), False)
    g["launcher.train.optim"] = imports_of(
        "launcher.train.optim", ast.parse("def g():\n    from launcher.train import loop\n"),
        False)
    assert upward(g) == ["launcher.train.loop:2 imports launcher.run.launch"]
    assert any(set(c) == {"launcher.train.loop", "launcher.train.optim"} for c in cycles(g))


def test_every_module_path_written_in_a_string_resolves():
    """`python -m launcher.train.loop`, `launcher.train.loop:preload`, a test's script module,
    mock targets: a path named in a string (code, tests, Makefile) is a module that exists, or an
    attribute of one."""
    import re
    pattern = re.compile(
        r"""["'](?:-m )?((?:launcher|tests|models)(?:\.\w+)+)(?::([A-Za-z_]\w*))?["' ]""")
    files = [*sorted((ROOT / "launcher").rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py")),
             ROOT / "Makefile"]
    bad = []
    for path in files:
        for dotted, attr in pattern.findall(path.read_text()):
            parts = dotted.split(".")
            if parts[-1] in ("log", "json", "jsonl", "yaml", "txt"):  # a file's name
                continue
            # the longest prefix that is a module; what follows must be its attributes
            k = max(i for i in range(1, len(parts) + 1) if _is_module(".".join(parts[:i])))
            rest = parts[k:] + ([attr] if attr else [])
            try:
                obj = importlib.import_module(".".join(parts[:k]))
                for name in rest:
                    obj = getattr(obj, name)
            except (ImportError, AttributeError):
                bad.append(f"{path.relative_to(ROOT)}: {dotted}{':' + attr if attr else ''}")
    assert bad == []
