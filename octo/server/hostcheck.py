"""Which web pages and host names a local server answers: the ``Host`` check (DNS rebinding) and the ``Origin`` check
(cross-site requests a browser sends without a CORS preflight).

DNS rebinding: a page at ``http://evil.example:8080`` whose name the attacker then points at 127.0.0.1 talks to a
loopback server as its own origin, so CORS does not stop it; only the ``Host`` header still says ``evil.example``.
On a loopback bind the server therefore answers only localhost-like names (Ollama's ``allowedHostsMiddleware`` does
the same): no ``Host`` (HTTP/1.0), ``localhost`` and ``*.localhost`` (browsers resolve them to loopback themselves,
RFC 6761), this machine's host name, IP literals that are loopback or unspecified (an IP literal is never looked up
in DNS, so it cannot be rebound), the bound address, and the names given with ``--allowed-hosts`` (``*.example``
matches subdomains; ``*`` turns the check off). Unlike Ollama, ``*.local`` and ``*.internal`` are not allowed by
default: others on the network answer for those names (mDNS, a company's DNS); name them with ``--allowed-hosts``.

Cross-site requests: a browser sends ``Origin`` with every cross-origin request, and with every POST, including
``mode: "no-cors"`` fetches and form posts that need no preflight. A request whose ``Origin`` is neither the
server's own (the same host and port as its ``Host``) nor one of ``--cors-origins`` gets a 403 before anything runs,
whatever its content type (JSON routes also require ``application/json``, which a browser sends cross-origin only
after a preflight that only ``--cors-origins`` answers).
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from aiohttp import web

from octo.errors import Forbidden


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_allowed_hosts(value: str | None) -> tuple[str, ...]:
    """``--allowed-hosts``: comma-separated host names (``*.example`` for subdomains, ``*`` for any), lower-cased."""
    out = []
    for item in (value or "").split(","):
        name = item.strip().lower().rstrip(".")
        if name:
            out.append(name)
    return tuple(dict.fromkeys(out))


def split_host(header: str) -> str:
    """The host name of a ``Host`` header value (``name[:port]``, ``[v6]:port``), lower-case, without a final dot."""
    host = header.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else host
    if host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    return host.rstrip(".")


SEEN_HOSTS = 64


class HostGuard:
    """The Host and Origin checks of one server (``bind``: the address it listens on)."""

    def __init__(self, bind: str, allowed_hosts: tuple[str, ...], cors_origins: tuple[str, ...]) -> None:
        self.check_host = is_loopback(bind) and "*" not in allowed_hosts
        self.names = {"", "localhost", socket.gethostname().lower().rstrip("."), bind.lower().strip("[]")}
        self.names.update(h for h in allowed_hosts if not h.startswith("*."))
        self.suffixes = (".localhost", *(h[1:] for h in allowed_hosts if h.startswith("*.")))
        self.cors_any = "*" in cors_origins
        self.cors_origins = frozenset(cors_origins)
        self._seen: set[str | None] = set()  # Host header values found allowed (every request sends one): at most
        # SEEN_HOSTS, the spellings of the allowed names a client may use (a client invents them, the memory is ours)

    def _remember(self, header: str | None) -> None:
        if len(self._seen) < SEEN_HOSTS:
            self._seen.add(header)

    def host_allowed(self, header: str | None) -> bool:
        if not self.check_host or header in self._seen:
            return True
        host = split_host(header or "")
        if host in self.names or host.endswith(self.suffixes):
            self._remember(header)
            return True
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        if ip.is_loopback or ip.is_unspecified:
            self._remember(header)
            return True
        return False

    def origin_allowed(self, origin: str, host_header: str | None) -> bool:
        """A request's ``Origin``: the server's own page (same host and port as ``Host``) or a --cors-origins one."""
        origin = origin.strip().lower()
        if self.cors_any or origin in self.cors_origins:
            return True
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False  # "null" (sandboxed pages, file://), extensions: only when --cors-origins names them
        default = 443 if parts.scheme == "https" else 80
        own = (host_header or "").strip().lower()
        return _with_port(parts.netloc, default) == _with_port(own, default)

    def check(self, request: web.Request) -> None:
        """403 (``host_not_allowed`` or ``origin_not_allowed``) for a request this server must not answer."""
        host = request.headers.get("Host")
        if not self.host_allowed(host):
            raise Forbidden(f"Host '{split_host(host or '')}' is not allowed: this server answers local names only "
                            "(localhost, 127.0.0.1, [::1]); add a name with --allowed-hosts.", code="host_not_allowed")
        origin = request.headers.get("Origin")
        if origin is not None and not self.origin_allowed(origin, host):
            raise Forbidden(f"Requests from the web page at origin '{origin[:200]}' are not allowed; let a page call "
                            "this server with --cors-origins.", code="origin_not_allowed")


def _with_port(netloc: str, default: int) -> str:
    """``host:port`` with the scheme's default port filled in (``[v6]:port`` kept bracketed)."""
    if netloc.startswith("["):
        return netloc if "]:" in netloc else f"{netloc}:{default}"
    return netloc if ":" in netloc else f"{netloc}:{default}"
