"""Servers for the serve tests: ``python -m graphs.serve`` in a subprocess on a free loopback port,
with torch and transformers unimportable (test_no_torch's blocker), stopped at the end."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from conftest import REPO

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def render(messages: list[dict]) -> str:
    """What CHAT_TEMPLATE renders (the tests' expectation)."""
    return "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + "<|assistant|>"


def with_chat_template(export_dir: Path, dest: Path) -> Path:
    """A copy of an export with CHAT_TEMPLATE beside its graphs, hashed into its manifest (as export
    writes a model's chat_template.jinja)."""
    from graphs.manifest import Manifest

    if not dest.exists():
        shutil.copytree(export_dir, dest)
        manifest = Manifest.read(dest, verify=False)
        (dest / "chat_template.jinja").write_text(CHAT_TEMPLATE)
        manifest.write(dest)
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def blocked_env(tmp: Path) -> dict:
    from test_no_torch import SITECUSTOMIZE

    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(filter(None, [str(tmp), str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def get(url: str, timeout: float = 5.0, headers: dict | None = None) -> tuple[int, dict | str, dict]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body, status, hdrs = r.read().decode(), r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        body, status, hdrs = e.read().decode(), e.code, dict(e.headers)
    with contextlib.suppress(ValueError):
        body = json.loads(body)
    return status, body, hdrs


class Server:
    """``with Server(out_dir, tmp, "--max-running", "2") as s: s.url``: up (health 200) or an error."""

    def __init__(self, out_dir: Path, tmp: Path, *flags, startup: float = 90.0):
        self.out_dir, self.tmp, self.flags, self.startup = out_dir, tmp, [str(f) for f in flags], startup
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        self.log = open(self.tmp / f"server-{self.port}.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "graphs.serve", str(self.out_dir), "--port",
                                      str(self.port), "--threads", "1", "--log-level", "warning", *self.flags],
                                     cwd=REPO, env=blocked_env(self.tmp / "blocker"), stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            with contextlib.suppress(OSError):
                if get(self.url + "/health", timeout=2)[0] == 200:
                    return self
            time.sleep(0.2)
        self.__exit__()
        raise AssertionError(f"the server was not ready in {self.startup} s:\n{self.output()}")

    def health(self) -> dict:
        return get(self.url + "/health")[1]

    def metrics(self) -> str:
        return get(self.url + "/metrics")[1]

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Until no request holds a row, waits or is live in the worker; the last /health."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if h["running"] == 0 and h["waiting"] == 0 and h["live"] == 0:
                return h
            if time.monotonic() > deadline:
                raise AssertionError(f"the server is not idle after {timeout} s: {h}")
            time.sleep(0.05)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-5000:]

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


def metric(text: str, name: str, **labels) -> float:
    """The value of one Prometheus sample (0 if absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return 0.0
