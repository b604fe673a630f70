"""The module layering the code promises: the import-linter contracts of `.importlinter`
(layers; product never imports the sim or the lab; the model reaches no host), no import
circle between admission, render and the inventory; facts never import the operations;
host-side scripts are package files that run."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _pdops_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pdops"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("pdops")}
    return out


def test_the_import_contracts_hold():
    """`lint-imports` over the whole package; a broken contract names the importing module, the
    line and the chain (docs/design/architecture.md, "Layers")."""
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Contracts: 8 kept, 0 broken." in proc.stdout, proc.stdout[-2000:]


def test_no_import_circle_between_modules():
    """Import circles hide layering faults behind function-local imports: none, the operations and the
    CLI included (each operation imports only those below it, .importlinter's ops layers)."""
    import grimp

    graph = grimp.build_graph("pdops")
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[set[str]] = []

    def visit(m: str) -> None:  # Tarjan's strongly connected components
        index[m] = low[m] = len(index)
        stack.append(m)
        on.add(m)
        for n in graph.find_modules_directly_imported_by(m):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            comp = set()
            while True:
                n = stack.pop()
                on.discard(n)
                comp.add(n)
                if n == m:
                    break
            if len(comp) > 1:
                circles.append(comp)

    for m in sorted(graph.modules):
        if m not in index:
            visit(m)
    assert not circles, [sorted(c) for c in circles]


def test_admission_imports_only_the_errors_of_pdops():
    assert _pdops_imports(REPO / "pdops" / "model" / "admission.py") == {"pdops.errors"}


def test_importing_admission_alone_loads_neither_render_nor_inventory():
    code = "import sys, pdops.model.admission; print(sorted(m for m in sys.modules if m in ('pdops.model.render', 'pdops.model.inventory')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_facts_never_import_operations():
    ops = {"pdops.ops.deploy", "pdops.ops.drain", "pdops.ops.scale", "pdops.steps.preflight", "pdops.runner"}
    for f in (REPO / "pdops" / "facts").glob("*.py"):
        bad = {m for m in _pdops_imports(f) if any(m == op or m.startswith(op + ".") for op in ops)}
        assert not bad, (f.name, bad)


def test_host_scripts_are_package_files_that_compile():
    scripts = list((REPO / "pdops" / "steps" / "preflight" / "scripts").glob("*.py")) + \
        list((REPO / "pdops" / "facts" / "scripts").glob("*.py")) + list((REPO / "pdops" / "hostscripts").glob("*.py"))
    assert {s.name for s in scripts} >= {"listener.py", "waiter.py", "probe.py", "versions.py", "haproxy_runtime.py"}
    for s in scripts:
        compile(s.read_text(), str(s), "exec")


def test_versions_script_reports_the_packages_it_is_given():
    from pdops.facts import host as hf

    out = subprocess.run([sys.executable, "-c", hf._VERSIONS_SCRIPT, '["pyyaml", "no-such-package-xyz", '
                          '"nvidia-nccl-cu12", "nvidia-nccl-cu13"]'], capture_output=True, text=True, check=True).stdout
    v = hf.parse_versions(out)
    assert v["pyyaml"] == "6.0.3" and v["no-such-package-xyz"] is None


def test_no_module_imports_another_modules_private_names():
    """`from pdops.x import _name` couples a module to another's internals; a name two modules
    share is public (named without the underscore)."""
    bad = []
    for path in sorted((REPO / "pdops").rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        own = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pdops") \
                    and node.module != own:
                bad += [f"{rel}.py:{node.lineno} imports {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, bad


def test_no_module_passes_500_lines_but_data_tables_and_host_scripts():
    """style.md item 17: a module over 500 lines does more than one thing. Excepted: a data table and a script
    shipped to the hosts as one file."""
    excepted = {"pdops/model/sglang_flags.py", "pdops/hostscripts/record.py"}
    over = {str(p.relative_to(REPO)): n for p in sorted((REPO / "pdops").rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 500}
    assert set(over) <= excepted, {k: v for k, v in over.items() if k not in excepted}


def test_no_function_local_import_of_pdops_in_product_code_and_each_in_the_sim_or_lab_says_why():
    """A function-local import hides an edge of the import graph from the reader (and once hid the
    operations' circle): outside the CLI (whose tasks load their operation when run), the sim and the
    lab, no pdops module is imported inside a function (product code imports nothing of the sim); inside
    the sim and the lab, a lazy load of pdops (the sim forks its ranks before its heavy imports) says
    why on its line."""
    import ast

    found = []
    for p in sorted((REPO / "pdops").rglob("*.py")):
        rel = p.relative_to(REPO)
        if rel.parts[1] == "cli":
            continue
        tools = rel.parts[1] in ("sim", "lab")
        text = p.read_text()
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for n in ast.walk(fn):
                mods = ([n.module] if isinstance(n, ast.ImportFrom) and n.module else
                        [a.name for a in n.names] if isinstance(n, ast.Import) else [])
                for m in mods:
                    if not m.startswith("pdops"):
                        continue
                    if tools and "#" in lines[n.lineno - 1]:
                        continue
                    found.append(f"{rel}:{n.lineno} {m}")
    assert not found, found


def test_the_layers_the_architecture_doc_states_are_the_ones_importlinter_holds():
    """docs/design/architecture.md says the layers in one sentence (bottom first); .importlinter's
    layers contract (top first) must list the same, in the same order: the doc cannot drift."""
    import configparser
    import re

    doc = (REPO / "docs" / "design" / "architecture.md").read_text()
    sentence = re.search(r"A module imports from its own layer and those below it, never above: (.*?)\.\s", doc,
                         re.S).group(1)
    stated = [sorted(p.strip().rstrip("/") for p in level.split(",")) for level in sentence.split("->")]
    cfg = configparser.ConfigParser()
    cfg.read(REPO / ".importlinter")
    held = [sorted(m.strip().removeprefix("pdops.") for m in re.split(r"[:|]", line))
            for line in cfg["importlinter:contract:layers"]["layers"].split("\n") if line.strip()]
    assert stated == list(reversed(held)), (stated, held)


def test_every_module_an_import_contract_names_is_named_by_the_architecture_doc():
    """The contracts inside ops, reads and model, the sim/lab ban and the planners' ban: each module or
    package .importlinter names there is named in docs/design/architecture.md's item for that contract
    (a module added to a contract and not to the doc fails here)."""
    import configparser
    import re

    doc = (REPO / "docs" / "design" / "architecture.md").read_text()
    items = {int(m.group(1)): m.group(2) for m in re.finditer(r"^(\d)\. (.*?)(?=^\d\. |^\S)", doc, re.M | re.S)}
    cfg = configparser.ConfigParser()
    cfg.read(REPO / ".importlinter")

    def names(contract: str, key: str, strip: str = "pdops.") -> set[str]:
        return {m.strip().removeprefix(strip) for line in cfg[f"importlinter:contract:{contract}"][key].split("\n")
                for m in re.split(r"[:|]", line) if m.strip()}

    wanted = {2: names("ops-layers", "layers"), 3: names("reads-layers", "layers"),
              4: names("model-layers", "layers"), 5: names("product-not-tools", "source_modules"),
              7: names("planners-reach-no-host", "source_modules", "pdops.ops.") - {"pdops.steps.builders"}
              | {"steps.builders"}}
    missing = {n: sorted(m for m in mods if not re.search(rf"(?<![\w.]){re.escape(m)}(?![\w])", items[n]))
               for n, mods in wanted.items()}
    assert not any(missing.values()), missing


def test_no_planner_changes_a_step_or_a_plan_after_making_it():
    """Plans are values: a builder takes what its caller would add (a note, a condition, the files
    delivered now) as arguments, and a planner that needs another plan makes a new one
    (dataclasses.replace), never assigns to a step's or a plan's fields after making it."""
    import ast

    fields = {"group", "description", "params", "when", "always", "head", "rescue", "steps"}
    found = []
    for p in sorted((REPO / "pdops").rglob("*.py")):
        rel = p.relative_to(REPO)
        if rel.parts[1] in ("sim", "lab", "cli"):
            continue
        for n in ast.walk(ast.parse(p.read_text())):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AugAssign) else []
            for t in targets:
                while isinstance(t, ast.Subscript):
                    t = t.value
                if isinstance(t, ast.Attribute) and t.attr in fields and not (
                        isinstance(t.value, ast.Name) and t.value.id == "self"):
                    found.append(f"{rel}:{n.lineno} .{t.attr}")
    assert not found, found
