"""Third-party engines register through the same pluggy hook as the built-ins and serve requests."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from serverproc import run_octo

PLUGIN = textwrap.dedent('''
    from octo.engines.echo import EchoEngine
    from octo.hookspecs import hookimpl


    class ReverseEngine(EchoEngine):
        """Echo, but the reply comes back word-reversed."""
        name = "reverse"

        def _reply(self, history):
            words = [self._pieces[t].strip() for t in super()._reply(history)][::-1]
            return [self._id(w if i == 0 else " " + w) for i, w in enumerate(words)]


    @hookimpl
    def register_engines(register):
        register(ReverseEngine)
''')


@pytest.fixture
def plugin_site(tmp_path):
    """A pip-installed-looking distribution exposing the plugin in the `octo` entry-point group."""
    site = tmp_path / "site"
    dist = site / "octo_reverse-0.1.dist-info"
    dist.mkdir(parents=True)
    (site / "octo_reverse.py").write_text(PLUGIN)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: octo-reverse\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[octo]\nreverse = octo_reverse\n")
    return site


def test_entry_point_engine_serves_a_request(plugin_site):
    env = {"PYTHONPATH": str(plugin_site)}
    with run_octo("m", "--engine", "reverse", env=env) as server:
        r = server.openai().chat.completions.create(model="m", messages=[{"role": "user", "content": "a b c"}])
        assert r.choices[0].message.content == "c b a"
        engines = json.loads(__import__("urllib.request").request.urlopen(server.url("/v1/engines")).read())
        assert engines["active"] == "reverse" and "reverse" in {e["name"] for e in engines["data"]}


def test_allowlist_blocks_plugins(plugin_site):
    env = {**os.environ, "PYTHONPATH": str(plugin_site), "OCTO_LOAD_PLUGINS": "something-else"}
    out = subprocess.run([sys.executable, "-m", "octo.cli", "serve", "m", "--engine", "reverse", "--port", "0"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode != 0 and "Unknown engine 'reverse'" in out.stderr


def test_plugins_dir_and_octo_plugins_command(tmp_path):
    (tmp_path / "reverse_plugin.py").write_text(PLUGIN)
    with run_octo("m", "--engine", "reverse", "--plugins-dir", str(tmp_path)) as server:
        r = server.openai().completions.create(model="m", prompt="x y z")
        assert r.choices[0].text == "z y x"
    out = subprocess.run([sys.executable, "-m", "octo.cli", "plugins", "--json"], capture_output=True, text=True,
                         timeout=60)
    rows = json.loads(out.stdout)
    echo = next(r for r in rows if r["name"] == "octo.engines.echo")
    assert echo["hooks"] == ["register_engines"]


def test_octo_engines_command_lists_all_engines():
    out = subprocess.run([sys.executable, "-m", "octo.cli", "engines", "--json"], capture_output=True, text=True,
                         timeout=60)
    rows = json.loads(out.stdout)["data"]
    assert {"echo", "llamacpp", "mlx", "onnx", "whisper"} <= {r["name"] for r in rows}
    assert next(r for r in rows if r["name"] == "echo")["available"] is True


def test_request_log_plugin_from_plugins_dir(tmp_path):
    from serverproc import REPO

    logfile = tmp_path / "requests.jsonl"
    with run_octo("m", "--engine", "echo", "--plugins-dir", str(REPO / "plugins"),
                  env={"OCTO_REQUEST_LOG": str(logfile)}) as server:
        server.openai().chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    lines = [json.loads(line) for line in logfile.read_text().splitlines()]
    chat = [entry for entry in lines if entry["path"] == "/v1/chat/completions"]
    assert chat and chat[0]["status"] == 200 and chat[0]["method"] == "POST"


def test_installed_version_reads_an_imported_module_else_the_metadata(monkeypatch):
    import sys
    import types
    from importlib.metadata import version

    from octo.plugins import installed_version

    assert installed_version("pluggy_not_a_module", "nope-dist", "pluggy") == version("pluggy")  # the first found
    assert installed_version("pluggy_not_a_module", "nope-dist") is None
    monkeypatch.setitem(sys.modules, "fake_engine_lib", types.SimpleNamespace(__version__="9.9"))
    assert installed_version("fake_engine_lib", "pluggy") == "9.9"  # imported: its own, no metadata read
