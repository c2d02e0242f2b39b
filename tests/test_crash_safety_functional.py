"""kill -9 in the middle of a synthetic-model build, a download and a start-up benchmark, then start again: it
works, and the cache holds no temporary or half-written file and no lock that a live process does not hold.

Each victim is a real process (``python -c`` calling the build or download code, or ``octo serve``); the kill lands
when its temporary file (or its engine's first benchmark step) is seen, found by polling.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hub_standin import HubStandin, gguf_bytes
from serverproc import REPO, run_octo
from serverproc import children as _children

from octo.atomic import is_locked, is_temp
from octo.synth.spec import get_spec

PLUGINS = str(REPO / "tests" / "plugins")
PARTIAL = (".incomplete", ".part", ".tmp")


def leftovers(root: Path) -> list[Path]:
    """Temporary or partial files under ``root`` (octo's, huggingface_hub's, and the old ``*.tmp`` names)."""
    return [p for p in root.rglob("*") if is_temp(p.name) or p.name.endswith(PARTIAL)]


def held_locks(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.lock") if is_locked(p)]


def spawn(code: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **env}, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_when(proc: subprocess.Popen, seen, timeout: float = 60.0) -> None:
    """SIGKILL ``proc`` as soon as ``seen()`` is true (polled every millisecond); fails if it ends first."""
    deadline = time.monotonic() + timeout
    while not seen():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the process ended (exit {proc.returncode}) before the point to kill it at:\n{err[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the point to kill the process at never came")
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL


def finish(code: str, env: dict[str, str], timeout: float = 120.0) -> str:
    proc = spawn(code, env)
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out.strip().splitlines()[-1]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- a synthetic-model build -------------------------------------------------------------------------
BUILD = "from octo.synth import build_for; print(build_for('demo', 'llamacpp'))"


def test_killed_synthetic_builds_leave_nothing_half_written(tmp_path):
    home = tmp_path / "octo"
    env = {"OCTO_HOME": str(home)}
    synth = home / "synth"

    def temp_in(folder: Path, name: str):
        def seen() -> bool:
            try:
                return any(n.startswith(f".{name}") and is_temp(n) for n in os.listdir(synth / folder))
            except OSError:
                return False
        return seen

    # first: while the tokenizer trains, under its build lock (which the kill must not leave stale)
    kill_when(spawn(BUILD, env), lambda: any(is_locked(p) for p in (home / "locks").glob("tokenizer.json-*")))
    assert not (synth / "tokenizer-v1" / "tokenizer.json").exists()
    # then once in each of the two stages that write into a temporary: the HF folder and the GGUF file
    home_of_demo = f"{get_spec('demo').cache_name}-s0-float32"  # (its builds' folder: octo.synth.hf.default_dir)
    for folder, name in [(home_of_demo, "hf"), (f"{home_of_demo}/gguf-v1", "demo-f16.gguf")]:
        kill_when(spawn(BUILD, env), temp_in(Path(folder), name))
        assert [p for p in leftovers(synth) if p.name.startswith(f".{name}")], f"killed outside {name}'s build"
        assert not (synth / folder / name).exists()  # never a half-written result under the real name
    built = Path(finish(BUILD, env))
    assert leftovers(home) == [] and held_locks(home) == []
    assert (synth / home_of_demo / "hf" / ".complete").is_file()
    # the same bytes as an uninterrupted build (the build is deterministic: fixed seed)
    clean = Path(finish(BUILD, {"OCTO_HOME": str(tmp_path / "clean")}))
    assert built != clean and sha256(built) == sha256(clean)


# -- a download --------------------------------------------------------------------------------------
class SlowHub(HubStandin):
    """The hub stand-in, sending file bodies 64 KiB at a time with a pause between chunks."""

    pause = 0.05

    async def _send(self, request, data, headers):
        if request.method == "HEAD" or len(data) < 1 << 20:
            return await super()._send(request, data, headers)
        from aiohttp import web

        start = 0
        rng = request.headers.get("Range", "")
        if rng.startswith("bytes=") and rng.endswith("-"):
            start = int(rng[6:-1])
        headers = {**headers, "ETag": f'"{hashlib.sha256(data).hexdigest()}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream", "Content-Length": str(len(data) - start)}
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        resp = web.StreamResponse(status=206 if start else 200, headers=headers)
        await resp.prepare(request)
        for i in range(start, len(data), 1 << 16):
            await resp.write(data[i:i + (1 << 16)])
            await asyncio.sleep(self.pause)
        await resp.write_eof()
        return resp


@pytest.fixture
def slow_hub(tmp_path):
    with SlowHub() as hub:
        yield hub, {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "OCTO_HOME": str(tmp_path / "octo"),
                    "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1"}


FETCH = ("import sys; from octo.models.catalog import Artifact; from octo.models.download import fetch; "
         "print(fetch(Artifact(sys.argv[1], sys.argv[2], sys.argv[3]), progress=False))")


SMALL_WRITES = "import huggingface_hub.constants as c; c.DOWNLOAD_CHUNK_SIZE = 1 << 16\n"


def fetch_code(engine: str, uri: str, fmt: str) -> str:
    return f"import sys; sys.argv[1:] = {[engine, uri, fmt]!r}\n" + FETCH


def test_a_killed_hub_download_is_redone_and_its_partial_blob_removed(slow_hub, tmp_path):
    hub, env = slow_hub
    data = gguf_bytes() + os.urandom(3 << 20)  # 48 chunks: about a second to send
    hub.add_repo("org/Big-GGUF", {"Big-Q4_K_M.gguf": data})
    # huggingface_hub writes its temporary blob 10 MiB at a time (constants.DOWNLOAD_CHUNK_SIZE), so a 3 MiB body
    # lands in one write just before the rename: the kill would race that instant. 64 KiB writes give a partial
    # blob for the whole transfer, as a real multi-GiB download has.
    code = SMALL_WRITES + fetch_code("llamacpp", "hf://org/Big-GGUF/Big-Q4_K_M.gguf", "gguf")
    blobs = tmp_path / "hf" / "hub" / "models--org--Big-GGUF" / "blobs"

    def partial() -> bool:  # huggingface_hub's temporary blob, with part of the body in it
        try:
            return any(e.name.endswith(".incomplete") and e.stat().st_size > (1 << 18) for e in os.scandir(blobs))
        except OSError:
            return False

    kill_when(spawn(code, env), partial)
    assert [p for p in leftovers(tmp_path / "hf") if p.name.endswith(".incomplete")]  # what the kill left
    path = Path(finish(code, env))
    assert path.read_bytes() == data
    assert leftovers(tmp_path) == [] and held_locks(tmp_path) == []


def test_a_killed_url_download_resumes_and_leaves_no_part_file(slow_hub, tmp_path):
    hub, env = slow_hub
    data = os.urandom(3 << 20)
    url = hub.add_file(f"models/{hashlib.sha256(data).hexdigest()}/tiny.pt", data)
    # 64 KiB writes, as in the hub test above: with huggingface_hub's 10 MiB chunks the whole body lands in one
    # write just before the rename, and the kill would race that instant
    code = SMALL_WRITES + fetch_code("whisper", url, "whisper")
    dest = tmp_path / "octo" / "downloads"

    def part() -> bool:
        return any(p.name.endswith(".part") and p.stat().st_size > (1 << 18) for p in dest.rglob("*"))

    kill_when(spawn(code, env), part)
    seen = len(hub.requests)
    path = Path(finish(code, env))
    assert path.read_bytes() == data
    ranges = [r for m, p, r in hub.requests[seen:] if m == "GET" and p.startswith("/files/")]
    assert ranges and ranges[0] and ranges[0].startswith("bytes=") and ranges[0] != "bytes=0-"  # resumed
    assert leftovers(tmp_path) == [] and held_locks(tmp_path) == []


# -- a start-up benchmark ----------------------------------------------------------------------------
def timed_catalog(tmp_path: Path, order: tuple[str, ...]) -> str:
    path = tmp_path / "models.yaml"
    engines = "".join(f"        {e}: none://timed\n" for e in order)
    path.write_text("models:\n  - id: timed-model\n    task: chat\n    default_variant: default\n    variants:\n"
                    f"      default:\n{engines}")
    return str(path)


def gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_a_killed_start_up_benchmark_is_finished_by_the_next_start(tmp_path):
    home = tmp_path / "octo"
    mark = tmp_path / "mark"
    env = {**os.environ, "OCTO_HOME": str(home), "OCTO_CATALOG": timed_catalog(tmp_path, ("slowone", "fastone"))}
    args = ["timed-model", "--plugins-dir", PLUGINS, "--bench-seconds", "0.5", "--port", "0"]
    proc = subprocess.Popen([sys.executable, "-m", "octo.cli", "serve", *args, "-o", f"timed_mark={mark}"],
                            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []

    def measuring_the_second() -> bool:  # slowone's result is stored; fastone's worker is measuring
        workers[:] = _children(proc.pid) or workers
        return Path(f"{mark}.fastone").exists()

    kill_when(proc, measuring_the_second)
    assert workers and all(gone(w) for w in workers)  # the gateway's workers died with it
    stored = sorted(p.name.split("-")[0] for p in (home / "bench").glob("*.json"))
    # only a finished measurement can be stored (slowone's is not when other load disturbed it: this host is shared)
    assert stored in (["slowone"], [])
    # the same -o options: they are part of the benchmark cache's key (a result measured under other options is
    # not this start's)
    with run_octo(*args[:-2], "-o", f"timed_mark={mark}",
                  env={"OCTO_HOME": str(home), "OCTO_CATALOG": env["OCTO_CATALOG"]}) as server:
        log = server.log()
        assert "bench fastone   loading and measuring" in log
        assert ("bench slowone   cached" in log) == bool(stored)
        assert server.get_json("/v1/engines")["active"] == "fastone"
    for f in (home / "bench").glob("*.json"):
        data = json.loads(f.read_text())
        assert data["result"]["conditions"]["budget_s"] == 0.5, f
    assert leftovers(home) == [] and held_locks(home) == []


# -- the helpers themselves --------------------------------------------------------------------------
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_sweep_removes_only_what_dead_writers_left(tmp_path):
    from octo.atomic import TMP_MARK, sweep, write_text

    dead, live = _dead_pid(), os.getppid()
    (tmp_path / f".a.json{TMP_MARK}{dead}-00").write_text("half")
    (tmp_path / f".a.json{TMP_MARK}{live}-00").write_text("being written")
    (tmp_path / f".b{TMP_MARK}{dead}-00").mkdir()
    assert sorted(p.name for p in sweep(tmp_path, "a.json")) == [f".a.json{TMP_MARK}{dead}-00"]
    write_text(tmp_path / "b", "whole")  # a write sweeps its own target's leftovers first
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".a.json{TMP_MARK}{live}-00", "b"]
    assert (tmp_path / "b").read_text() == "whole"


def test_a_pid_lock_file_whose_holder_died_is_broken(tmp_path):
    from octo.atomic import _pid_lock

    stale = tmp_path / "x.lock.pid"
    stale.write_text(f"{_dead_pid()}\n")
    with _pid_lock(stale, time.monotonic() + 5, 0.01):
        assert stale.read_text().strip() == str(os.getpid())
    assert not stale.exists()
    stale.write_text(f"{os.getppid()}\n")  # a live holder: waited for, then a time-out
    with pytest.raises(TimeoutError):
        with _pid_lock(stale, time.monotonic() + 0.2, 0.01):
            pass
