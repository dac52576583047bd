"""Run a real `pagedserve serve` in a subprocess for tests: free port on 127.0.0.1, wait for
/health, kill at the end (the log is printed when startup fails)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    def __init__(self, model_dir, args: list[str] = (), env: dict | None = None, api_key: str | None = None):
        self.port = free_port()
        self.host = "127.0.0.1"
        self.api_key = api_key
        self.base_url = f"http://{self.host}:{self.port}"
        model = ["--model", str(model_dir)] if model_dir is not None else []  # None: the embedded default
        cmd = [sys.executable, "-m", "pagedserve", "serve", *model,
               "--host", self.host, "--port", str(self.port), *map(str, args)]
        full_env = dict(os.environ)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env.update(env or {})
        self._log = tempfile.NamedTemporaryFile("w+", prefix="pagedserve-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=str(REPO))

    # -- lifecycle --------------------------------------------------------------------------------
    def wait_ready(self, timeout: float = 180.0) -> "RemoteServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during startup:\n{self.log()}")
            try:
                if httpx.get(self.url("/health"), timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server did not become healthy in {timeout}s:\n{self.log()}")

    def log(self, tail: int = 8000) -> str:
        try:
            return Path(self._log.name).read_text()[-tail:]
        except OSError:
            return ""

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        with_log = os.environ.get("PAGEDSERVE_KEEP_SERVER_LOGS")
        if not with_log:
            try:
                os.unlink(self._log.name)
            except OSError:
                pass

    def __enter__(self):
        return self.wait_ready()

    def __exit__(self, *exc):
        self.stop()

    # -- clients ------------------------------------------------------------------------------------
    def url(self, path: str) -> str:
        return self.base_url + path

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw):
        import openai

        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 60)
        return openai.OpenAI(base_url=self.url("/v1"), api_key=self.api_key or "EMPTY", **kw)

    def async_client(self, **kw):
        import openai

        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 60)
        return openai.AsyncOpenAI(base_url=self.url("/v1"), api_key=self.api_key or "EMPTY", **kw)

    def metrics(self) -> dict:
        """{(sample name, frozenset(labels.items())): value} from /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url("/metrics"), timeout=10).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, frozenset(s.labels.items()))] = s.value
        return out


def metric(m: dict, name: str, **labels) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in m.items() if n == name and want <= set(ls))
