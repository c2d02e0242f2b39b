"""Fetching model artifacts: the Hugging Face hub (via huggingface_hub), plain file URLs, synthetic builds.

Hub artifacts live in huggingface_hub's own cache (``HF_HOME`` / ``HF_HUB_CACHE``) and honour
``HF_TOKEN``, ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE``, all read at call time (huggingface_hub reads them
once, at import). The local cache is always consulted first: an artifact that is there is returned
without any network request, online or not; ``refresh=True`` asks the hub for a newer revision.

Plain URLs (OpenAI's whisper checkpoints) go to ``$OCTO_HOME/downloads/HOST/PATH``; an interrupted
transfer leaves ``*.part``, which the next attempt resumes with an HTTP range request; a SHA-256 in
the URL path (OpenAI's convention) is checked. Hub downloads resume within an attempt (huggingface_hub
retries a broken transfer with a range request); huggingface_hub 2.x (tested: 2.4) keeps no partial files
between processes, and the partial blob of a download that was killed is removed by the next download of that
repository (``sweep_partial_blobs``). Every lock is an ``flock``, which dies with its holder.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shlex
import socket
from pathlib import Path
from urllib.parse import urlsplit

from octo.atomic import file_lock
from octo.errors import ConfigError, ModelNotFound
from octo.models.resolve import Artifact, parse_hf, uri_kind
from octo.paths import octo_home

log = logging.getLogger("octo.models.download")
_TRUE = {"1", "ON", "YES", "TRUE"}


class ArtifactNotDownloaded(ModelNotFound):
    """The artifact is not on this machine and cannot be downloaded now (offline, hub unreachable)."""

    code = "model_not_downloaded"


# -- environment (read at call time) ---------------------------------------------------------------
def hub_cache_dir() -> Path:
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def hub_endpoint() -> str | None:
    return (os.environ.get("HF_ENDPOINT") or "").rstrip("/") or None


def offline_mode() -> bool:
    return (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").upper() in _TRUE


def downloads_dir() -> Path:
    """Where plain-URL artifacts go."""
    return octo_home() / "downloads"


def _unreachable(url: str) -> str | None:
    """Why ``url``'s host cannot be reached, or None. A quick TCP probe: huggingface_hub retries refused
    connections with backoff for most of a minute before giving up. Skipped behind a proxy."""
    if any(
        os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
    ):
        return None
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=5).close()
    except OSError as exc:
        return f"{parts.scheme}://{parts.netloc} cannot be reached ({exc.strerror or type(exc).__name__})"
    return None


def pull_command(artifact: Artifact) -> str:
    return f"octo pull {shlex.quote(artifact.source or artifact.uri)} --engine {artifact.engine}"


def _not_here(artifact: Artifact, why: str) -> ArtifactNotDownloaded:
    exc = ArtifactNotDownloaded(
        f"{artifact.uri} (engine {artifact.engine}) is not downloaded and {why}. "
        f"Download it first, with network access: {pull_command(artifact)}",
        param="model",
    )
    exc.cannot_download, exc.artifact = why, artifact  # for callers that say it their own way (octo pull, a start)
    return exc


# -- public API ------------------------------------------------------------------------------------
def fetch(artifact: Artifact, *, offline: bool | None = None, progress: bool | type = True,
          refresh: bool = False) -> Path:
    """The local path of ``artifact`` (a file, or a folder for MLX / onnxruntime-genai); downloads if needed.

    ``offline`` defaults to ``HF_HUB_OFFLINE``; ``progress`` shows progress bars on the terminal.
    """
    offline = offline_mode() if offline is None else offline
    kind = uri_kind(artifact.uri)
    if artifact.format == "synth" or kind == "synth":
        from octo.models.synthetic import build

        return build(artifact.uri.removeprefix("synth://"), artifact.engine)
    if artifact.format == "none" or kind == "none":
        return Path(artifact.uri.removeprefix("none://"))
    if kind == "hf":
        return _fetch_hf(artifact, offline, progress, refresh)
    if kind == "url":
        return _fetch_url(artifact, offline, progress, refresh)
    path = Path(artifact.uri).expanduser()
    path = path / artifact.subfolder if artifact.subfolder else path
    if not path.exists():
        raise ModelNotFound(f"Model file or folder not found: {path}", param="model")
    return path


def is_downloaded(artifact: Artifact) -> bool:
    """Whether ``fetch`` would return without downloading (synthetic models count: nothing to download)."""
    kind = uri_kind(artifact.uri)
    if artifact.format in ("synth", "none") or kind in ("synth", "none"):
        return True
    if kind == "hf":
        return _cached_hf(artifact) is not None
    if kind == "url":
        return _url_dest(artifact.uri).is_file()
    path = Path(artifact.uri).expanduser()
    return (path / artifact.subfolder if artifact.subfolder else path).exists()


def local_path(artifact: Artifact) -> Path | None:
    """Where ``artifact`` is on this machine, without downloading or building anything (None: not here, or
    synthetic)."""
    kind = uri_kind(artifact.uri)
    if artifact.format in ("synth", "none") or kind in ("synth", "none"):
        return None
    if kind == "hf":
        return _cached_hf(artifact)
    if kind == "url":
        dest = _url_dest(artifact.uri)
        return dest if dest.is_file() else None
    path = Path(artifact.uri).expanduser()
    path = path / artifact.subfolder if artifact.subfolder else path
    return path if path.exists() else None


def downloaded_files(artifact: Artifact) -> set[str]:
    """The files of ``artifact``'s download on this machine now: every file of its hub repository's cached snapshots
    (a pull's own files are the difference before and after it), or a plain URL's file; none for a synthetic model
    or a local path (nothing octo downloads)."""
    kind = uri_kind(artifact.uri)
    if artifact.format in ("synth", "none") or kind not in ("hf", "url"):
        return set()
    if kind == "url":
        dest = _url_dest(artifact.uri)
        return {str(dest)} if dest.is_file() else set()
    out: set[str] = set()
    for root, _dirs, files in os.walk(_storage(parse_hf(artifact.uri)[0]) / "snapshots"):
        out.update(os.path.join(root, f) for f in files)
    return out


def repo_files(repo_id: str, *, offline: bool | None = None) -> list[str]:
    """The file list of a hub repository (main revision), from the hub or, offline, from the local cache."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = offline_mode() if offline is None else offline
    reason = "downloads are disabled (HF_HUB_OFFLINE)"
    if not offline and (why := _unreachable(hub_endpoint() or "https://huggingface.co")):
        offline, reason = True, f"the hub is unreachable: {why}"
    if not offline:
        try:
            return sorted(HfApi(endpoint=hub_endpoint()).list_repo_files(repo_id))
        except GatedRepoError:
            raise ConfigError(
                f"Hugging Face repository '{repo_id}' is gated: accept its license on the hub and set HF_TOKEN."
            ) from None
        except (RepositoryNotFoundError, RevisionNotFoundError):
            raise ModelNotFound(
                f"Hugging Face repository '{repo_id}' not found (a private one needs HF_TOKEN).",
                param="model",
            ) from None
        except HfHubHTTPError as exc:
            reason = f"the hub answered {exc.response.status_code}"
        except _network_errors() as exc:
            reason = f"the hub is unreachable ({type(exc).__name__})"
    files = _cached_repo_files(repo_id)
    if files:
        return files
    raise ArtifactNotDownloaded(
        f"hf://{repo_id} is not in the local cache ({hub_cache_dir()}) and {reason}. "
        f"Download it first, with network access: octo pull {repo_id}",
        param="model",
    )


# -- Hugging Face hub ------------------------------------------------------------------------------
def _network_errors() -> tuple[type[BaseException], ...]:
    """Exceptions meaning "the hub (or URL) cannot be reached now"."""
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    errors: list[type[BaseException]] = [
        ConnectionError,
        TimeoutError,
        OfflineModeIsEnabled,
        LocalEntryNotFoundError,
    ]
    try:
        import httpx2  # the HTTP client of huggingface_hub 2.x

        errors.append(httpx2.TransportError)
    except ImportError:
        pass
    return tuple(errors)


def _storage(repo_id: str) -> Path:
    return hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))


def repo_storage(repo_id: str) -> Path:
    """The hub cache's folder of repository ``repo_id`` (``models--ORG--NAME``)."""
    return _storage(repo_id)


def _main_commit(repo_id: str) -> str | None:
    try:
        return (_storage(repo_id) / "refs" / "main").read_text().strip() or None
    except OSError:
        return None


def _cached_repo_files(repo_id: str) -> list[str]:
    """The files of the cached main revision that are on disk (offline, only those can be served)."""
    commit = _main_commit(repo_id)
    if commit is None:
        return []
    snapshot = _storage(repo_id) / "snapshots" / commit
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())


def _cached_file(uri: str) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(*parse_hf(uri), cache_dir=hub_cache_dir())
    return Path(found) if isinstance(found, str) and os.path.isfile(found) else None


def _cached_hf(artifact: Artifact) -> Path | None:
    """The artifact's path in the hub cache (a GGUF counts only with its projector, ``Artifact.mmproj``, beside it)."""
    repo, filename = parse_hf(artifact.uri)
    if filename is not None:
        path = _cached_file(artifact.uri)
        return path if path is not None and (not artifact.mmproj or _cached_file(artifact.mmproj)) else None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:  # a folder counts as downloaded only with its tree listing (written by snapshot_download)
        from huggingface_hub import get_cached_repo_tree

        get_cached_repo_tree(repo, cache_dir=hub_cache_dir())
    except ImportError:
        pass  # older huggingface_hub: trust the snapshot folder
    except Exception:  # noqa: BLE001 - CachedRepoTreeNotFoundError: never fetched as a folder
        return None
    try:
        folder = Path(
            snapshot_download(
                repo,
                cache_dir=hub_cache_dir(),
                local_files_only=True,
                allow_patterns=list(artifact.allow_patterns) or None,
            )
        )
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    folder = folder / artifact.subfolder if artifact.subfolder else folder
    return folder if folder.is_dir() and any(folder.iterdir()) else None


def _fetch_hf(artifact: Artifact, offline: bool, progress: bool, refresh: bool) -> Path:
    if not refresh:
        cached = _cached_hf(artifact)
        if cached is not None:
            return cached
    if offline:
        raise _not_here(artifact, "downloads are disabled (HF_HUB_OFFLINE)")
    if why := _unreachable(hub_endpoint() or "https://huggingface.co"):
        raise _not_here(artifact, why)
    sweep_partial_blobs(parse_hf(artifact.uri)[0])
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, filename = parse_hf(artifact.uri)
    common = {"cache_dir": hub_cache_dir(), "endpoint": hub_endpoint(), "tqdm_class": _tqdm(progress)}
    what = artifact.uri  # the file being downloaded, for the errors
    try:
        if filename is not None:
            path = Path(hf_hub_download(repo, filename, **common))
            if artifact.mmproj:  # its projector, into the same snapshot folder: beside it
                what = artifact.mmproj
                hf_hub_download(*parse_hf(artifact.mmproj), **common)
        else:
            path = Path(snapshot_download(repo, allow_patterns=list(artifact.allow_patterns) or None, **common))
            path = path / artifact.subfolder if artifact.subfolder else path
    except GatedRepoError:
        raise ConfigError(
            f"{artifact.uri}: the repository is gated; accept its license on the hub and set HF_TOKEN."
        ) from None
    except RemoteEntryNotFoundError:
        raise ModelNotFound(f"{what}: no such file in the repository.", param="model") from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise ModelNotFound(
            f"{artifact.uri}: repository not found (a private one needs HF_TOKEN).", param="model"
        ) from None
    except HfHubHTTPError as exc:
        raise _not_here(artifact, f"the hub answered {exc.response.status_code}") from None
    except _network_errors() as exc:
        raise _not_here(
            artifact,
            f"the hub at {hub_endpoint() or 'huggingface.co'} cannot be reached ({type(exc).__name__})",
        ) from None
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        raise ModelNotFound(
            f"{artifact.uri}: no files match {list(artifact.allow_patterns)}"
            + (f" in subfolder '{artifact.subfolder}'" if artifact.subfolder else "")
            + ".",
            param="model",
        )
    return path


def sweep_partial_blobs(repo_id: str) -> list[Path]:
    """Remove the partial blobs that a killed download of ``repo_id`` left in the hub cache; returns them.

    huggingface_hub (2.x) downloads a blob to ``blobs/ETAG.RANDOM.incomplete`` while holding the flock
    ``.locks/models--ORG--NAME/ETAG.lock``, renames it when complete and never resumes such a file, so one left
    after its process died is garbage. A partial blob whose lock can be taken has no live download: it goes (with
    the lock held, so no download of that blob starts meanwhile); one whose lock is held is left alone.
    """
    import fcntl

    storage = _storage(repo_id)
    removed: list[Path] = []
    for part in sorted((storage / "blobs").glob("*.incomplete")):
        lock = hub_cache_dir() / ".locks" / storage.name / (part.name.split(".", 1)[0] + ".lock")
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:  # the lock comes before the partial file: no download holds it
            fd = None
        except OSError:
            continue
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # a live download (or no flock here: leave it to huggingface_hub)
            part.unlink(missing_ok=True)
            removed.append(part)
            log.info("removed %s, left by a download that did not finish", part)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


@functools.lru_cache(maxsize=1)
def _quiet_tqdm() -> type:
    from tqdm.auto import tqdm

    class Quiet(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Quiet


def _tqdm(progress: bool | type) -> type | None:
    """huggingface_hub's own progress bars, or none, or a tqdm class of the caller's (``/api/pull`` reports it)."""
    if isinstance(progress, type):
        return progress
    return None if progress else _quiet_tqdm()


# -- plain URLs ------------------------------------------------------------------------------------
def _url_dest(url: str) -> Path:
    parts = urlsplit(url)
    host = (parts.hostname or "host") + (f"_{parts.port}" if parts.port else "")
    segments = [s for s in parts.path.split("/") if s not in ("", ".", "..")]
    return downloads_dir().joinpath(host, *segments)


def _fetch_url(artifact: Artifact, offline: bool, progress: bool, refresh: bool) -> Path:
    url = artifact.uri
    dest = _url_dest(url)
    if dest.is_file() and not refresh:
        return dest
    if offline:
        raise _not_here(artifact, "downloads are disabled (HF_HUB_OFFLINE)")
    if why := _unreachable(url):
        raise _not_here(artifact, why)
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.file_download import http_get

    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    # flock: released by the kernel if this process dies, so a killed download never leaves a stale lock;
    # its .part stays and the next attempt resumes it
    with file_lock(downloads_dir() / ".locks" / (hashlib.sha1(url.encode()).hexdigest() + ".lock")):
        if dest.is_file() and not refresh:
            return dest
        with part.open("ab") as f:
            resume = f.tell()
            if resume:
                log.info("resuming %s at byte %d", url, resume)
            try:
                http_get(url, f, resume_size=resume, displayed_filename=dest.name, tqdm_class=_tqdm(progress))
            except HfHubHTTPError as exc:
                if exc.response.status_code == 404:
                    raise ModelNotFound(f"{url}: not found (404).", param="model") from None
                raise _not_here(artifact, f"the server answered {exc.response.status_code}") from None
            except _network_errors() as exc:
                raise _not_here(
                    artifact,
                    f"the transfer failed ({type(exc).__name__}; the partial file is kept "
                    "and the next attempt resumes it)",
                ) from None
        expected = next((s for s in urlsplit(url).path.split("/") if re.fullmatch(r"[0-9a-f]{64}", s)), None)
        if expected:
            digest = _sha256(part)
            if digest != expected:
                part.unlink(missing_ok=True)
                raise ConfigError(
                    f"{url}: SHA-256 mismatch (expected {expected}, got {digest}); the file was "
                    f"removed. Try again: {pull_command(artifact)}"
                )
        os.replace(part, dest)
    return dest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
