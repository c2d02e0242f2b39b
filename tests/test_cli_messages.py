"""What a newcomer reads: the HTTP 404 suggests close names as the CLI does, ``octo plugins`` sees ``--plugins-dir``,
every ``octo serve`` flag says what it does, and no start-up line prints Python's ``None``."""

from __future__ import annotations

from click.testing import CliRunner
from serverproc import REPO, run_octo

from octo.cli.main import cli
from octo.models.servable import unknown_model
from octo.runtime.selection import figures


def test_a_request_for_a_misspelt_model_gets_the_close_names():
    with run_octo("test-model", "--engine", "echo") as server:
        status, body = server.post_json("/v1/chat/completions",
                                        {"model": "dmeo", "messages": [{"role": "user", "content": "hi"}]})
        ollama = server.post_json("/api/chat", {"model": "qwen-2.5-05b", "messages": []})
    assert status == 404 and "Model 'dmeo' not found. Closest names: demo. Run `octo models`" in \
        body["error"]["message"], body
    assert ollama[0] == 404 and "Closest names: qwen-2.5-0.5b" in ollama[1]["error"], ollama
    assert "Closest" not in unknown_model("/etc/dmeo", ()).message  # a path: nothing that depends on names


def test_octo_plugins_lists_the_plugins_of_plugins_dir(monkeypatch):
    import octo.plugins

    monkeypatch.setattr(octo.plugins, "_pm", octo.plugins._pm)  # the plugin manager loaded here is put back after
    assert "request_log.py" not in CliRunner().invoke(cli, ["plugins"]).output
    out = CliRunner().invoke(cli, ["plugins", "--plugins-dir", str(REPO / "plugins")])
    assert out.exit_code == 0 and "request_log.py" in out.output and "register_routes" in out.output, out.output


def test_every_serve_flag_has_help_and_the_api_key_covers_every_api():
    from octo.cli.serve import serve

    assert all(p.help for p in serve.params if p.param_type_name == "option"), \
        [p.name for p in serve.params if p.param_type_name == "option" and not p.help]
    key = next(p for p in serve.params if p.name == "api_key")
    assert "/v1/*" not in key.help and "Ollama" in key.help and "Anthropic" in key.help


def test_a_phase_not_measured_reads_as_a_dash_not_none():
    text = figures({"prefill_tok_s": 310.5, "decode_tok_s": 41.0, "batch_decode_tok_s": None})
    assert text == "prefill 310.5 tok/s, decode 41 tok/s, batch x4 - tok/s" and "None" not in text
    assert figures({"speech_x_realtime": 24.1}) == "24.1x real time"
