"""Ollama's ``POST /api/pull`` and ``DELETE /api/delete`` through a real `octo serve` and a local hub stand-in
(docs/security.md, docs/ollama.md): a pull takes catalog names only unless the operator opts in to Hugging Face ids
(``--allow-pull-hf``, within ``--max-pull-gb``: the hub's file sizes are checked before a byte is downloaded and the
bytes counted while downloading), with ``HF_TOKEN`` only for those pulls; what octo pulled is recorded, and a delete
removes only that, by the names /api/tags lists, after checking everything, so that a refused delete changes nothing.
Models are served by echo-like engines that take GGUF files (``ggufecho``; ``ggufslow`` writes a token every 0.1 s),
a plugin written by the test, so the tests need no inference library."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from hub_standin import HubStandin, gguf_bytes
from serverproc import REPO, run_octo

PLUGIN = """
import time

from octo.engines.echo import EchoEngine
from octo.hookspecs import hookimpl


class GgufEcho(EchoEngine):
    name = "ggufecho"
    formats = frozenset({"gguf"})


class GgufSlow(GgufEcho):
    name = "ggufslow"

    def step(self, feeds):
        time.sleep(0.1)
        return super().step(feeds)


@hookimpl
def register_engines(register):
    register(GgufEcho)
    register(GgufSlow)
"""
TOKEN = "hf_operator_token_4711"
SMALL = gguf_bytes()
BIG = gguf_bytes() + b"\0" * (2 << 20)  # 2 MB: over a 1 MB cap


class LyingHub(HubStandin):
    """A hub whose metadata (the tree listing) says each file is 100 times smaller than it is."""

    async def _tree(self, request):
        resp = await super()._tree(request)
        entries = json.loads(resp.body)
        for e in entries:
            if "size" in e:
                e["size"] //= 100
        from aiohttp import web

        return web.json_response(entries)


def call(server, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(server.url(path), data, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
            return r.status, json.loads(raw.splitlines()[-1]) if raw.strip() else {}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def pull(server, model: str) -> tuple[int, dict]:
    return call(server, "POST", "/api/pull", {"model": model, "stream": False})


def delete(server, model: str) -> tuple[int, dict]:
    return call(server, "DELETE", "/api/delete", {"model": model})


def catalog(tmp_path: Path) -> str:
    entries = [{"id": name, "task": "chat", "default_variant": "q8",
                "variants": {"q8": {engine: uri for engine in engines}}}
               for name, engines, uri in [("cat-tiny", ["ggufecho"], "hf://cat/Tiny-GGUF/tiny-Q8_0.gguf"),
                                          ("cat-slow", ["ggufslow"], "hf://cat/Slow-GGUF/slow-Q8_0.gguf"),
                                          ("cat-foreign", ["ggufecho"], "hf://cat/Foreign-GGUF/foreign-Q8_0.gguf"),
                                          ("cat-cli", ["ggufecho", "llamacpp"], "hf://cat/Cli-GGUF/cli-Q8_0.gguf")]]
    entries.append({"id": "demo", "task": "chat", "default_variant": "default",
                    "variants": {"default": {"echo": "synth://demo"}}})
    path = tmp_path / "models.yaml"
    path.write_text(json.dumps({"models": entries}))
    return str(path)


def cached(hf_home: Path, repo: str) -> list[Path]:
    """Every file of ``repo`` in the hub cache (snapshot links and blobs)."""
    folder = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    return sorted(p for p in folder.rglob("*") if p.is_file() or p.is_symlink()) if folder.exists() else []


def record(octo_home: Path) -> dict:
    path = octo_home / "pulled.json"
    return json.loads(path.read_text())["models"] if path.exists() else {}


@pytest.fixture
def hub():
    with HubStandin() as standin:
        for repo, name in [("cat/Tiny-GGUF", "tiny-Q8_0.gguf"), ("cat/Slow-GGUF", "slow-Q8_0.gguf"),
                           ("cat/Foreign-GGUF", "foreign-Q8_0.gguf"), ("org/Small-GGUF", "small-Q8_0.gguf"),
                           ("cat/Cli-GGUF", "cli-Q8_0.gguf")]:
            standin.add_repo(repo, {name: SMALL})
        standin.add_repo("org/Big-GGUF", {"big-Q8_0.gguf": BIG})
        yield standin


@pytest.fixture
def plugins(tmp_path) -> str:
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "ggufecho.py").write_text(PLUGIN)
    return str(folder)


@pytest.fixture
def env(hub, tmp_path):
    return {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "", "HF_TOKEN": TOKEN,
            "OCTO_HOME": str(tmp_path / "octo"), "OCTO_CATALOG": catalog(tmp_path)}


def test_a_pull_takes_catalog_names_and_nothing_else_by_default(hub, env, plugins, tmp_path):
    with run_octo("--plugins-dir", plugins, env=env) as s:
        for name in ("org/Small-GGUF", "org/Small-GGUF:Q8_0", "hf://org/Small-GGUF/small-Q8_0.gguf"):
            status, body = pull(s, name)
            assert status == 403 and "--allow-pull-hf" in body["error"], body
        assert hub.requests == []  # refused from the name alone: the hub (and the token) never asked
        unknown = pull(s, "no-such-model")
        assert unknown[0] == 404
        for name in ("/etc/passwd", "./x.gguf", "~/x.gguf", "rel/..", "../../etc", str(tmp_path / "hf"), "a/b/c"):
            status, body = pull(s, name)
            assert (status, body["error"].replace(name, "<M>")) == \
                (404, unknown[1]["error"].replace("no-such-model", "<M>")), name
        assert hub.requests == [] and not (tmp_path / "octo" / "pulled.json").exists()
        status, body = pull(s, "cat-tiny:latest")
        assert status == 200 and body == {"status": "success"}
        files = cached(tmp_path / "hf", "cat/Tiny-GGUF")
        assert files and set(record(tmp_path / "octo")["cat-tiny"]["files"]) == \
            {str(f) for f in files if "snapshots" in f.parts}
        assert f"Bearer {TOKEN}" in hub.authorizations  # the operator's token, for the catalog's pull
        out = s.openai(max_retries=0).completions.create(model="cat-tiny", prompt="hi there", max_tokens=4)
        assert out.choices


def test_hugging_face_ids_are_the_operators_opt_in_within_a_size_cap(hub, env, plugins, tmp_path):
    opt_in = {**env, "OCTO_ALLOW_PULL_HF": "1", "OCTO_MAX_PULL_GB": "0.001"}  # 1 MB, through the variables
    work = tmp_path / "work"
    (work / "org").mkdir(parents=True)
    (work / "org" / "local.gguf").write_bytes(SMALL)  # shaped like a Hugging Face id: a repository, never this file
    with run_octo("--plugins-dir", plugins, env=opt_in, cwd=work) as s:
        status, body = pull(s, "org/local.gguf")
        assert status == 404 and "not found" in body["error"], body
        assert [r for r in hub.requests if "local.gguf" in r[1]]  # asked of the hub (opted in), not the folder
        status, body = pull(s, "org/Small-GGUF")
        assert status == 200, body
        assert cached(tmp_path / "hf", "org/Small-GGUF") and "org/Small-GGUF" in record(tmp_path / "octo")
        hub.requests.clear()
        status, body = pull(s, "org/Big-GGUF")  # 2 MB by the hub's own metadata: refused before a byte
        assert status == 413 and "--max-pull-gb 0.001" in body["error"] and "nothing was downloaded" in body["error"]
        assert not any("/resolve/" in r[1] for r in hub.requests), hub.requests
        assert cached(tmp_path / "hf", "org/Big-GGUF") == []


def test_a_download_bigger_than_its_metadata_said_is_stopped_and_removed(env, plugins, tmp_path):
    with LyingHub() as liar:
        liar.add_repo("liar/Big-GGUF", {"big-Q8_0.gguf": BIG})  # the tree says 20 kB, the file is 2 MB
        lied = {**env, "HF_ENDPOINT": liar.url}
        with run_octo("--plugins-dir", plugins, "--allow-pull-hf", "--max-pull-gb", "0.001", env=lied) as s:
            status, body = pull(s, "liar/Big-GGUF")
            assert status == 413 and "more than the hub's metadata said" in body["error"], body
            assert any("/resolve/" in r[1] for r in liar.requests)  # it did start downloading
            assert cached(tmp_path / "hf", "liar/Big-GGUF") == []  # and nothing of it stayed
            assert "liar/Big-GGUF" not in record(tmp_path / "octo")
            assert s.proc.poll() is None


def _state(server, model: str) -> dict:
    return next((m for m in server.get_json("/v1/models")["data"] if m["id"] == model), {})


def test_delete_removes_only_what_octo_pulled_and_a_refusal_changes_nothing(hub, env, plugins, tmp_path):
    from huggingface_hub import hf_hub_download

    os.environ["HF_ENDPOINT"] = hub.url  # (huggingface_hub reads it at import: the call names it too)
    foreign = hf_hub_download("cat/Foreign-GGUF", "foreign-Q8_0.gguf", cache_dir=tmp_path / "hf" / "hub",
                              endpoint=hub.url)  # another program's download, in the same cache
    with run_octo("--plugins-dir", plugins, env=env) as s:
        for name in ("cat-tiny", "cat-slow"):
            assert pull(s, name)[0] == 200
        tiny = cached(tmp_path / "hf", "cat/Tiny-GGUF")
        # not octo's: a catalog model another program downloaded, a synthetic one, a path into the cache
        assert s.openai(max_retries=0).completions.create(model="cat-foreign", prompt="x", max_tokens=2).choices
        for name in ("cat-foreign:latest", "demo:latest"):
            status, body = delete(s, name)
            assert status == 400 and "was not pulled by octo" in body["error"], (name, body)
        unknown = delete(s, "no-such-model")
        for name in (foreign, str(tiny[0]), "org/Small-GGUF", "../hf"):
            status, body = delete(s, name)
            assert (status, body["error"].replace(name, "<M>")) == \
                (404, unknown[1]["error"].replace("no-such-model", "<M>")), name
        assert Path(foreign).exists() and cached(tmp_path / "hf", "cat/Tiny-GGUF") == tiny
        # busy: a stream in flight (a token every 0.1 s): refused, nothing unloaded or removed, the stream whole
        words = " ".join(f"w{i}" for i in range(60))
        stream = s.openai(max_retries=0).completions.create(model="cat-slow", prompt=words, stream=True,
                                                           max_tokens=100)
        first = next(iter(stream))
        assert _state(s, "cat-slow")["requests_in_flight"] == 1
        status, body = delete(s, "cat-slow:latest")
        assert status == 409 and "in flight" in body["error"], body
        assert _state(s, "cat-slow")["state"] == "ready" and cached(tmp_path / "hf", "cat/Slow-GGUF")
        assert "cat-slow" in record(tmp_path / "octo")
        text = (first.choices[0].text if first.choices else "") + "".join(c.choices[0].text for c in stream
                                                                           if c.choices)
        assert text.split() == words.split()
        # pulled, loaded and idle: unloaded, then exactly its files go
        assert s.openai(max_retries=0).completions.create(model="cat-tiny", prompt="x", max_tokens=2).choices
        assert _state(s, "cat-tiny")["state"] == "ready"
        status, _ = delete(s, "cat-tiny:latest")
        assert status == 200
        assert cached(tmp_path / "hf", "cat/Tiny-GGUF") == [] and "cat-tiny" not in record(tmp_path / "octo")
        assert _state(s, "cat-tiny").get("state") != "ready" and Path(foreign).exists()
        assert delete(s, "cat-tiny")[0] == 404  # gone: an unknown name now
        status, body = call(s, "POST", "/v1/completions", {"model": "cat-tiny", "prompt": "x"})
        assert status == 404 and "octo pull" in body["error"]["message"]


def test_a_model_named_at_start_is_not_deleted_and_octo_pull_records_too(env, plugins, tmp_path):
    out = subprocess.run([sys.executable, "-m", "octo.cli", "pull", "cat-cli", "-q", "--engine", "llamacpp"],
                         cwd=REPO, timeout=120, env={**os.environ, **env}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    files = cached(tmp_path / "hf", "cat/Cli-GGUF")
    assert set(record(tmp_path / "octo")["cat-cli"]["files"]) == {str(f) for f in files if "snapshots" in f.parts}
    with run_octo("cat-cli", "--engine", "ggufecho", "--plugins-dir", plugins, env=env) as s:
        status, body = delete(s, "cat-cli:latest")
        assert status == 409 and "named at start" in body["error"], body
        assert _state(s, "cat-cli")["state"] == "ready" and cached(tmp_path / "hf", "cat/Cli-GGUF") == files
