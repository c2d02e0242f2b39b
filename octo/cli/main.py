"""The ``octo`` command group (click) and its small commands (``ps``, ``engines``, ``plugins``); ``serve`` is in
``octo.cli.serve``, ``models``/``pull`` in ``octo.cli.models``, ``bench`` in ``octo.cli.bench``."""

from __future__ import annotations

import json
import sys

import click

from octo import __version__
from octo.cli.common import envvar, print_table, terminal_width, url_host
from octo.cli.serve import serve
from octo.config import ServerConfig
from octo.errors import OctoError


class Commands(click.Group):
    """The built-in commands at once; the others (``models``, ``pull``, ``bench``, plugins' ``register_commands``)
    once a command that is not built in is asked for, or the list of commands: ``octo serve`` imports none of them
    (the catalog, pydantic, every plugin) before it starts its engine worker."""

    extended = False

    def extend(self) -> None:
        if not self.extended:
            self.extended = True
            _add_optional_commands()
            _add_bench()
            from octo.plugins import get_plugin_manager

            try:
                get_plugin_manager().hook.register_commands(cli=self)
            except Exception as exc:  # noqa: BLE001
                click.echo(f"octo: a plugin's register_commands failed: {exc}", err=True)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        command = super().get_command(ctx, name)
        if command is None and not self.extended:
            self.extend()
            command = super().get_command(ctx, name)
        return command

    def list_commands(self, ctx: click.Context) -> list[str]:
        self.extend()
        return super().list_commands(ctx)


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="octo")
def cli() -> None:
    """octo: an OpenAI-compatible local inference gateway that serves with the fastest engine here."""


cli.add_command(serve)


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, **envvar("HOST"))
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535), **envvar("PORT"))
@click.option("--api-key", default=None, **envvar("API_KEY"))
@click.option("--all", "show_all", is_flag=True, help="Also list servable models that are not loaded.")
@click.option("--json", "as_json", is_flag=True)
def ps(host, port, api_key, show_all, as_json):
    """List the models a running `octo serve` has loaded (like `ollama ps`)."""
    import urllib.error
    import urllib.request

    base = f"http://{url_host(host)}:{port}"
    req = urllib.request.Request(f"{base}/v1/models",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            data = json.loads(r.read())["data"]
    except urllib.error.HTTPError as exc:  # it answered: say what it said (401, 503 while it starts, ...)
        try:
            why = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError, OSError):
            why = str(exc)
        raise click.ClickException(f"octo at {base} answered {exc.code}: {why}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise click.ClickException(f"no octo server answered at {base}: {exc}") from None
    rows = [m for m in data if show_all or m["state"] not in ("available", "failed")]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    import time as _time

    table = []
    for m in rows:
        mem = (m.get("memory") or {}).get("measured_bytes") or (m.get("memory") or {}).get("estimated_bytes")
        exp = m.get("expires_at")
        table.append({"name": m["id"], "engine": m.get("engine"), "state": m["state"],
                      "where": (f"pid {m['worker']['pid']}" if m.get("worker") else m.get("isolation")),
                      "memory": f"{mem / 2**20:.0f} MB" if mem else None,
                      "until": "forever" if exp is None and m["state"] == "ready" else
                      (f"{max(0, exp - _time.time()):.0f} s" if exp else None),
                      "in_flight": m.get("requests_in_flight")})
    if not table:
        click.echo("no model loaded")
        return
    print_table(table, ["name", "engine", "state", "where", "memory", "until", "in_flight"])


@cli.command()
@click.argument("model", required=False)
@click.option("--engine", default=None, help="With MODEL: only this engine.")
@click.option("--bench-seconds", default=3.0, show_default=True, type=click.FloatRange(0.2))
@click.option("--rebench", is_flag=True, help="Ignore cached benchmark results.")
@click.option("--isolation", default=None, type=click.Choice(["process", "thread"]),
              help="Measure each candidate in its own worker process, or in this process.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (what GET /v1/engines returns).")
def engines(model, engine, bench_seconds, rebench, isolation, as_json):
    """List engines (available here or why not, tasks, formats); with MODEL, run the engine selection too.

    `octo engines MODEL` shows what `octo serve MODEL` would choose and why, without serving.
    """
    from octo.plugins import engine_registry
    from octo.runtime.loader import engine_rows, open_model

    out: dict = {"object": "list"}
    if model:
        config = ServerConfig(model=model, engine=engine, bench_seconds=bench_seconds, rebench=rebench,
                              isolation=isolation)

        async def run():
            opened = await open_model(config, say=lambda m: click.echo(m, err=True))
            await opened[0].close()
            return opened

        import asyncio

        try:
            handle, rows = asyncio.run(run())
        except OctoError as err:
            raise click.ClickException(err.message) from None
        out.update(active=handle.engine_name, model=handle.name, selection=handle.selection)
    else:
        rows = engine_rows(engine_registry())
    out["data"] = rows
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    table = []
    for r in rows:
        b = r.get("benchmark") or {}
        table.append({**r, "tasks": ",".join(r["tasks"]) or None, "formats": ",".join(r["formats"]) or None,
                      "score": b.get("score"), "decode_tok_s": b.get("decode_tok_s"),
                      "reason": b.get("error") or r.get("reason")})
    print_table(table, ["name", "available", "active", "version", "tasks", "formats", "batching", "score",
                         "decode_tok_s", "reason"])
    if model:
        click.echo(f"selection: {out['selection']['reason']}")
    else:
        click.echo("These are the engines installed here. Which one a running server uses for each model: "
                   "`octo ps` (or GET /v1/engines on the server); what `octo serve MODEL` would choose: "
                   "`octo engines MODEL`.")


@cli.command()
@click.option("--plugins-dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="Also load the plugin modules (*.py) of this folder, as `octo serve --plugins-dir` does.",
              **envvar("PLUGINS_DIR"))
@click.option("--json", "as_json", is_flag=True)
def plugins(plugins_dir, as_json):
    """List loaded plugins and the hooks each implements (built-in, installed, and those of --plugins-dir)."""
    from octo.plugins import load_plugins, plugin_table

    rows = plugin_table(load_plugins(plugins_dir) if plugins_dir else None)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        r["hooks"] = ",".join(r["hooks"]) or None
    print_table(rows, ["name", "hooks", "error"], width=terminal_width())


def _add_optional_commands() -> None:
    try:
        from octo.cli.models import models, pull
    except ImportError:
        return
    cli.add_command(models)
    cli.add_command(pull)


def _add_bench() -> None:
    from octo.cli.bench import bench

    cli.add_command(bench)


def main() -> None:
    cli(prog_name="octo")


if __name__ == "__main__":
    sys.exit(main())
