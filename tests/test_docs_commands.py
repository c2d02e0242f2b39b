"""Every command README.md and docs/*.md show is run here against a real ``octo serve``, or is run by another test of
the suite, or is in the reviewed list of those that cannot run here, with the reason. A command the docs gain fails
``test_every_command_is_classified`` until it is put in one of the three tables below; an octo command line, run or
not, must name a command and options the CLI has.

A command is named by its text with whitespace collapsed (``Command.key``): a block of shell or Python as a whole, an
inline `octo ...` command by itself. Commands with placeholders (``octo serve MODEL``, ``octo engines [MODEL]``) are
syntax templates: checked against the CLI, never run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from doccheck import (
    REPO,
    Command,
    check_octo_syntax,
    commands,
    doc_pages,
    is_template,
    octo_argv,
    parse,
    script_options,
    shell_lines,
)
from serverproc import run_octo

VENV_BIN = Path(sys.executable).parent

# Run by this module (the value names the runner, below).
RUN = {
    # README's tour, against `octo serve demo` (what `make serve` starts)
    'from openai import OpenAI client = OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="none") reply = '
    'client.chat.completions.create(model="demo", max_tokens=32, messages=[{"role": "user", "content": "hi"}]) '
    'print(reply.choices[0].message.content)': "python",
    "curl -s http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\ -d '{\"model\": "
    "\"demo\", \"max_tokens\": 16, \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}'": "shell",
    "octo serve demo nomic-embed-text-v1.5 whisper-base": "offline start",
    "octo ps": "cli",
    "octo models": "cli",
    "octo engines": "cli",
    "octo plugins": "cli",
    "octo --version": "cli",
    "octo serve --help": "cli",
    "python -m octo.synth.whisper speech.wav": "shell",
    "python -m octo.synth.build NAME ENGINE": "synthetic build",  # docs/models.md: a template, run for the demo
    # docs/engines.md: the plugin hook and the engine tutorial
    "from octo.engine import Engine # the contract: tokenize, render_chat, step(feeds), kv_save/restore, embed from "
    "octo.hookspecs import hookimpl @hookimpl def register_engines(register): register(MyEngine)": "python fragment",
    "octo serve shout --plugins-dir docs/examples --engine upper curl -s localhost:8080/v1/completions -H "
    "'Content-Type: application/json' \\ -d '{\"model\": \"shout\", \"prompt\": \"hello\", \"max_tokens\": 8}' "
    "# -> \"HELLO\"": "serve, then shell",
    # models files and the record of pulls, read by the code that reads them
    "models: - qwen-2.5-0.5b:4bit - {model: ./speech.pt, pinned: true} - {model: nomic-embed-text-v1.5, engine: "
    "llamacpp, options: {n_threads: 1}, keep_alive: 10m} - {model: qwen-2.5-0.5b, replicas: 2, resources: "
    "{num_cpus: 4, memory_gb: 2}} # with --cluster": "models file",
    "# models.yaml for --models-file models: - qwen-2.5-0.5b:4bit - {model: ./speech.pt, pinned: true} - {model: "
    "nomic-embed-text-v1.5, engine: llamacpp, options: {n_threads: 1}, keep_alive: 10m}": "models file",
    "# models.yaml for --models-file with --cluster models: - {model: qwen-2.5-0.5b, replicas: 2, resources: "
    "{num_cpus: 4, memory_gb: 2}} - {model: whisper-tiny, autoscaling: {min: 1, max: 4, target: 2, "
    "upscale_delay_s: 10, downscale_delay_s: 120}}": "models file",
    '{"version": 1, "models": {"cat-tiny": {"files": ["/home/u/.cache/huggingface/hub/models--org--x/snapshots/C/'
    'x.gguf"], "at": 1767225600.0}}}': "record of pulls",
    "4bit: llamacpp: uri: hf://bartowski/google_gemma-3-4b-it-GGUF/google_gemma-3-4b-it-Q4_K_M.gguf mmproj: "
    "mmproj-google_gemma-3-4b-it-f16.gguf": "catalog excerpt",
}

# Run by another test of the suite ("tests/FILE.py::TEST").
COVERED = {
    "python -m octo.synth.whisper speech.wav # a clip to transcribe (spoken by espeak-ng if installed); any WAV will "
    "do curl -s http://127.0.0.1:8080/v1/audio/transcriptions -F model=demo-whisper -F file=@speech.wav":
        "tests/test_speech_offline_functional.py::test_the_readmes_transcription_example_works_offline_with_demo_whisper",
    "octo serve demo": "tests/test_demo_functional.py::test_serve_demo_offline_benchmarks_then_uses_the_cache",
    "octo serve demo-whisper":
        "tests/test_speech_offline_functional.py::test_the_readmes_transcription_example_works_offline_with_demo_whisper",
    "octo serve demo-vision": "tests/test_vision_functional.py::test_an_image_is_answered_and_the_answer_depends_on_it",
    'import base64 from openai import OpenAI client = OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="none") '
    'picture = base64.b64encode(open("photo.png", "rb").read()).decode() reply = client.chat.completions.create('
    'model="demo-vision", max_tokens=16, messages=[{"role": "user", "content": [ {"type": "text", "text": "What is in '
    'this picture?"}, {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{picture}"}}]}]) '
    'print(reply.choices[0].message.content, reply.usage.prompt_tokens_details.image_tokens)':
        "tests/test_vision_apis_functional.py::test_the_readmes_image_example_runs_as_written",
    "octo serve demo-vision --engine mlx":
        "tests/test_mlx_vision_functional.py::test_the_mlx_worker_serves_the_vision_model_without_torch",
    "python scripts/config_docs.py": "tests/test_docs.py::test_configuration_page_matches_serve_flags",
    "codex exec": "tests/test_codex_functional.py::test_codex_exec_runs_a_shell_command_through_responses",
    "claude -p": "tests/test_claude_code_functional.py::test_claude_code_runs_a_bash_command_through_messages",
    "ANTHROPIC_BASE_URL=http://127.0.0.1:8080 ANTHROPIC_API_KEY=any claude --model MODEL":
        "tests/test_claude_code_functional.py::test_claude_code_runs_a_bash_command_through_messages",
    "ANTHROPIC_BASE_URL=http://127.0.0.1:8080 ANTHROPIC_API_KEY=dummy claude --model MODEL":
        "tests/test_claude_code_functional.py::test_claude_code_runs_a_bash_command_through_messages",
}

# Not runnable here, and why. (Octo command lines among them are still checked against the CLI.)
CANNOT = {
    "make serve # creates .venv, installs octo and its engines (speech too), serves the synthetic demo model on :8080 "
    "make test # creates .venv, installs everything (apt: ffmpeg, espeak-ng, chromium), runs the whole test suite":
        "installs the venv (compiles llama.cpp, 10-15 minutes) and runs the whole suite; the targets are checked to "
        "exist in the Makefile",
    "make serve": "installs the venv; the target is checked to exist",
    "make serve LLAMACPP=no": "installs the venv without llama.cpp; the target is checked to exist",
    "PIP_FIND_LINKS=DIR make serve": "installs the venv from a folder of wheels (a template: DIR)",
    "sudo apt-get install python3-venv": "installs a system package (root, network)",
    "sudo apt-get install build-essential cmake": "installs system packages (root, network)",
    "make test": "runs the whole suite; the target is checked to exist",
    "make bench": "runs a benchmark suite (minutes of both cores, under the benchmark lock); the target is checked to "
                  "exist",
    "make bench SUITE=streams": "runs a benchmark suite (an hour of both cores); the target is checked to exist",
    "octo pull qwen-2.5-0.5b:4bit": "downloads a real model",
    "octo serve qwen-2.5-0.5b:4bit": "serves a real model, downloaded first",
    "octo serve qwen-2.5-0.5b whisper-tiny nomic-embed-text-v1.5": "serves real models, downloaded first",
    "octo pull whisper-base": "downloads a real model",
    "octo pull ggml-org/gemma-3-4b-it-GGUF": "downloads a real model",
    "octo serve whisper-base": "serves a real model, downloaded first",
    "octo serve ./model.gguf": "a GGUF file of the reader's",
    "octo serve --port 11434": "binds Ollama's port, which an Ollama on this host may hold",
    "sudo apt-get install ffmpeg": "installs a system package (root, network)",
    "pip install 'octo[speech]'": "downloads packages; the extra is checked to exist",
    "pip install 'octo[ray]'": "downloads packages; the extra is checked to exist",
    "pip install 'octo[ray,llamacpp,...]'": "downloads packages; the extras are checked to exist",
    "ray start --head --port 6379 --ray-client-server-port 10001": "a Ray cluster of several hosts "
                                                                     "(tests/test_cluster_functional.py: a local head)",
    "ray start --address HEAD:6379": "a Ray cluster of several hosts",
    "python -m mlx_vlm convert --hf-path HF --mlx-path OUT --dtype float32":
        "a template: what octo.synth.vision_mlx runs (tests/test_mlx_vision.py builds demo-vision's MLX folder)",
    "llama-server -m MODEL --mmproj MMPROJ": "llama.cpp's own server, built by bench/llama_server.py",
    "llama-server -hf": "llama.cpp's own server, downloading",
    ".venv/bin/python -m pytest -q tests/test_x.py -x -k NAME": "a template: run one test file while you work",
    # a program named in a sentence, not a command line
    "octo": "names the program",
    ".venv/bin/octo": "names the program",
    "python": "names the program",
    "octo serve": "names the command",
    "octo pull": "names the command",
    "octo bench": "names the command",
    "flock": "names the program",
    "flock /tmp/octo-bench.lock": "names the lock benchmarks take",
    "curl -d": "names curl's option",
    "pip download": "names pip's command",
    "python -m octo.runtime.worker": "names the worker process the gateway starts with its sockets",
}

# Classes of commands that cannot run here, by pattern.
CANNOT_PATTERNS = [
    (re.compile(r"(^|\s)(\S*/)?bench/\w+\.py\b"),
     "a benchmark: minutes of both cores under the benchmark lock (bench/run.py takes it; the script and its flags "
     "are checked to exist; tests/test_bench_runner.py drives the runner)"),
    (re.compile(r"(^|\s)(\S*/)?scripts/openwebui_check\.py\b"),
     "installs Open WebUI (3 GB) and drives it for minutes; not part of the suite (docs/testing.md says why)"),
]

SERVER_PORT = re.compile(r"\b(127\.0\.0\.1|localhost):8080\b")


def doc_commands() -> list[Command]:
    return [c for path in doc_pages() for c in commands(parse(path))]


def classification(cmd: Command) -> str | None:
    key = cmd.key
    if key in RUN:
        return "run"
    if key in COVERED:
        return "covered"
    if key in CANNOT or any(p.search(key) for p, _ in CANNOT_PATTERNS):
        return "cannot"
    argv = octo_argv(cmd.text) if cmd.kind == "shell" and "\n" not in cmd.text else None
    if argv is not None and is_template(argv):
        return "template"
    return None


def test_every_command_is_classified():
    missing = [f"{c.where}: {c.text!r}" for c in doc_commands() if classification(c) is None]
    assert not missing, ("commands in the docs that no test runs and no list explains: run them (RUN), name the test "
                         "that runs them (COVERED) or say why they cannot run here (CANNOT) in "
                         "tests/test_docs_commands.py:\n" + "\n".join(missing))


def test_no_table_names_a_command_the_docs_do_not_show():
    shown = {c.key for c in doc_commands()}
    stale = [k for table in (RUN, COVERED, CANNOT) for k in table if k not in shown]
    assert not stale, "tests/test_docs_commands.py lists commands the docs no longer show:\n" + "\n".join(stale)


def octo_lines(cmd: Command) -> list[str]:
    if cmd.kind != "shell":
        return []
    return [line for line in shell_lines(cmd.text) if octo_argv(line) is not None]


def test_every_octo_command_line_names_commands_and_options_the_cli_has():
    bad = []
    for cmd in doc_commands():
        for line in octo_lines(cmd):
            problem = check_octo_syntax(octo_argv(line))
            if problem:
                bad.append(f"{cmd.where}: `{line}`: {problem}")
    assert not bad, "\n".join(bad)


def test_covered_commands_name_tests_that_exist():
    bad = []
    for key, test in COVERED.items():
        file, _, name = test.partition("::")
        path = REPO / file
        if not path.is_file():
            bad.append(f"{key!r}: {file} does not exist")
        elif name and not re.search(rf"^(async )?def {re.escape(name)}\(", path.read_text(), re.M):
            bad.append(f"{key!r}: {file} has no function {name}")
    assert not bad, "\n".join(bad)


def test_script_commands_name_scripts_and_options_that_exist():
    """`bench/X.py --rounds 3`, `scripts/X.py --out DIR`: the script exists and declares each option given."""
    bad = []
    for cmd in doc_commands():
        for line in shell_lines(cmd.text) if cmd.kind == "shell" else []:
            words = shlex.split(line, comments=True)
            scripts = [w for w in words if re.fullmatch(r"(\./|\.venv/bin/)?(bench|scripts)/\w+\.(py|sh)", w)]
            if not scripts:
                continue
            script = REPO / re.sub(r"^(\./|\.venv/bin/)", "", scripts[0])
            if not script.is_file():
                bad.append(f"{cmd.where}: `{line}`: {scripts[0]} does not exist")
                continue
            after = words[words.index(scripts[0]) + 1:]
            options = script_options(script) if script.suffix == ".py" else set()
            unknown = [w for w in after if w.startswith("--") and w.split("=")[0] not in options]
            if unknown:
                bad.append(f"{cmd.where}: `{line}`: {scripts[0]} has no option {unknown[0]}")
    assert not bad, "\n".join(bad)


def test_make_targets_and_pip_extras_named_in_the_docs_exist():
    targets = set(re.findall(r"^([\w.-]+):", (REPO / "Makefile").read_text(), re.M))
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    bad = []
    for cmd in doc_commands():
        for line in shell_lines(cmd.text) if cmd.kind == "shell" else []:
            words = shlex.split(line, comments=True)
            if words[:1] == ["make"]:
                bad += [f"{cmd.where}: `{line}`: the Makefile has no target {t!r}" for t in words[1:]
                        if not t.startswith("-") and "=" not in t and t not in targets]
    for path in doc_pages():
        page = parse(path)
        for m in re.finditer(r"octo\[([\w,.-]+)\]", page.text):
            line = page.text.count("\n", 0, m.start()) + 1
            bad += [f"{path.name}:{line}: pyproject.toml has no extra {e!r} (octo[{m.group(1)}])"
                    for e in m.group(1).split(",") if e not in ("...", "") and e not in extras]
    assert not bad, "\n".join(bad)


# ---- running them --------------------------------------------------------------------------------------------------

def runnable() -> list[Command]:
    seen, out = set(), []
    for cmd in doc_commands():
        if cmd.key in RUN and cmd.key not in seen:
            seen.add(cmd.key)
            out.append(cmd)
    return out


@pytest.fixture(scope="module")
def demo():
    """`octo serve demo` (what `make serve` starts), offline, for the commands that talk to it."""
    with run_octo("demo", env={"HF_HUB_OFFLINE": "1"}, timeout=600) as server:
        yield server


def shell_env(port: int | None = None) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1"}
    if port:
        env["OCTO_PORT"] = str(port)
    return env


def run_shell(cmd: Command, text: str, port: int | None, cwd: Path) -> str:
    """Runs shell ``text`` (the docs' port replaced by ``port``) with this checkout's venv first on PATH; returns its
    output after checking it: exit status 0, no JSON error body, and what a ``# -> X`` comment says it prints."""
    if port:
        text = SERVER_PORT.sub(lambda m: f"{m.group(1)}:{port}", text)
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", text], cwd=cwd, env=shell_env(port),
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, \
        f"{cmd.where}: `{text}` failed ({proc.returncode}):\n{out[-2000:]}\n{proc.stderr[-3000:]}"
    for body in json_bodies(out):
        assert not (isinstance(body, dict) and "error" in body), f"{cmd.where}: `{text}` answered an error: {body}"
    for expected in re.findall(r"#\s*->\s*(.+)$", text, re.M):
        wanted = expected.strip().strip('"')
        assert wanted in out, f"{cmd.where}: `{text}` should print {wanted!r} (its comment says so), printed {out!r}"
    return out


def json_bodies(out: str) -> list:
    try:
        return [json.loads(out)]
    except ValueError:
        bodies = []
        for line in out.splitlines():
            try:
                bodies.append(json.loads(line))
            except ValueError:
                pass
        return bodies


CLI_PRINTS = {"octo ps": "demo", "octo models": "demo", "octo engines": "llamacpp", "octo plugins": "octo.engines",
              "octo --version": "octo, version", "octo serve --help": "--models-file"}


@pytest.mark.parametrize("cmd", runnable(), ids=lambda c: f"{c.where}:{c.key[:40]}")
def test_doc_command_runs(cmd: Command, request, tmp_path):
    how = RUN[cmd.key]
    if how == "python":
        server = request.getfixturevalue("demo")
        code = SERVER_PORT.sub(lambda m: f"{m.group(1)}:{server.port}", cmd.text)
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=shell_env(), capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, f"{cmd.where}: the Python example failed:\n{proc.stderr[-3000:]}"
        assert proc.stdout or "print(" not in code, f"{cmd.where}: printed nothing"
    elif how == "shell":
        port = request.getfixturevalue("demo").port if SERVER_PORT.search(cmd.text) else None
        out = run_shell(cmd, cmd.text, port, tmp_path)
        if "/v1/chat/completions" in cmd.text:
            assert json.loads(out)["choices"][0]["message"]["content"] is not None
        if "octo.synth.whisper" in cmd.text:
            assert (tmp_path / "speech.wav").read_bytes()[:4] == b"RIFF"
    elif how == "cli":
        port = request.getfixturevalue("demo").port if cmd.key == "octo ps" else None
        out = run_shell(cmd, cmd.text, port, tmp_path)
        assert CLI_PRINTS[cmd.key] in out, f"{cmd.where}: `{cmd.text}` printed:\n{out[-3000:]}"
    elif how == "serve, then shell":
        serve, *rest = shell_lines(cmd.text)
        argv = octo_argv(serve)
        assert argv and argv[0] == "serve", f"{cmd.where}: the block should start with `octo serve`"
        with run_octo(*argv[1:], env={"HF_HUB_OFFLINE": "1"}) as server:
            run_shell(cmd, "\n".join(rest), server.port, tmp_path)
    elif how == "synthetic build":
        out = run_shell(cmd, cmd.text.replace("NAME ENGINE", "demo llamacpp"), None, tmp_path)
        assert Path(json.loads(out.splitlines()[-1])["path"]).is_file(), out
    elif how == "catalog excerpt":
        catalog = (REPO / "models.yaml").read_text()
        assert cmd.text.strip("\n") in catalog, f"{cmd.where}: the excerpt is not in models.yaml as written"
    elif how == "python fragment":
        run_python_fragment(cmd)
    elif how == "models file":
        from octo.runtime.specs import load_models_file

        (tmp_path / "models.yaml").write_text(cmd.text)
        specs = load_models_file(str(tmp_path / "models.yaml"))
        assert len(specs) == cmd.text.count("\n  - ") + cmd.text.startswith("  - "), specs
    elif how == "record of pulls":
        check_record_of_pulls(cmd, tmp_path)
    elif how == "offline start":
        check_offline_start(cmd, tmp_path)
    else:
        raise AssertionError(f"no runner {how!r}")


def run_python_fragment(cmd: Command) -> None:
    """docs/engines.md's registration hook: its imports run, and the hook registers the engine class it names."""
    namespace: dict = {}
    exec(compile(cmd.text, cmd.where, "exec"), namespace)
    namespace["MyEngine"] = type("MyEngine", (namespace["Engine"],), {"name": "mine"})
    registered: list = []
    namespace["register_engines"](registered.append)
    assert registered == [namespace["MyEngine"]]
    assert hasattr(namespace["register_engines"], "octo_impl"), "the hook is not marked with octo's hookimpl"


def check_record_of_pulls(cmd: Command, tmp_path: Path) -> None:
    """docs/storage.md's record of pulls is a record octo reads (its files named inside a hub cache)."""
    code = ("import json, sys\nfrom octo.models import pulled\nrecord = pulled.load()\n"
            "print(json.dumps({k: list(v.files) for k, v in record.items()}))")
    home = tmp_path / "home"
    home.mkdir()
    (home / "pulled.json").write_text(cmd.text)
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OCTO_HOME": str(home)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    documented = json.loads(cmd.text)["models"]
    assert json.loads(proc.stdout.splitlines()[-1]) == {k: v["files"] for k, v in documented.items()}, proc.stderr
    assert "quarantine" not in proc.stderr and (home / "pulled.json").exists()


def check_offline_start(cmd: Command, tmp_path: Path) -> None:
    """README: offline, the models named that are not downloaded are reported once each with their reason, and the
    others serve."""
    argv = octo_argv(cmd.text)
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}  # nothing downloaded, no network
    with run_octo(*argv[1:], env=env, timeout=600) as server:
        ids = [m.id for m in server.openai().models.list().data]
        reply = server.openai().chat.completions.create(model="demo", max_tokens=4,
                                                        messages=[{"role": "user", "content": "hi"}])
        log = server.log()
    assert "demo" in ids and reply.choices[0].finish_reason in ("length", "stop")
    for missing in argv[2:]:
        assert log.count(f"octo: not serving '{missing}'") == 1, log[-3000:]
        assert log.count(f"octo pull {missing}") == 1, log[-3000:]
    assert "Traceback" not in log
