"""Who may open a websocket: API keys, browser Origins, and the client's address.

Checked before the websocket is accepted (a refused caller gets a plain HTTP 401/403 and
costs nothing more).  Keys are read from ``PERSONAPLEX_API_KEYS`` and
``PERSONAPLEX_API_KEYS_FILE`` and may be presented three ways:

- ``Authorization: Bearer <key>`` (the OpenAI SDKs, the load driver);
- the subprotocol ``openai-insecure-api-key.<key>`` (browsers cannot set headers; this is the
  OpenAI Realtime convention, so browser code written for it works unchanged);
- the query parameter ``api_key=<key>`` (last resort: URLs end up in logs).

Whether keys are required follows ``PERSONAPLEX_AUTH``: ``auto`` (the default) requires them
as soon as the server listens on any address that is not loopback, found by inspecting the
process's own sockets (``listeners.py``) or, where that is impossible, from
``PERSONAPLEX_BIND``; a public server without keys refuses to start.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..settings import Settings, SettingsError, env_name
from .listeners import Listener, bind_host, is_loopback

log = logging.getLogger(__name__)

KEY_SUBPROTOCOL = "openai-insecure-api-key."
# Subprotocols a browser may offer alongside the key; "realtime" is chosen when offered.
PREFERRED_SUBPROTOCOL = "realtime"


@dataclass(frozen=True)
class Caller:
    """An admitted caller: the key it used (as a short digest, never the key) and the
    subprotocol the websocket must accept (browsers fail the handshake otherwise)."""

    key_id: str | None
    subprotocol: str | None


def read_keys(settings: Settings) -> tuple[str, ...]:
    keys = [key for key in settings.api_keys if key]
    if settings.api_keys_file:
        for line in Path(settings.api_keys_file).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    return tuple(dict.fromkeys(keys))


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


class AccessPolicy:
    def __init__(self, settings: Settings, listeners: Sequence[Listener]) -> None:
        self.keys = read_keys(settings)
        self._encoded = [key.encode() for key in self.keys]
        self.addresses = [str(item) for item in listeners] + list(settings.bind)
        self.public = _listens_publicly(settings, listeners)
        self.require_key = _key_required(settings.auth, self.public, self.keys)
        self._origins = {_origin(o) for o in settings.allowed_origins if o.strip()}
        self._any_origin = "*" in {o.strip() for o in settings.allowed_origins}
        self._proxies = [_network(p) for p in settings.trusted_proxies if p.strip()]
        # DNS rebinding: a page on an attacker's host name that resolves to 127.0.0.1 sends
        # an Origin equal to its Host, which passes the same-origin check.  A server that
        # takes no keys only because it listens on loopback therefore serves browsers only
        # under a loopback Host (or an Origin listed explicitly).
        self.loopback_hosts_only = settings.auth == "auto" and not self.require_key and not self.public
        where = ", ".join(self.addresses) or "unknown addresses"
        if self.require_key:
            log.info("listening on %s (%s): API keys required (%d configured)", where,
                     "public" if self.public else "loopback", len(self.keys))
        elif self.public:
            log.warning("listening on %s without API keys (%s=off): anyone who can reach this address "
                        "can use the model", where, env_name("auth"))

    # Checks before accept ---------------------------------------------------------------------
    def origin_allowed(self, headers: Mapping[str, str], peer: str | None = None) -> bool:
        """Browsers always send ``Origin``; others need not.  Allowed: no Origin, the server's
        own origin (the page it serves: ``Host``, or ``X-Forwarded-Host`` from a trusted
        proxy ``peer``), or one of ``allowed_origins``."""
        origin = headers.get("Origin")
        if origin is None or self._any_origin:
            return True
        normalized = _origin(origin)
        if normalized in self._origins:
            return True
        if self.loopback_hosts_only and not is_loopback(_host_name(headers.get("Host", ""))):
            return False
        hosts = [headers.get("Host", "")]
        if peer is not None and self._trusted(peer):
            hosts += _joined(headers, "X-Forwarded-Host").split(",")
        netloc = urlsplit(normalized).netloc
        return any(host.strip().lower() == netloc for host in hosts if host.strip())

    def authenticate(self, headers: Mapping[str, str], args: Mapping[str, str],
                     subprotocols: Sequence[str]) -> Caller | None:
        """The caller if its key is good (or none is needed); None means 401."""
        key = _presented_key(headers, args, subprotocols)
        subprotocol = _choose_subprotocol(subprotocols)
        if key is None:
            return None if self.require_key else Caller(None, subprotocol)
        if not self.keys:
            return Caller(None, subprotocol)  # keys are off: a presented one is ignored
        if not any(hmac.compare_digest(key.encode(), known) for known in self._encoded):
            return None
        return Caller(key_id(key), subprotocol)

    def client_address(self, scope: Mapping[str, Any], headers: Mapping[str, str]) -> str:
        """The peer address; behind a trusted proxy, the nearest untrusted X-Forwarded-For hop."""
        client = scope.get("client")
        peer = str(client[0]) if client else "unknown"
        if not self._proxies or not self._trusted(peer):
            return peer
        hops = [hop.strip() for hop in _joined(headers, "X-Forwarded-For").split(",") if hop.strip()]
        for hop in reversed(hops):
            if not self._trusted(hop):
                return hop
        return hops[0] if hops else peer

    def _trusted(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address.strip("[]"))
        except ValueError:
            return False
        return any(ip in network for network in self._proxies)


def _joined(headers: Mapping[str, str], name: str) -> str:
    """Every line of a list-valued header, comma-joined in order (RFC 9110 5.3).

    A proxy that appends its own ``X-Forwarded-For`` line (HAProxy's ``option forwardfor``,
    nginx's usual set-up) leaves the client's line first: reading only that one would
    take a hop the client wrote as the address."""
    getlist = getattr(headers, "getlist", None)
    if getlist is None:
        return headers.get(name, "")
    return ", ".join(getlist(name))


def check_access_settings(settings: Settings, listeners: Sequence[Listener]) -> None:
    """``SettingsError`` where the server may not serve as configured (a public address without
    keys, keys required but none configured), as ``AccessPolicy`` would raise it, without its
    log lines: ``personaplex-serve``'s master asks before it starts the engine host."""
    if settings.auth != "off":
        _key_required(settings.auth, _listens_publicly(settings, listeners), read_keys(settings))


def _listens_publicly(settings: Settings, listeners: Sequence[Listener]) -> bool:
    local = [item.local for item in listeners]
    local += [is_loopback(host) for host in map(bind_host, settings.bind) if host]
    return not local or not all(local)  # nothing known about where we listen: assume the worst


def _key_required(mode: str, public: bool, keys: Iterable[str]) -> bool:
    keys = tuple(keys)
    if mode == "off":
        if keys:
            log.warning("%s=off: the configured API keys are not checked", env_name("auth"))
        return False
    if mode == "required" and not keys:
        raise SettingsError(f"{env_name('auth')}=required but no API keys are configured: set "
                            f"{env_name('api_keys')} or {env_name('api_keys_file')}")
    if mode == "auto" and public and not keys:
        raise SettingsError(
            f"the server listens on a non-loopback address, so API keys are required: set {env_name('api_keys')} "
            f"or {env_name('api_keys_file')} (or {env_name('auth')}=off to serve without keys, e.g. behind an "
            f"authenticating proxy; {env_name('bind')} declares the address if it was misdetected)")
    return bool(keys)


def _presented_key(headers: Mapping[str, str], args: Mapping[str, str], subprotocols: Sequence[str]) -> str | None:
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    for protocol in subprotocols:
        if protocol.startswith(KEY_SUBPROTOCOL) and len(protocol) > len(KEY_SUBPROTOCOL):
            return protocol[len(KEY_SUBPROTOCOL):]
    key = args.get("api_key")
    return key if key else None


def _choose_subprotocol(subprotocols: Sequence[str]) -> str | None:
    """A browser that offers subprotocols fails unless one is accepted: take "realtime",
    else the first that carries no key, else the key's own."""
    if not subprotocols:
        return None
    if PREFERRED_SUBPROTOCOL in subprotocols:
        return PREFERRED_SUBPROTOCOL
    plain = [p for p in subprotocols if not p.startswith(KEY_SUBPROTOCOL)]
    return plain[0] if plain else subprotocols[0]


def _host_name(host: str) -> str:
    """The name or address of a ``Host`` header value, without its port."""
    host = host.strip()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _origin(value: str) -> str:
    return value.strip().rstrip("/").lower()


def _network(value: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        return ipaddress.ip_network(value.strip(), strict=False)
    except ValueError:
        raise SettingsError(f"{env_name('trusted_proxies')}: {value!r} is not an address or network") from None
