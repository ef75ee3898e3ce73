"""`animastor-tasks dev-inference-server` on a port it cannot have: a clear error and exit code 2, no traceback."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest


@pytest.mark.parametrize("why", ["taken", "out of range"])
def test_a_port_it_cannot_listen_on_is_a_clear_error(why: str) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1] if why == "taken" else 70000
        proc = subprocess.run(
            [sys.executable, "-m", "animastor_tasks.operator.cli", "dev-inference-server", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and str(port) in proc.stderr, proc.stderr


@pytest.mark.parametrize("option", ["--retry-after", "--latency"])
@pytest.mark.parametrize("seconds", ["inf", "nan", "-1"])
def test_seconds_that_are_no_finite_number_are_refused(option: str, seconds: str) -> None:
    """`--retry-after inf` was taken (the server sent `Retry-After: inf` with its injected 503s), as was `--latency
    inf` (every request slept for ever); `nan` was a traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "animastor_tasks.operator.cli", "dev-inference-server", option, seconds],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and option in proc.stderr, proc.stderr
