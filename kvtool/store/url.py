"""Store URLs: options in the query string, and passwords kept out of sight.

``scheme://location?name=value&...``: each store class declares the options it
takes and how each is parsed; anything else is a one-line ``UsageError``.
"""

from __future__ import annotations

import re
from typing import Any, Callable
from urllib.parse import parse_qsl, urlsplit

from kvtool.errors import UsageError

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")


def redact(url: str) -> str:
    """A store URL, or a comma-separated list of them, safe to show: credentials become ``***``.

    ``redis://user:secret@host/0`` -> ``redis://user:***@host/0``; a user name
    alone (``redis://secret@host``) is hidden too, since it may be a password.
    A password may hold any character, plainly or percent-encoded, so the
    credentials are everything from ``scheme://`` to the *last* ``@``: that is
    where ``urllib.parse`` ends them as well, but it first cuts the URL at
    ``/``, ``?`` and ``#``, which a plainly written password may contain (a
    path holding ``@`` is hidden up to it as well). Text that is not a URL is
    shown only when it has no ``@``; a URL that ``urllib.parse`` cannot parse
    is never shown.
    """
    return ",".join(_redact_one(part) for part in split_urls(url))


def _redact_one(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep or not _SCHEME.fullmatch(scheme):
        return "<text with an '@', hidden>" if "@" in url else url
    userinfo, at, location = rest.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        rest = f"{user}:***@{location}" if colon else f"***@{location}"
    try:
        urlsplit(f"{scheme}://{rest}")
    except ValueError:
        return f"{scheme}://<unparseable, hidden>"
    return f"{scheme}://{rest}"


def has_password(url: str) -> bool:
    """Whether ``url`` carries a password (``user:password@`` or ``:password@``) by ``redact``'s reading."""
    userinfo, at, _ = url.partition("://")[2].rpartition("@")
    return bool(at) and ":" in userinfo


def scheme_of(url: str) -> str:
    scheme, sep, _ = url.strip().partition("://")
    if not sep or not _SCHEME.fullmatch(scheme):
        raise UsageError(
            f"not a store URL: {redact(url)!r} (examples: memory://?capacity=2GiB, "
            "file:///var/cache/kvtool, redis://127.0.0.1:6379/0, redis+cluster://10.0.0.1:7000,10.0.0.2:7000)"
        )
    return scheme.lower()


_NODE = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):[0-9]+(/.*|\?.*)?", re.DOTALL)


def split_urls(text: str) -> list[str]:
    """The URLs of a comma-separated list, fastest tier first.

    A part that is only ``host:port`` (no scheme) continues a URL that so far
    names only hosts: the node list of ``redis+cluster://host:port,host:port/?...``.
    Parts without a scheme up to one holding an ``@`` continue the URL before
    them: the commas were in its credentials (``redis://:pa,ss@host``), which
    must never be cut into pieces shown as URLs of their own.
    """
    parts = [p.strip() for p in text.split(",")]
    urls: list[str] = []
    i = 0
    while i < len(parts):
        part = parts[i]
        ends_credentials = next((j for j in range(i, len(parts)) if "://" in parts[j] or "@" in parts[j]), None)
        if urls and ends_credentials is not None and "://" not in parts[ends_credentials]:
            urls[-1] += "," + ",".join(parts[i : ends_credentials + 1])
            i = ends_credentials + 1
            continue
        if urls and _NODE.fullmatch(part) and _names_only_hosts(urls[-1]):
            urls[-1] += "," + part
        else:
            urls.append(part)
        i += 1
    return urls


def _names_only_hosts(url: str) -> bool:
    rest = url.partition("://")[2].rpartition("@")[2]  # after the credentials, which may hold '/' or '?'
    return bool(rest) and "/" not in rest and "?" not in rest


def split_query(url: str) -> tuple[str, str]:
    """``(everything before the query, the query string)``; the query starts at the first ``?``
    after the credentials, since a password may hold a ``?`` too."""
    url = url.strip()
    credentials_end = url.rfind("@") + 1
    base, _, query = url[credentials_end:].partition("?")
    return url[:credentials_end] + base, query


def parse_options(url: str, parsers: dict[str, Callable[[str], Any]]) -> dict[str, Any]:
    """The query options of ``url``, each converted by its parser."""
    options: dict[str, Any] = {}
    _, query = split_query(url)
    for name, text in parse_qsl(query, keep_blank_values=True):
        if name not in parsers:
            known = ", ".join(sorted(parsers)) or "none"
            raise UsageError(f"unknown option {name!r} in store URL {redact(url)!r}; known options: {known}")
        try:
            options[name] = parsers[name](text)
        except (UsageError, ValueError) as exc:
            raise UsageError(f"bad value for {name!r} in store URL {redact(url)!r}: {exc}") from None
    return options


MAX_SECONDS = 1e9  # about 31 years: beyond it a deadline no longer fits the platform's time_t


def positive_seconds(text: str) -> float:
    """A positive, finite number of seconds up to ``MAX_SECONDS`` (``1e400`` and ``inf`` are refused)."""
    value = float(text)
    if not 0 < value <= MAX_SECONDS:
        raise ValueError(f"{text!r} is not a number of seconds in (0, {MAX_SECONDS:g}]")
    return value


def non_negative_seconds(text: str) -> float:
    """Like ``positive_seconds``, 0 allowed."""
    value = float(text)
    if not 0 <= value <= MAX_SECONDS:
        raise ValueError(f"{text!r} is not a number of seconds in [0, {MAX_SECONDS:g}]")
    return value
