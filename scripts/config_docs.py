"""docs/configuration.md's flag table, generated from `octo serve`'s own options (click), as llm and datasette
generate theirs with cog. `python scripts/config_docs.py` rewrites the table between the markers;
tests/test_docs.py fails when the committed page differs from what the code says.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
BEGIN, END = "<!-- serve-flags:begin -->", "<!-- serve-flags:end -->"


def cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def flag_table() -> str:
    from octo.cli.main import cli

    serve = cli.commands["serve"]
    ctx = click.Context(serve)
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for p in serve.params:
        if not isinstance(p, click.Option) or p.hidden:
            continue
        names = " / ".join(f"`{o}`" for o in [*p.opts, *p.secondary_opts])
        if p.metavar:
            names += f" `{p.metavar}`"
        env = f"`{p.envvar}`" if isinstance(p.envvar, str) else ""
        value = p.get_default(ctx, call=False)
        if p.is_flag and not p.secondary_opts:
            default = "on" if value is True else "off"
        elif p.is_flag:
            default = f"`{p.opts[0]}`" if value else f"`{p.secondary_opts[0]}`"
        elif p.multiple or value is None or value == "" or value == ():
            default = "none"
        else:
            default = f"`{value}`"
        rows.append(f"| {names} | {env} | {default} | {cell(p.help or '')} |")
    return "\n".join(rows)


def render(text: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{flag_table()}\n{END}{tail}"


if __name__ == "__main__":
    new = render(DOC.read_text())
    if "--check" in sys.argv:
        sys.exit(0 if new == DOC.read_text() else 1)
    DOC.write_text(new)
