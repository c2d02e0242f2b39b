"""Start a real ``octo serve`` process on a free port for functional tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the conversation the engine functional tests share: a long system prompt (prefix-cache hits) and short turns
SYSTEM = ("You are a careful assistant. The old lighthouse stood at the edge of the harbor, and every evening "
          "the keeper climbed the narrow stairs to light the lamp. Answer briefly and never forget the rocks.")
QUESTIONS = ["What does the keeper do?", "Where are the rocks?", "Tell me about the harbor.", "Hello!"]


def chat_messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def check_stop_string_and_max_tokens(server: OctoServer, model: str) -> None:
    """max_tokens ends with "length"; a stop string taken from that text cuts it just before the string."""
    client = server.openai()
    full = client.completions.create(model=model, prompt="The old lighthouse", max_tokens=24, temperature=0)
    text = full.choices[0].text
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 24
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = client.completions.create(model=model, prompt="The old lighthouse", max_tokens=24, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[:text.index(stop)]


def rss_tree(pid: int) -> int:
    """Resident memory of process ``pid`` and its children (a gateway and its engine workers), in bytes."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(stat.parent.name) == pid or int(fields[1]) == pid:
                for line in (stat.parent / "status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            continue
    return total


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def children(pid: int) -> list[int]:
    """The pids of the direct children of process ``pid`` (a gateway's engine workers)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class OctoServer:
    port: int
    proc: subprocess.Popen
    log_path: Path
    api_key: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def openai(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=self.api_key or "none", **kw)

    def async_openai(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key=self.api_key or "none", **kw)

    def get_json(self, path: str) -> dict:
        """The JSON body of a GET, error statuses included (/health answers 503 with a body when a model is down)."""
        return self.get_status(path)[1]

    def get_status(self, path: str) -> tuple[int, dict]:
        import json
        import urllib.error

        try:
            with urllib.request.urlopen(self.url(path), timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def post_json(self, path: str, body: dict) -> tuple[int, dict]:
        """(status, JSON body) of a POST, error statuses included."""
        import json
        import urllib.error

        req = urllib.request.Request(self.url(path), json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def run_octo(*args: str, env: dict[str, str] | None = None, timeout: float = 180.0, api_key: str | None = None,
             cwd: str | os.PathLike | None = None, unset: tuple[str, ...] = ()):
    """``octo serve ARGS --port P`` (in ``cwd``, by default the repository; ``unset``: variables of this process's
    environment it does not get); waits for /health, yields an OctoServer, stops it afterwards."""
    port = free_port()
    cmd = [sys.executable, "-m", "octo.cli", "serve", *args, "--port", str(port)]
    if "--shutdown-timeout" not in args:  # tests end with requests in flight on purpose: drain briefly
        cmd += ["--shutdown-timeout", "2"]
    if api_key:
        cmd += ["--api-key", api_key]
    log = tempfile.NamedTemporaryFile("wb", prefix="octo-serve-", suffix=".log", delete=False)
    base = {k: v for k, v in os.environ.items() if k not in unset}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**base, **(env or {})},
                            cwd=cwd or REPO)
    server = OctoServer(port, proc, Path(log.name), api_key)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"octo serve exited with {proc.returncode}:\n{server.log()}")
            try:
                with urllib.request.urlopen(server.url("/health"), timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"octo serve did not become healthy in {timeout}s:\n{server.log()}")
            time.sleep(0.1)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        os.unlink(log.name)


@contextlib.contextmanager
def run_tiny_gguf(*args: str):
    """``octo serve`` of the tiny random-weight GGUF on llama.cpp with constrained decoding (``server.model`` set);
    the calling test skips without llama-cpp-python or llguidance."""
    import pytest

    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    pytest.importorskip("llguidance")
    from octo.synth.gguf import build_gguf

    with run_octo(str(build_gguf("tiny", ftype="q8_0")), "--engine", "llamacpp", *args) as s:
        s.model = s.openai().models.list().data[0].id
        yield s
