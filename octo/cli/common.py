"""What the commands share: the ``OCTO_*`` variable of a flag, a host in a URL, a table on the terminal, the port
``octo serve`` takes first."""

from __future__ import annotations

import click


def envvar(name: str) -> dict:
    """The options that let ``OCTO_NAME`` set a flag (and ``--help`` show it)."""
    return {"envvar": f"OCTO_{name}", "show_envvar": True}


def url_host(host: str) -> str:
    """``host`` as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def terminal_width() -> int:
    """The terminal's width in characters (``COLUMNS``, else the terminal's, else 120 when not a terminal)."""
    import shutil

    return max(40, shutil.get_terminal_size((120, 24)).columns)


def fit(line: str, width: int | None) -> str:
    """``line`` cut to ``width`` characters, its end marked with "…" (None: as it is)."""
    return line if width is None or len(line) <= width else line[:width - 1] + "…"


def print_table(rows: list[dict], columns: list[str], width: int | None = None) -> None:
    """``rows`` as a table, None as "-"; with ``width``, every line cut to it (the last column is the one to
    lose: put the long free text there)."""
    widths = {c: max(len(c), *(len(str(r.get(c, "") if r.get(c) is not None else "-")) for r in rows))
              for c in columns}
    click.echo(fit("  ".join(c.upper().ljust(widths[c]) for c in columns).rstrip(), width))
    for r in rows:
        cells = (str(r.get(c) if r.get(c) is not None else "-").ljust(widths[c]) for c in columns)
        click.echo(fit("  ".join(cells).rstrip(), width))


def take_port(host: str, port: int) -> list:
    """``octo serve``'s listening sockets, taken before anything else starts (its engine worker, its imports, the
    models' loads): a port in use is a clear error at once. Only ``socket`` is imported (``octo.server.sockets``)."""
    from octo.server.sockets import open_sockets

    try:
        return open_sockets(host, port)
    except OSError as exc:
        raise click.ClickException(f"cannot serve: {exc.strerror or exc}") from None
