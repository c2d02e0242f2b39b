"""The docs say what the code does: docs/configuration.md's flag table is `octo serve`'s own options."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("config_docs", REPO / "scripts" / "config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_page_matches_serve_flags():
    docs = load_script()
    page = docs.DOC.read_text()
    assert page == docs.render(page), "docs/configuration.md is stale: run `python scripts/config_docs.py`"


def test_every_serve_flag_is_in_the_table():
    docs = load_script()
    from octo.cli.main import cli

    table = docs.flag_table()
    for param in cli.commands["serve"].params:
        if getattr(param, "opts", None) and not getattr(param, "hidden", False) and param.param_type_name == "option":
            assert f"`{param.opts[0]}`" in table


def test_readme_links_resolve():
    text = (REPO / "README.md").read_text()
    import re

    for target in re.findall(r"\]\(([^)#]+)\)", text):
        if not target.startswith("http"):
            assert (REPO / target).exists(), target


def test_engine_tutorial_example_serves():
    """docs/engines.md's engine plugin (docs/examples/upper_engine.py) through a real `octo serve`."""
    from serverproc import run_octo

    with run_octo("shout", "--plugins-dir", str(REPO / "docs" / "examples"), "--engine", "upper") as server:
        client = server.openai()
        out = client.completions.create(model="shout", prompt="hello there", max_tokens=32)
        assert out.choices[0].text == "HELLO THERE" and out.choices[0].finish_reason == "stop"
        cut = client.completions.create(model="shout", prompt="hello", max_tokens=3, stream=False)
        assert cut.choices[0].text == "HEL" and cut.choices[0].finish_reason == "length"
