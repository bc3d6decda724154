"""Store URLs: options in the query string, and passwords kept out of sight.

``scheme://location?name=value&...``: each store class declares the options it
takes and how each is parsed; anything else is a one-line ``UsageError``.
"""

from __future__ import annotations

import re
from typing import Any, Callable
from urllib.parse import parse_qsl

from kvtool.errors import UsageError

_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:@/?#]*):(?P<password>[^@/?#]*)@")


def redact(url: str) -> str:
    """``redis://user:secret@host`` -> ``redis://user:***@host``; other URLs unchanged."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", url.strip())


def scheme_of(url: str) -> str:
    scheme, sep, _ = url.strip().partition("://")
    if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
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
    """
    urls: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if urls and _NODE.fullmatch(part) and _names_only_hosts(urls[-1]):
            urls[-1] += "," + part
        else:
            urls.append(part)
    return urls


def _names_only_hosts(url: str) -> bool:
    rest = url.partition("://")[2]
    return bool(rest) and "/" not in rest and "?" not in rest


def split_query(url: str) -> tuple[str, str]:
    """``(everything before '?', the query string)``."""
    base, _, query = url.strip().partition("?")
    return base, query


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


def positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"{text!r} is not a positive number of seconds")
    return value
