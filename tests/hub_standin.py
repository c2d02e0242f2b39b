"""A local stand-in for the Hugging Face hub, for offline tests (reach it through ``HF_ENDPOINT``).

It serves the endpoints huggingface_hub (2.x) calls, over synthetic in-memory files:

- ``GET /api/models/{org}/{name}[/revision/{rev}]``: repository info (``sha``, ``siblings``);
- ``GET /api/models/{org}/{name}/tree/{rev}[/{path}]``: the file listing (``recursive`` honoured);
- ``HEAD|GET /{org}/{name}/resolve/{rev}/{path}``: a file, with ``ETag``, ``X-Repo-Commit``,
  ``Content-Length`` and ``Range`` support; missing repos/revisions/files answer 404 with the hub's
  ``X-Error-Code`` (RepoNotFound, RevisionNotFound, EntryNotFound);
- ``HEAD|GET /files/{path}``: plain files (the non-hub URL artifacts), with ``Range`` support.

Every request is logged in ``requests`` as (method, path, Range header), its Authorization header in
``authorizations``. A path in ``break_once``
has its next full GET cut after half the body (the connection is dropped), to test resuming.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading

from aiohttp import web


class HubStandin:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.files: dict[str, bytes] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self.authorizations: list[str | None] = []
        self.break_once: set[str] = set()
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    # -- content -----------------------------------------------------------------------------
    def add_repo(self, repo_id: str, files: dict[str, bytes]) -> None:
        self.repos[repo_id] = dict(files)

    def add_file(self, path: str, data: bytes) -> str:
        """Serve ``data`` at ``/files/{path}``; returns its URL."""
        self.files[path.strip("/")] = data
        return f"{self.url}/files/{path.strip('/')}"

    def commit(self, repo_id: str) -> str:
        h = hashlib.sha1(repo_id.encode())
        for name, data in sorted(self.repos[repo_id].items()):
            h.update(name.encode() + hashlib.sha256(data).digest())
        return h.hexdigest()

    def file_requests(self) -> list[tuple[str, str, str | None]]:
        return [r for r in self.requests if "/resolve/" in r[1] or r[1].startswith("/files/")]

    # -- life cycle --------------------------------------------------------------------------
    def start(self) -> HubStandin:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="hub-standin", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the hub stand-in did not start")
        return self

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/models/{org}/{name}", self._info)
        app.router.add_get("/api/models/{org}/{name}/revision/{rev}", self._info)
        app.router.add_get("/api/models/{org}/{name}/tree/{rev}", self._tree)
        app.router.add_get("/api/models/{org}/{name}/tree/{rev}/{path:.+}", self._tree)
        app.router.add_get("/files/{path:.+}", self._plain)
        app.router.add_get("/{org}/{name}/resolve/{rev}/{path:.+}", self._resolve)
        app.middlewares.append(self._log)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self._loop = None

    def __enter__(self) -> HubStandin:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- handlers ----------------------------------------------------------------------------
    @web.middleware
    async def _log(self, request: web.Request, handler):
        self.requests.append((request.method, request.path, request.headers.get("Range")))
        self.authorizations.append(request.headers.get("Authorization"))
        return await handler(request)

    def _repo(self, request: web.Request) -> tuple[str, dict[str, bytes]]:
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        if repo not in self.repos:
            raise _error(404, "RepoNotFound", f"Repository {repo} not found")
        rev = request.match_info.get("rev", "main")
        if rev not in ("main", self.commit(repo)):
            raise _error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return repo, self.repos[repo]

    async def _info(self, request: web.Request) -> web.Response:
        repo, files = self._repo(request)
        return web.json_response(
            {
                "id": repo,
                "modelId": repo,
                "sha": self.commit(repo),
                "private": False,
                "siblings": [{"rfilename": name} for name in sorted(files)],
            }
        )

    async def _tree(self, request: web.Request) -> web.Response:
        repo, files = self._repo(request)
        base = request.match_info.get("path", "").strip("/")
        recursive = request.query.get("recursive", "false").lower() == "true"
        prefix = f"{base}/" if base else ""
        entries, folders = [], set()
        for name, data in sorted(files.items()):
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix) :]
            if "/" in rest and not recursive:
                folders.add(prefix + rest.split("/")[0])
                continue
            for i in range(rest.count("/")):
                folders.add(prefix + "/".join(rest.split("/")[: i + 1]))
            entries.append({"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()})
        entries += [
            {"type": "directory", "path": f, "oid": hashlib.sha1(f.encode()).hexdigest()} for f in sorted(folders)
        ]
        return web.json_response(entries)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        repo, files = self._repo(request)
        commit = self.commit(repo)
        path = request.match_info["path"]
        if path not in files:
            raise _error(404, "EntryNotFound", f"{path} does not exist", {"X-Repo-Commit": commit})
        return await self._send(request, files[path], {"X-Repo-Commit": commit})

    async def _plain(self, request: web.Request) -> web.StreamResponse:
        path = request.match_info["path"]
        if path not in self.files:
            raise web.HTTPNotFound()
        return await self._send(request, self.files[path], {})

    async def _send(self, request: web.Request, data: bytes, headers: dict[str, str]) -> web.StreamResponse:
        headers = {
            **headers,
            "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        status, start, end = 200, 0, len(data)
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", request.headers.get("Range", ""))
        if match:
            start = int(match[1])
            end = min(int(match[2]) + 1, len(data)) if match[2] else len(data)
            if start >= len(data):
                return web.Response(status=416, headers={"Content-Range": f"bytes */{len(data)}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        body = data[start:end]
        resp = web.StreamResponse(status=status, headers={**headers, "Content-Length": str(len(body))})
        if request.method == "HEAD":
            await resp.prepare(request)
            return resp
        await resp.prepare(request)
        if request.path in self.break_once and not match:
            self.break_once.discard(request.path)
            await resp.write(body[: len(body) // 2])
            await resp.drain() if hasattr(resp, "drain") else None
            request.transport.close()  # drop the connection mid-body
            return resp
        await resp.write(body)
        await resp.write_eof()
        return resp


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> web.HTTPException:
    cls = {404: web.HTTPNotFound}[status]
    return cls(
        headers={"X-Error-Code": code, "X-Error-Message": message, **(headers or {})},
        text=f'{{"error": "{message}"}}',
        content_type="application/json",
    )


def gguf_bytes(arch: str = "llama", context_length: int = 4096, pooling: bool = False) -> bytes:
    """A metadata-only GGUF file (no tensors): enough for format detection, not for inference."""
    import struct

    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s.encode())) + s.encode()

    kvs = [
        string("general.architecture") + struct.pack("<I", 8) + string(arch),
        string("general.name") + struct.pack("<I", 8) + string("synthetic"),
        string(f"{arch}.context_length") + struct.pack("<II", 4, context_length),
    ]
    if pooling:
        kvs.append(string(f"{arch}.pooling_type") + struct.pack("<II", 4, 1))
    kvs.append(string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2) + string("a") + string("b"))
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs)
