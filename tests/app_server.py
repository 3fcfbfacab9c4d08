"""Start the real app (python app.py) on a free port for a test; stop it after."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager

from helpers import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_app(*args: str, timeout: float = 120.0, env: dict[str, str] | None = None):
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", GRADIO_ANALYTICS_ENABLED="False", **(env or {}))
    proc = subprocess.Popen([sys.executable, "app.py", "--port", str(port), *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"app exited early:\n{proc.stdout.read()}")
            try:
                urllib.request.urlopen(url + "health", timeout=2)  # page or API only
                break
            except OSError:
                if time.time() > deadline:
                    raise TimeoutError("app did not start in time") from None
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
