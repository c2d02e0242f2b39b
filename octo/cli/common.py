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


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(str(r.get(c, "") if r.get(c) is not None else "-")) for r in rows))
              for c in columns}
    click.echo("  ".join(c.upper().ljust(widths[c]) for c in columns))
    for r in rows:
        click.echo("  ".join(str(r.get(c) if r.get(c) is not None else "-").ljust(widths[c]) for c in columns))


def take_port(host: str, port: int) -> list:
    """``octo serve``'s listening sockets, taken before anything else starts (its engine worker, its imports, the
    models' loads): a port in use is a clear error at once. Only ``socket`` is imported (``octo.server.sockets``)."""
    from octo.server.sockets import open_sockets

    try:
        return open_sockets(host, port)
    except OSError as exc:
        raise click.ClickException(f"cannot serve: {exc.strerror or exc}") from None
