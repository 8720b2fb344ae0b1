"""`qwenfast serve --ray` stops cleanly on SIGTERM: exit 0 and no Ray task-failure report. It used to
end with serve.shutdown(), which kills the Serve controller under its own graceful_shutdown task, and
Ray printed "Task ServeController.graceful_shutdown failed. There are infinite retries remaining"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_serve_ray_sigterm_stops_without_a_failed_task_report(tmp_path):
    from tests.test_server import _free_port

    port, log = _free_port(), tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local cluster
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "qwenfast.cli", "serve", "--ray", "--device", "cpu", "--dtype", "fp32",
                             "--replicas", "1", "--num-cpus", "0.5", "--ingress-cpus", "0.25", "--port", str(port)],
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)  # fmt: skip
    try:
        for _ in range(300):  # a hang guard counted in polls (a loaded machine gets longer, never flakes)
            if "is ready at" in log.read_text():
                break
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(1)
        assert "is ready at" in log.read_text(), "the server did not come up:\n" + log.read_text()[-3000:]
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(180) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "stopped after" in text, text[-3000:]
    assert "graceful_shutdown failed" not in text and "retries remaining" not in text, text[-3000:]
