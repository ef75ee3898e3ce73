"""The CLI refuses input it cannot act on with exit 2 before it reaches a store or the broker (nothing listens
at the URLs below: a command that tried would exit 3, or wait)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from animastor_tasks.operator.cli import main

NOWHERE = {
    "ANIMASTOR_DATABASE_URL": "postgresql://postgres@127.0.0.1:1/none",
    "ANIMASTOR_REDIS_URL": "redis://127.0.0.1:1/0",
    "ANIMASTOR_BROKER_URL": "redis://127.0.0.1:1/0",
}


@pytest.fixture(autouse=True)
def _no_local_stores(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("ANIMASTOR_LOCAL_DIR", str(tmp_path / "none"))


@pytest.mark.parametrize("wait", ["nan", "inf", "-inf", "1e400", "-1", "soon"])
def test_a_lock_wait_that_is_no_finite_number_of_seconds_is_refused(wait: str) -> None:
    """`nan`, `inf` and `1e400` passed click's FloatRange: the migration's deadline was never reached, so behind a
    transaction left open it waited for ever instead of exiting 3."""
    result = CliRunner().invoke(main, ["db", "migrate", "--lock-wait", wait], env=NOWHERE)
    assert result.exit_code == 2 and "--lock-wait" in result.output, (wait, result.output)
