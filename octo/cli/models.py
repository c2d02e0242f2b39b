"""``octo models`` (the catalog, and what this host can do with it) and ``octo pull`` (download ahead of time)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import click

from octo.errors import OctoError
from octo.models.catalog import DEFAULT_ENGINE_FORMATS, Artifact, load_catalog


@dataclass(frozen=True)
class EngineState:
    formats: frozenset[str]
    usable: bool
    reason: str


def engine_states() -> dict[str, EngineState]:
    """Each registered engine (aliases skipped): the formats it loads and whether it runs here."""
    try:
        from octo.plugins import engine_registry

        registry = engine_registry()
    except Exception as exc:  # noqa: BLE001 - the catalog stays listable without the plugin system
        why = f"engine registry unavailable: {exc}"
        return {name: EngineState(f, False, why) for name, f in DEFAULT_ENGINE_FORMATS.items()}
    states = {}
    for name, cls in registry.items():
        if name != cls.name:
            continue
        try:
            det = cls.detect()
            usable, reason = det.available, det.reason
        except Exception as exc:  # noqa: BLE001 - detect() must not raise; report it if it does
            usable, reason = False, f"detect() failed: {exc}"
        states[name] = EngineState(frozenset(cls.formats), usable, reason)
    return states


def _downloaded(artifact: Artifact) -> bool:
    from octo.models.download import is_downloaded

    try:
        return is_downloaded(artifact)
    except Exception:  # noqa: BLE001 - a broken cache entry reads as "not downloaded"
        return False


def _catalog_rows(states: dict[str, EngineState]) -> list[dict]:
    catalog = load_catalog()
    rows = []
    for entry in catalog.entries:
        variants = {}
        for variant in entry.variants:
            artifacts = catalog.artifacts(entry, variant)
            variants[variant] = {
                engine: {
                    "uri": a.uri,
                    "format": a.format,
                    "installed": engine in states,
                    "usable": engine in states and states[engine].usable,
                    "downloaded": _downloaded(a),
                }
                for engine, a in artifacts.items()
            }
        rows.append(
            {
                "id": entry.id,
                "aliases": list(entry.aliases),
                "task": entry.task,
                "context_length": entry.context_length,
                "default_variant": entry.default_variant,
                "variants": variants,
            }
        )
    return rows


def _table(rows: list[list[str]], header: list[str], width: int) -> str:
    """The table cut to ``width`` characters a line (the last column, the aliases, is the one cut, with "…")."""
    from octo.cli.common import fit

    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fit(fmt.format(*r).rstrip(), width) for r in [header, *rows])


@click.command("models")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def models(as_json: bool) -> None:
    """List the model catalog: aliases, variants, task, and which engines have, run and hold each artifact."""
    states = engine_states()
    try:
        rows = _catalog_rows(states)
    except OctoError as exc:
        raise click.ClickException(exc.message) from None
    if as_json:
        engines = {n: {"formats": sorted(s.formats), "usable": s.usable, "reason": s.reason} for n, s in states.items()}
        click.echo(json.dumps({"engines": engines, "models": rows}, indent=2))
        return
    lines = []
    for row in rows:
        for i, (variant, arts) in enumerate(row["variants"].items()):
            mark = "*" if variant == row["default_variant"] else ""
            lines.append(
                [
                    row["id"] if i == 0 else "",
                    variant + mark,
                    row["task"] if i == 0 else "",
                    str(row["context_length"] or "-") if i == 0 else "",
                    ", ".join(e if a["usable"] else f"({e})" for e, a in arts.items()) or "-",
                    ", ".join(e for e, a in arts.items() if a["downloaded"] and a["format"] != "synth")
                    or ("built locally" if any(a["format"] == "synth" for a in arts.values()) else "-"),
                ]
            )
            if i == 0 and row["aliases"]:
                more = len(row["aliases"]) - 1
                lines[-1].append(row["aliases"][0] + (f" (+{more})" if more else ""))
            else:
                lines[-1].append("")
    header = ["MODEL", "VARIANT", "TASK", "CONTEXT", "ENGINES", "DOWNLOADED", "ALIASES"]
    import textwrap

    from octo.cli.common import terminal_width

    width = terminal_width()
    click.echo(_table(lines, header, width))
    note = ("* default variant. ENGINES: those with an artifact, in (brackets) those not usable here. ALIASES: the "
            "first (and how many more: `octo models --json` lists them). Serve or pull with MODEL[:VARIANT], e.g. "
            "`octo pull qwen-2.5-0.5b:8bit`.")
    click.echo("\n" + textwrap.fill(note, width))
    click.echo("Engines here:")
    for name, s in sorted(states.items()):
        status = "usable" if s.usable else "not usable"
        click.echo(textwrap.fill(f"{name:<14} {status}{': ' + s.reason if s.reason else ''}", width,
                                 initial_indent="  ", subsequent_indent=" " * 17))


@click.command("pull")
@click.argument("model")
@click.option(
    "--engine",
    "engines",
    multiple=True,
    help="Download this engine's artifact (repeatable). Default: the artifacts of every engine usable here.",
)
@click.option("--refresh", is_flag=True, help="Ask the hub for a newer revision even if already downloaded.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
def pull(model: str, engines: tuple[str, ...], refresh: bool, quiet: bool) -> None:
    """Download MODEL[:VARIANT] (catalog name, Hugging Face id or hf:// URI) ahead of time. What it downloads is
    recorded (OCTO_HOME/pulled.json): Ollama's DELETE /api/delete removes only models octo pulled."""
    from octo.models.pulling import canonical, fetch_recorded

    states = engine_states()
    formats = {n: s.formats for n, s in states.items()}
    for name in engines:  # an engine not installed here can still have its artifact pulled
        formats.setdefault(name, DEFAULT_ENGINE_FORMATS.get(name, frozenset()))
    try:
        resolved = load_catalog().resolve(model, formats)
        if engines:
            missing = [e for e in engines if e not in resolved.artifacts]
            if missing:
                have = ", ".join(sorted(resolved.artifacts)) or "none"
                raise click.ClickException(
                    f"'{resolved.name}' has no artifact for engine {', '.join(missing)}; engines with one: {have}."
                )
            chosen = list(dict.fromkeys(engines))
        else:
            chosen = [e for e in resolved.artifacts if states.get(e, EngineState(frozenset(), False, "")).usable]
            if not chosen:
                have = ", ".join(sorted(resolved.artifacts)) or "none"
                raise click.ClickException(
                    f"No engine usable here has an artifact for '{resolved.name}' (artifacts for: {have}); "
                    "choose one with --engine NAME."
                )
        done: dict[tuple, str] = {}
        for engine in chosen:
            artifact = resolved.artifacts[engine]
            key = (artifact.uri, artifact.allow_patterns, artifact.subfolder, artifact.mmproj,
                   artifact.format == "synth" and engine)
            if key not in done:
                was_there = not refresh and _downloaded(artifact) and artifact.format != "synth"
                record = (canonical(model) or (resolved.name,))[0]
                done[key] = str(fetch_recorded(record, artifact, progress=not quiet, refresh=refresh))
                note = " (already downloaded)" if was_there else ""
            else:
                note = " (same artifact)"
            projector = f" (projector: {artifact.mmproj.rsplit('/', 1)[1]})" if artifact.mmproj else ""
            click.echo(f"{resolved.name} [{engine}] {artifact.uri} -> {done[key]}{projector}{note}")
    except OctoError as exc:
        if getattr(exc, "cannot_download", None):  # offline, or the hub is unreachable: not "run octo pull" (this)
            raise click.ClickException(
                f"cannot download {exc.artifact.uri} (engine {exc.artifact.engine}): {exc.cannot_download}. "
                + ("Unset HF_HUB_OFFLINE to allow downloads." if "HF_HUB_OFFLINE" in exc.cannot_download
                   else "Check the network connection (or HF_ENDPOINT, a proxy) and try again.")) from None
        raise click.ClickException(exc.message) from None
