"""The domain layer stays pure: no driver, no Celery, no I/O imports under domain/."""

from __future__ import annotations

import ast
from pathlib import Path

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
