"""The plugin manager: built-in engines and third-party plugins register through the same hooks.

Third-party plugins come from the ``octo`` entry-point group; ``OCTO_LOAD_PLUGINS`` (comma-separated
entry-point names) limits which of them load. Local plugin files load with ``--plugins-dir``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pluggy

from octo import hookspecs
from octo.engine import Engine

log = logging.getLogger("octo.plugins")

DEFAULT_PLUGINS = (
    "octo.engines.echo",
    "octo.engines.llamacpp",
    "octo.engines.mlx",
    "octo.engines.onnx",
    "octo.engines.whisper",
    "octo.engines.faster_whisper",
    "octo.engines.whispercpp",
)
KNOWN_ENGINES = ("echo", "llamacpp", "mlx", "onnx", "whisper", "faster-whisper", "whispercpp")

_pm: pluggy.PluginManager | None = None
load_errors: dict[str, str] = {}


def get_plugin_manager() -> pluggy.PluginManager:
    global _pm
    if _pm is None:
        _pm = load_plugins()
    return _pm


def load_plugins(plugins_dir: str | None = None) -> pluggy.PluginManager:
    """A fresh plugin manager with the built-ins, allowed entry points and ``plugins_dir`` files."""
    global _pm
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in DEFAULT_PLUGINS:
        try:
            pm.register(importlib.import_module(name), name=name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a built-in that exists but failed to import is a real error
                load_errors[name] = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - one broken plugin must not stop the server
            load_errors[name] = f"{type(exc).__name__}: {exc}"
            log.warning("built-in plugin %s failed to load: %s", name, exc)
    allowed = os.environ.get("OCTO_LOAD_PLUGINS")
    allow = None if allowed is None else {n.strip() for n in allowed.split(",") if n.strip()}
    for ep in entry_points(group=hookspecs.PROJECT):
        if allow is not None and ep.name not in allow:
            continue
        try:
            pm.register(ep.load(), name=ep.name)
        except Exception as exc:  # noqa: BLE001
            load_errors[ep.name] = f"{type(exc).__name__}: {exc}"
            log.warning("plugin %s failed to load: %s", ep.name, exc)
    if plugins_dir:
        for path in sorted(Path(plugins_dir).glob("*.py")):
            register_file(pm, path)
    _pm = pm
    return pm


def register_file(pm: pluggy.PluginManager, path: Path) -> None:
    name = f"octo_plugin_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pm.register(module, name=str(path))


def engine_registry(pm: pluggy.PluginManager | None = None) -> dict[str, type[Engine]]:
    """Engine name (and alias) -> engine class, from every plugin's ``register_engines``."""
    pm = pm or get_plugin_manager()
    found: dict[str, type[Engine]] = {}

    def register(cls: type[Engine]) -> None:
        if not (isinstance(cls, type) and issubclass(cls, Engine) and cls.name):
            raise TypeError(f"register_engines: {cls!r} is not a named octo.engine.Engine subclass")
        found[cls.name] = cls

    pm.hook.register_engines(register=register)
    for cls in list(found.values()):
        for alias in cls.aliases:
            found.setdefault(alias, cls)
    return found


def plugin_table(pm: pluggy.PluginManager | None = None) -> list[dict]:
    """Each registered plugin with the hooks it implements (for ``octo plugins``)."""
    pm = pm or get_plugin_manager()
    rows = []
    for name, plugin in pm.list_name_plugin():
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        rows.append({"name": name, "hooks": hooks, "module": getattr(plugin, "__name__", repr(plugin))})
    for name, err in load_errors.items():
        rows.append({"name": name, "hooks": [], "module": name, "error": err})
    return rows


def installed_version(module: str, *dists: str) -> str | None:
    """The installed version of ``module`` (None: not found) without importing it, for an engine's ``detect`` and
    ``version``, which run in the gateway: the module's ``__version__`` where it is imported already (free), else the
    metadata of the first of ``dists`` (the distributions that install it) that is installed (milliseconds)."""
    lib = sys.modules.get(module)
    if lib is not None and isinstance(getattr(lib, "__version__", None), str):
        return lib.__version__
    from importlib.metadata import PackageNotFoundError, version

    for dist in dists:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None
