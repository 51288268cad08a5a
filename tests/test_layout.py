"""The architecture as DESIGN.md states it: which package may import which, read from the code
with `ast`, and one installed namespace."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("features", "evaluation", "retrieval", "ranking", "serving", "pipeline")
ROOT_MODULES = {"console"}          # tworec/*.py beside the namespace's __init__: open to all
ALLOWED = {
    "features": set(),
    "evaluation": {"features"},
    "retrieval": {"features", "evaluation", "serving.layout"},
    "ranking": {"features", "evaluation", "serving.layout"},
    "serving": set(),
    "pipeline": set(PACKAGES),
    "scripts": {"pipeline", "serving", "features"},
}


def imported_packages(path: str) -> set[str]:
    """The project packages a file imports, as `features` or `serving.layout` (the module for
    `serving`, whose layout helpers alone the stages may use); a bare top-level import of a
    package name (the old layout) is reported as `bare:NAME`."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level > 1:
            found.add("relative import beyond its package")    # could reach any package
            continue
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + ([f"{node.module}.{a.name}" for a in node.names]
                                     if node.module == "tworec" else [])
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] in PACKAGES:
                found.add(f"bare:{parts[0]}")
            elif parts[0] == "tworec" and len(parts) > 1:
                found.add("serving.layout" if parts[1:3] == ["serving", "layout"] else parts[1])
    return found


def python_files(folder: str):
    for directory, _, files in os.walk(os.path.join(ROOT, folder)):
        yield from (os.path.join(directory, f) for f in files if f.endswith(".py"))


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_each_package_imports_only_what_the_design_allows(folder):
    allowed = ALLOWED[folder] | {folder} | ROOT_MODULES
    if "serving" in allowed:
        allowed.add("serving.layout")
    for path in python_files(folder):
        wrong = sorted(imported_packages(path) - allowed)
        assert not wrong, f"{os.path.relpath(path, ROOT)} imports {wrong}"


def test_the_checker_sees_a_forbidden_import(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("from tworec.retrieval.train import fit\nimport features\n"
                    "from tworec import ranking\nfrom tworec.serving.layout import write_version\n"
                    "from ..ranking import model\n")
    assert imported_packages(str(path)) == {"retrieval", "bare:features", "ranking",
                                            "serving.layout", "relative import beyond its package"}


def test_setup_installs_one_namespace():
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    packages = next(node.value for node in ast.walk(tree)
                    if isinstance(node, ast.Assign) and node.targets[0].id == "PACKAGES")
    assert sorted(ast.literal_eval(packages)) == sorted(PACKAGES)
    import tworec.pipeline
    assert os.path.dirname(os.path.realpath(tworec.pipeline.__file__)) == \
        os.path.join(ROOT, "pipeline")
