"""The docs say what the code does: docs/configuration.md's flag table is `octo serve`'s own options; every link and
image of README.md and docs/*.md resolves (anchors included), every module, attribute and repository path they name
exists (tests/doccheck.py reads them out); tests/test_docs_commands.py runs their commands."""

from __future__ import annotations

import importlib.util
import re
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


def test_engine_tutorial_example_serves():
    """docs/engines.md's engine plugin (docs/examples/upper_engine.py) through a real `octo serve`."""
    from serverproc import run_octo

    with run_octo("shout", "--plugins-dir", str(REPO / "docs" / "examples"), "--engine", "upper") as server:
        client = server.openai()
        out = client.completions.create(model="shout", prompt="hello there", max_tokens=32)
        assert out.choices[0].text == "HELLO THERE" and out.choices[0].finish_reason == "stop"
        cut = client.completions.create(model="shout", prompt="hello", max_tokens=3, stream=False)
        assert cut.choices[0].text == "HEL" and cut.choices[0].finish_reason == "length"


# ---- what the pages name (tests/doccheck.py) ---------------------------------------------------------------------

# Paths the docs name that are placeholders, not files.
PLACEHOLDER_PATHS = {"tests/test_x.py": "docs/testing.md: run one test file while you work"}
# File names without a folder that are another project's (model folders' files, llama.cpp's and onnxruntime-genai's
# scripts) or the user's, not this repository's.
FOREIGN_FILES = {"tokenizer.json", "adapters.safetensors", "model.bin", "convert_hf_to_gguf.py", "builder.py",
                 "extra-openai-models.yaml", "pulled.json"}
CHECKED_NAME = re.compile(r"\w[\w.-]*\.(py|yaml|png)|(?=\w+[-_\d])\w[\w.-]*\.json")
FOREIGN_FILE_PATTERNS = re.compile(r".*config\.json|modeling_\w+\.py")


def pages():
    from doccheck import doc_pages, parse

    return [parse(p) for p in doc_pages()]


def test_links_and_images_resolve():
    from doccheck import check_links

    failures = check_links(pages())
    assert not failures, "\n".join(failures)


def test_module_paths_named_in_the_docs_exist():
    from doccheck import check_module_path, module_refs

    bad = [f"{s.where}: {s.text}: {why}" for page in pages() for s in module_refs(page)
           if (why := check_module_path(s.text))]
    assert not bad, "\n".join(bad)


def test_class_attributes_named_in_the_docs_exist():
    """`Engine.kv_room`, `Feed.mask`, `reasoning.ThinkSplitter`: a class (or module) of octo's that has it."""
    from doccheck import check_qualified_name

    bad = [f"{s.where}: `{s.text}`: {why}" for page in pages() for s in page.spans
           if (why := check_qualified_name(s.text))]
    assert not bad, "\n".join(bad)


def test_repository_paths_named_in_the_docs_exist():
    from doccheck import check_file_path, file_refs

    bad = [f"{s.where}: {why}" for page in pages() for s in file_refs(page)
           if s.text not in PLACEHOLDER_PATHS and (why := check_file_path(s.text))]
    assert not bad, "\n".join(bad)


def test_file_names_named_in_the_docs_exist():
    """A file named without its folder (`kvcache.py`, a result's `speech_engines.json`) is somewhere in the
    repository. (A plain name such as `result.json` or `tokenizer.json` is usually a file a program writes or a
    model folder holds: only names with `-`, `_` or a digit are checked among the JSON ones.)"""
    names = {p.name for root in ("octo", "engines", "plugins", "tests", "bench", "scripts", "docs")
             for p in (REPO / root).rglob("*")} | {p.name for p in REPO.iterdir()}
    bad = [f"{s.where}: `{s.text}` is no file of the repository" for page in pages() for s in page.spans
           if CHECKED_NAME.fullmatch(s.text) and s.text not in names and s.text not in FOREIGN_FILES
           and not FOREIGN_FILE_PATTERNS.fullmatch(s.text)]
    assert not bad, "\n".join(bad)


# Options the docs name that are another program's (llama-server's, docker's).
FOREIGN_OPTIONS = {"--draft-p-min": "llama-server's, docs/engines.md", "--network": "docker's, docs/ollama.md"}


def test_options_named_in_the_docs_exist():
    """A `--option` in the docs is octo's (a command's), a script's under bench/ or scripts/, or in FOREIGN_OPTIONS."""
    from doccheck import cli_options, script_options

    known = cli_options() | {o for folder in ("bench", "scripts") for f in (REPO / folder).glob("*.py")
                             for o in script_options(f)}
    bad = [f"{s.where}: `{s.text}`: no octo command, bench/ or scripts/ script has the option {m.group(1)}"
           for page in pages() for s in page.spans
           if (m := re.match(r"(--[a-z][\w-]*)", s.text)) and m.group(1) not in known
           and m.group(1) not in FOREIGN_OPTIONS]
    assert not bad, "\n".join(bad)


# ---- the checker itself -----------------------------------------------------------------------------------------

def test_anchors_follow_githubs_slugs():
    from doccheck import Page, github_slug

    assert github_slug("`octo bench`: the long benchmark beside the start-up one") == \
        "octo-bench-the-long-benchmark-beside-the-start-up-one"
    assert github_slug("The scheduler's parts") == "the-schedulers-parts"
    assert github_slug("Images (vision-language models)") == "images-vision-language-models"
    assert github_slug("A [link](x.md) and **bold** and `code_name`") == "a-link-and-bold-and-code_name"
    page = Page(Path("x.md"), "", headings=[(1, "Limits"), (5, "Limits"), (9, "Other")])
    assert page.anchors == {"limits", "limits-1", "other"}


def test_broken_links_anchors_images_and_domains_are_found(tmp_path):
    from doccheck import check_links, parse

    (tmp_path / "b.md").write_text("# B page\n\n## The scheduler's parts\n")
    (tmp_path / "a.md").write_text(
        "# A\n\nSee [b](b.md#the-schedulers-parts), [self](#a), [gone](c.md), [bad](b.md#the-scheduler-parts),\n"
        "![pic](pic.png), [out](https://example.org/x), [ok](https://github.com/x/y), `[not](a link).md`\n\n"
        "```\n[in a block](nowhere.md)\n```\n")
    failures = check_links([parse(tmp_path / "a.md")], root=tmp_path)
    assert len(failures) == 4, failures
    assert any("a.md:3" in f and "c.md" in f and "does not exist" in f for f in failures)
    assert any("#the-scheduler-parts" in f and "did you mean #the-schedulers-parts" in f for f in failures)
    assert any("image 'pic.png'" in f for f in failures)
    assert any("example.org" in f and "not a reviewed domain" in f for f in failures)


def test_a_missing_module_or_attribute_is_named():
    from doccheck import check_module_path, check_qualified_name

    assert check_module_path("octo.runtime.worker") is None
    assert check_module_path("octo.serving.media.load_images") is None
    assert check_module_path("octo.scheduler.admission.Scheduler._kick") is None  # inherited from EngineLoop
    assert check_module_path("octo.engines.llamacpp") is None  # engines/ is octo.engines
    assert "defines no 'cluster_replica'" in check_module_path("octo.cluster_replica")
    assert "defines no 'worker'" in check_module_path("octo.worker")
    assert "defines no 'build_whisper'" in check_module_path("octo.synth.build_whisper")
    assert "has no attribute 'nothing'" in check_module_path("octo.runtime.handle.Handle.nothing")
    assert check_qualified_name("Engine.kv_room") is None and check_qualified_name("WhisperModel.transcribe") is None
    assert "no class Engine" in check_qualified_name("Engine.kv_rooms")
    assert "no module anthropic.py" in check_qualified_name("anthropic.StreamBlocks")


def test_blocks_spans_and_commands_are_read_out(tmp_path):
    from doccheck import check_octo_syntax, commands, parse

    (tmp_path / "p.md").write_text(
        "Text with `octo serve demo --port\n9000` and `octo.runtime.worker`.\n\n"
        "1. a list item\n\n    its second paragraph, not code\n\n"
        "A paragraph:\n\n    flock /tmp/l .venv/bin/python bench/x.py \\\n        --rounds 3\n\n"
        "```python\nprint(1)\n```\n")
    page = parse(tmp_path / "p.md")
    assert [b.lang for b in page.blocks] == ["indented", "python"]
    cmds = [(c.line, c.kind, c.key) for c in commands(page)]
    assert (1, "shell", "octo serve demo --port 9000") in cmds
    assert (10, "shell", "flock /tmp/l .venv/bin/python bench/x.py \\ --rounds 3") in cmds
    assert (14, "python", "print(1)") in cmds
    assert check_octo_syntax(["serve", "demo", "--port", "9000", "-o", "n_threads=2"]) is None
    assert "has no option --bogus" in check_octo_syntax(["serve", "demo", "--bogus"])
    assert "no command 'frobnicate'" in check_octo_syntax(["frobnicate"])
