"""The layers hold: domain/ imports no I/O, flows reach the world only through ports (the
import-linter contracts in pyproject.toml), and no module grows past a few hundred lines."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import animastor_tasks

FORBIDDEN = {"redis", "psycopg", "psycopg_pool", "celery", "kombu", "requests", "socket", "subprocess"}


def test_domain_imports_nothing_with_io() -> None:
    domain = Path(animastor_tasks.__file__).parent / "domain"
    offenders = []
    for path in domain.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.split(".")[0] in FORBIDDEN or (
                    name.startswith("animastor_tasks")
                    and not name.startswith(("animastor_tasks.domain", "animastor_tasks.errors"))
                ):
                    offenders.append(f"{path.name}: {name}")
    assert offenders == []


ROOT = Path(animastor_tasks.__file__).parent
MAX_MODULE_LINES = 400


def _lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """Run the project's import contracts (pyproject.toml) over the package found in `tree`."""
    tool = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [str(tool), "--config", str(ROOT.parent / "pyproject.toml"), "--no-cache"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_import_contracts_hold() -> None:
    run = _lint_imports(ROOT.parent)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 kept, 0 broken" in run.stdout


@pytest.mark.parametrize("driver", ["redis", "psycopg", "celery"])
def test_a_flow_that_imports_a_driver_breaks_the_contract(tmp_path: Path, driver: str) -> None:
    """The contract can fail: the same package, with one flow module reaching for a driver, is refused."""
    shutil.copytree(ROOT, tmp_path / "animastor_tasks", ignore=shutil.ignore_patterns("__pycache__"))
    gate = tmp_path / "animastor_tasks" / "flow" / "gate.py"
    gate.write_text(gate.read_text().replace("import logging\n", f"import logging\n\nimport {driver}\n", 1))
    run = _lint_imports(tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"animastor_tasks.flow.gate -> {driver}" in run.stdout
    assert "1 kept, 1 broken" in run.stdout


def test_no_module_outgrows_what_a_newcomer_can_hold() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def test_a_cli_call_does_not_load_the_dev_tooling(tmp_path: Path) -> None:
    """Only `up`, `down` and `demo` need the embedded servers; every other command stays light."""
    probe = (
        "import sys; from animastor_tasks.operator import cli;"
        " cli.main(['layers', '--help'], standalone_mode=False);"
        " print(sorted(m for m in sys.modules if m.startswith('animastor_tasks.dev')))"
    )
    env = {**os.environ, "ANIMASTOR_LOCAL_DIR": str(tmp_path / "none")}
    run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "['animastor_tasks.dev', 'animastor_tasks.dev.local_dir']"
