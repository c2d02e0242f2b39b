"""What the docs name, read out of README.md and docs/*.md so that tests can check it against the repository.

A page is parsed into its code blocks (fenced, and indented ones), its inline code spans, its links and images and
its headings (GitHub's anchors). Checks built on them return failure messages that name the file and line:

- ``check_links``: relative links and images resolve, ``#anchor`` fragments match a heading of the target page (by
  GitHub's slug rules), external links go to a reviewed domain (nothing is fetched);
- ``check_module_path``: a dotted ``octo.…`` path names a module of this repository and, after it, attributes that
  its source defines (read with ``ast``: nothing is imported or executed);
- ``check_file_path``: a repository path (``octo/…``, ``engines/…``, ``tests/…``, ``bench/…``...) exists;
- ``commands``: the shell and Python commands the docs show, each with its file and line, for tests/test_docs.py
  to run or to find in its reviewed list of the ones that cannot run here.
"""

from __future__ import annotations

import ast
import functools
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]


def doc_pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def rel(path: Path) -> str:
    """``path`` as the repository names it (absolute outside it)."""
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


@dataclass(frozen=True)
class Block:
    """A code block: ``lang`` is the fence's info string ('' for none, 'indented' for an indented block)."""
    path: Path
    line: int  # the first line of its content, 1-based
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{rel(self.path)}:{self.line}"


@dataclass(frozen=True)
class Span:
    """An inline code span (its text with line breaks as spaces), or a dotted name or path in the prose."""
    path: Path
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{rel(self.path)}:{self.line}"


@dataclass(frozen=True)
class Link:
    path: Path
    line: int
    target: str
    image: bool

    @property
    def where(self) -> str:
        return f"{rel(self.path)}:{self.line}"


@dataclass
class Page:
    path: Path
    text: str
    blocks: list[Block] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    headings: list[tuple[int, str]] = field(default_factory=list)
    prose: str = ""  # the text with code blocks blanked (line numbers kept)

    @property
    def anchors(self) -> set[str]:
        seen: dict[str, int] = {}
        out = set()
        for _, heading in self.headings:
            slug = github_slug(heading)
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
        return out


FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})\s*([^`\s]*)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s")


@functools.cache
def parse(path: Path) -> Page:
    text = path.read_text()
    lines = text.split("\n")
    page = Page(path, text)
    prose = list(lines)
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line)
        if fence:
            marker, lang = fence.group(2), fence.group(3)
            j = i + 1
            while j < len(lines) and not lines[j].lstrip().startswith(marker[0] * len(marker)):
                j += 1
            indent = len(fence.group(1))
            body = [ln[indent:] if ln[:indent].isspace() else ln for ln in lines[i + 1:j]]
            page.blocks.append(Block(path, i + 2, lang, "\n".join(body)))
            for k in range(i, min(j + 1, len(lines))):
                prose[k] = ""
            i = j + 1
            continue
        if (line.startswith("    ") and line.strip() and i > 0 and not lines[i - 1].strip()
                and not in_list(lines, i)):
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            while not lines[j - 1].strip():
                j -= 1
            page.blocks.append(Block(path, i + 1, "indented", "\n".join(ln[4:] for ln in lines[i:j])))
            for k in range(i, j):
                prose[k] = ""
            i = j
            continue
        heading = HEADING.match(line)
        if heading:
            page.headings.append((i + 1, heading.group(2)))
        i += 1
    page.prose = "\n".join(prose)
    blanked = page.prose
    for m in re.finditer(r"(`+)(.+?)(?<!`)\1(?!`)", page.prose, re.S):
        if "\n\n" in m.group(2):
            continue
        line_no = page.prose.count("\n", 0, m.start()) + 1
        page.spans.append(Span(path, line_no, re.sub(r"\s*\n\s*", " ", m.group(2).strip())))
        blanked = blanked[:m.start()] + re.sub(r"[^\n]", " ", m.group(0)) + blanked[m.end():]
    for m in re.finditer(r"(!?)\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", blanked):
        page.links.append(Link(path, blanked.count("\n", 0, m.start()) + 1, m.group(3), bool(m.group(1))))
    return page


def in_list(lines: list[str], i: int) -> bool:
    """Whether the indented line ``i`` continues a list item (a paragraph of it), not a code block."""
    for k in range(i - 1, -1, -1):
        if not lines[k].strip():
            continue
        if LIST_ITEM.match(lines[k]):
            return True
        if not lines[k].startswith(" "):
            return False
    return False


# ---- anchors and links -------------------------------------------------------------------------------------------

def heading_text(markdown: str) -> str:
    """A heading's text as GitHub renders it: links by their text, code and emphasis markers gone."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", markdown)
    text = re.sub(r"`+([^`]*)`+", r"\1", text)
    text = re.sub(r"(\*\*|__)(.+?)\1", r"\2", text)
    text = re.sub(r"(?<!\w)[*_](.+?)[*_](?!\w)", r"\1", text)
    return re.sub(r"<[^>]+>", "", text)


def github_slug(markdown: str) -> str:
    """GitHub's anchor for a heading: lower case, anything but letters, digits, '_', '-' and spaces dropped, spaces
    as '-' (a repeated heading gets -1, -2... in ``Page.anchors``)."""
    text = heading_text(markdown).strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in "_- ")
    return text.replace(" ", "-")


# External links are not fetched (no network in the suite); each goes to a domain reviewed here.
EXTERNAL_DOMAINS = {
    "github.com": "source repositories the docs cite",
    "docs.ray.io": "Ray Serve's documentation",
}


def check_links(pages: list[Page], root: Path = REPO) -> list[str]:
    failures = []
    for page in pages:
        for link in page.links:
            failures += check_link(page, link, root)
    return failures


def check_link(page: Page, link: Link, root: Path = REPO) -> list[str]:
    what = "image" if link.image else "link"
    target = link.target
    scheme = urlsplit(target).scheme
    if scheme in ("http", "https"):
        parts = urlsplit(target)
        if not parts.netloc or " " in target:
            return [f"{link.where}: malformed {what} {target!r}"]
        host = parts.hostname or ""
        if not any(host == d or host.endswith("." + d) for d in EXTERNAL_DOMAINS):
            return [f"{link.where}: external {what} to {host!r} ({target}): not a reviewed domain; add it to "
                    f"tests/doccheck.py EXTERNAL_DOMAINS if it belongs in the docs"]
        return []
    if scheme:
        return [f"{link.where}: {what} {target!r}: only relative paths and http(s) links are allowed"]
    file_part, _, fragment = target.partition("#")
    dest = (link.path.parent / file_part).resolve() if file_part else link.path
    if file_part:
        if root not in dest.parents and dest != root:
            return [f"{link.where}: {what} {target!r} leaves the repository"]
        if not dest.exists():
            return [f"{link.where}: {what} {target!r}: {rel(dest)} does not exist"]
    if fragment:
        if dest.suffix != ".md" or not dest.is_file():
            return [f"{link.where}: {what} {target!r}: an anchor into a file that is not a Markdown page"]
        anchors = parse(dest).anchors
        if fragment not in anchors:
            return [f"{link.where}: {what} {target!r}: no heading of {rel(dest)} has the anchor #{fragment}"
                    f"{suggest(fragment, anchors)}"]
    return []


def suggest(word: str, known) -> str:
    import difflib

    close = difflib.get_close_matches(word, sorted(known), n=1)
    return f" (did you mean #{close[0]}?)" if close else ""


# ---- module paths ------------------------------------------------------------------------------------------------

DOTTED = re.compile(r"(?<![\w./-])(octo(?:\.[A-Za-z_]\w*)+)")
ROOTS = {"octo": REPO / "octo", "octo.engines": REPO / "engines"}


def module_refs(page: Page) -> list[Span]:
    """Every dotted ``octo.…`` name in a page: in its prose, its code spans and its non-Python code blocks (a Python
    block runs, which checks its imports)."""
    out = []
    for m in DOTTED.finditer(page.prose):
        out.append(Span(page.path, page.prose.count("\n", 0, m.start()) + 1, m.group(1)))
    for block in page.blocks:
        if block.lang == "python":
            continue
        for m in DOTTED.finditer(block.text):
            out.append(Span(page.path, block.line + block.text.count("\n", 0, m.start()), m.group(1)))
    return out


def module_file(parts: list[str]) -> Path | None:
    """The source file of module ``parts`` (``['octo', 'runtime', 'registry']``), or None."""
    dotted = ".".join(parts)
    for prefix in sorted(ROOTS, key=len, reverse=True):
        if dotted == prefix or dotted.startswith(prefix + "."):
            base = ROOTS[prefix].joinpath(*parts[len(prefix.split(".")):])
            if base.is_dir() and (base / "__init__.py").exists():
                return base / "__init__.py"
            if base.with_suffix(".py").is_file():
                return base.with_suffix(".py")
            return None
    return None


@functools.cache
def module_tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def defined_names(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """The names a module or class body binds: functions, classes, assignments, imports (with what they import)."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        names[n.id] = node
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            inner = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            for handler in getattr(node, "handlers", []):
                inner += handler.body
            names.update(defined_names(inner))
    return names


def class_attributes(cls: ast.ClassDef) -> set[str]:
    """A class's own attributes: its body's names and every ``self.NAME = ...`` in its methods."""
    attrs = set(defined_names(cls.body))
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                attrs.add(node.attr)
    return attrs


def resolve_import(node: ast.AST, name: str, module: list[str]) -> list[str] | None:
    """The dotted origin of ``name`` bound by an import statement in module ``module``."""
    if isinstance(node, ast.ImportFrom):
        base = node.module.split(".") if node.module else []
        if node.level:
            package = module[:-1] if module_file(module) and module_file(module).name != "__init__.py" else module
            base = package[:len(package) - node.level + 1] + base
        for alias in node.names:
            if (alias.asname or alias.name) == name:
                return [*base, alias.name]
    if isinstance(node, ast.Import):
        for alias in node.names:
            if (alias.asname or alias.name).split(".")[0] == name:
                return alias.name.split(".")[:1] if not alias.asname else alias.name.split(".")
    return None


def check_module_path(dotted: str, _depth: int = 0) -> str | None:
    """None when ``dotted`` names a module of the repository and attributes its source defines; else why not."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        path = module_file(parts[:n])
        if path:
            break
    else:
        return f"no module {dotted!r} in the repository"
    module, rest = parts[:n], parts[n:]
    if not rest:
        return None
    names = defined_names(module_tree(path).body)
    node = names.get(rest[0])
    if node is None:
        if module_file(module + rest[:1]):
            return None
        return f"{'.'.join(module)} ({rel(path)}) defines no {rest[0]!r}"
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        origin = resolve_import(node, rest[0], module)
        if origin and origin[0] == "octo" and _depth < 5:
            return check_module_path(".".join(origin + rest[1:]), _depth + 1)
        return None  # a third-party name: not ours to check
    for attr in rest[1:]:
        if not isinstance(node, ast.ClassDef):
            return None  # an attribute of a value or a function: as far as the source can tell
        if not has_attribute(node, attr):
            return f"{'.'.join(module)}.{node.name} ({rel(path)}) has no attribute {attr!r}"
        node = defined_names(node.body).get(attr)
    return None


@functools.cache
def class_index() -> dict[str, list[ast.ClassDef]]:
    """Every class defined in octo/ and engines/, by name."""
    index: dict[str, list[ast.ClassDef]] = {}
    for root in ("octo", "engines"):
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(module_tree(path)):
                if isinstance(node, ast.ClassDef):
                    index.setdefault(node.name, []).append(node)
    return index


PLAIN_BASES = {"object", "Protocol", "Generic", "ABC", "Enum", "IntEnum", "NamedTuple", "TypedDict", "Exception",
               "BaseModel", "str", "int", "dict", "list", "tuple"}


def has_attribute(cls: ast.ClassDef, attr: str, _depth: int = 0) -> bool:
    """Whether ``cls`` or a base class defines ``attr``; a base from outside octo and engines may (benefit of the
    doubt), a plain one (object, Protocol, pydantic's BaseModel...) adds nothing."""
    if attr in class_attributes(cls):
        return True
    for base in cls.bases:
        name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
        if isinstance(base, ast.Subscript):
            name = getattr(base.value, "id", None) or getattr(base.value, "attr", None)
        if name in PLAIN_BASES:
            continue
        known = class_index().get(name or "")
        if not known:
            return True
        if _depth < 8 and any(has_attribute(c, attr, _depth + 1) for c in known if c is not cls):
            return True
    return False


# Names in the docs that look like one of octo's classes or modules but are another project's (checked by nothing).
FOREIGN_NAMES = {
    "Model.transcribe": "pywhispercpp's Model (docs/speech.md: the bare runtime)",
    "Options.FromMap": "Ollama's Go code (docs/ollama.md)",
    "ollama.Client": "the ollama Python client (docs/ollama.md)",
}
QUALIFIED = re.compile(r"([A-Za-z_]\w*)\.([A-Za-z_]\w*)(?:\(.*\))?")


def check_qualified_name(text: str) -> str | None:
    """``Class.attr`` (``Engine.kv_room``, ``Feed.mask``) or ``module.Class`` (``events.DECODE``,
    ``reasoning.ThinkSplitter``) in a code span: None when a class (or module) of that name in octo/ or engines/
    has it, or when no class or module of ours has that name (another project's); else what is missing."""
    m = QUALIFIED.fullmatch(text)
    if not m or f"{m.group(1)}.{m.group(2)}" in FOREIGN_NAMES:
        return None
    owner, attr = m.groups()
    classes = class_index().get(owner)
    if classes:
        if any(has_attribute(c, attr) for c in classes):
            return None
        return f"no class {owner} in octo/ or engines/ has an attribute {attr!r}"
    if attr[0].isupper():
        modules = [p for root in ("octo", "engines") for p in (REPO / root).rglob(f"{owner}.py")]
        if modules and not any(attr in defined_names(module_tree(p).body) for p in modules):
            return f"no module {owner}.py in octo/ or engines/ defines {attr!r}"
    return None


# ---- file paths --------------------------------------------------------------------------------------------------

PATH_ROOTS = ("octo", "engines", "plugins", "tests", "bench", "scripts", "docs", ".ci")
FILE_PATH = re.compile(r"(?<![\w./~$-])((?:" + "|".join(re.escape(r) for r in PATH_ROOTS) + r")/[\w.*/-]*[\w*/])")
TOP_FILES = re.compile(r"(?<![\w./-])(models\.yaml|pyproject\.toml|constraints\.txt|Makefile)(?![\w/-])")


def file_refs(page: Page) -> list[Span]:
    """Every repository path a page names (``octo/server/keepalive.py``, ``tests/test_docs.py``, ``bench/``...),
    in its prose and code spans and in its code blocks."""
    out = []
    texts = [(page.prose, 1)] + [(b.text, b.line) for b in page.blocks]
    for text, first in texts:
        for pattern in (FILE_PATH, TOP_FILES):
            for m in pattern.finditer(text):
                path = m.group(1)
                if re.fullmatch(r"octo/[\w-]+", path):
                    continue  # "octo/bare" in a sentence is a ratio, not a folder
                out.append(Span(page.path, first + text.count("\n", 0, m.start()), path))
    return out


def check_file_path(path: str) -> str | None:
    if any(ch in path for ch in "*?["):
        return None if list(REPO.glob(path.rstrip("/"))) else f"{path!r} matches no file in the repository"
    return None if (REPO / path).exists() else f"{path!r} does not exist in the repository"


# ---- commands ----------------------------------------------------------------------------------------------------

PROGRAMS = ("octo", ".venv/bin/octo", "python", "python3", ".venv/bin/python", "make", "curl", "pip", "sudo",
            "flock", "ray", "claude", "codex", "llama-server", "./scripts/system-deps.sh")
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


@dataclass(frozen=True)
class Command:
    """A command the docs show: a shell block, a Python block, a data block (yaml, json) or an inline command."""
    path: Path
    line: int
    kind: str  # "shell", "python", "yaml", "json"
    text: str  # as written (a block's whole text; an inline command's span)

    @property
    def where(self) -> str:
        return f"{rel(self.path)}:{self.line}"

    @property
    def key(self) -> str:
        """The text a reviewed list names it by: whitespace collapsed."""
        return " ".join(self.text.split())


def program_of(text: str) -> str | None:
    """The program a command line starts with (after ``VAR=value`` assignments), if it is a known one."""
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return None
    while words and ENV_ASSIGNMENT.match(words[0]):
        words = words[1:]
    return words[0] if words and words[0] in PROGRAMS else None


def commands(page: Page) -> list[Command]:
    out = []
    for block in page.blocks:
        if block.lang in ("bash", "sh", "shell", "console"):
            out.append(Command(page.path, block.line, "shell", block.text))
        elif block.lang == "python":
            out.append(Command(page.path, block.line, "python", block.text))
        elif block.lang in ("yaml", "json"):
            out.append(Command(page.path, block.line, block.lang, block.text))
        elif block.lang == "indented" and any(program_of(line) for line in shell_lines(block.text)[:1]):
            out.append(Command(page.path, block.line, "shell", block.text))
    for span in page.spans:
        for piece in re.split(r"\s+&&\s+", span.text):
            if program_of(piece):
                out.append(Command(page.path, span.line, "shell", piece))
    return out


def shell_lines(text: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.split("\n"):
        words = shlex.split(line, comments=True) if line.strip() else []
        if words:
            out.append(line.strip())
    return out


PLACEHOLDER = re.compile(r"^(?:\[?[A-Z][A-Z0-9_]*(?:\[?:[A-Z_]+\]?)?\]?(?:\s*\.\.\.)?\]?|\[[A-Z].*\])$")


def octo_argv(line: str) -> list[str] | None:
    """The arguments after ``octo`` of an octo command line (None for any other command)."""
    words = shlex.split(line, comments=True)
    while words and ENV_ASSIGNMENT.match(words[0]):
        words = words[1:]
    if not words or words[0] not in ("octo", ".venv/bin/octo"):
        return None
    return words[1:]


def is_template(argv: list[str]) -> bool:
    """Whether an octo command line has placeholders (``MODEL``, ``[MODEL ...]``, ``NAME=PATH``, ``KEY``...)."""
    return any(PLACEHOLDER.match(w) or re.fullmatch(r"[A-Z_]+=[A-Z_]+", w) or "HEAD:" in w or w == "..."
               for w in argv)


def check_octo_syntax(argv: list[str]) -> str | None:
    """None when ``octo ARGV``'s command and options exist in the CLI (nothing runs); else what is wrong."""
    from octo.cli.main import cli

    if not argv or argv[0].startswith("-"):
        known = {o for p in cli.params for o in getattr(p, "opts", [])} | {"-h", "--help"}
        bad = [w for w in argv if w.startswith("-") and w not in known]
        return f"octo has no option {bad[0]}" if bad else None
    import click

    ctx = click.Context(cli)
    command = cli.get_command(ctx, argv[0])
    if command is None:
        return f"octo has no command {argv[0]!r} (it has {', '.join(cli.list_commands(ctx))})"
    options = {}
    for param in command.params:
        for opt in [*getattr(param, "opts", []), *getattr(param, "secondary_opts", [])]:
            options[opt] = param
    options.update({"-h": None, "--help": None})
    for word in argv[1:]:
        if word.startswith("-") and not re.fullmatch(r"-\d.*", word):
            name = word.split("=", 1)[0]
            if name not in options:
                return f"`octo {argv[0]}` has no option {name}"
    return None


def cli_options() -> set[str]:
    """Every option of the octo command and its subcommands."""
    import click

    from octo.cli.main import cli

    ctx = click.Context(cli)
    params = list(cli.params)
    for name in cli.list_commands(ctx):
        params += cli.get_command(ctx, name).params
    return {o for p in params for o in [*getattr(p, "opts", []), *getattr(p, "secondary_opts", [])]}


def script_options(path: Path) -> set[str]:
    """The ``--options`` a script declares (the string constants of its source that are ``--name``)."""
    return {n.value.split("=")[0] for n in ast.walk(module_tree(path))
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and re.fullmatch(r"--[\w-]+(=.*)?", n.value)}
