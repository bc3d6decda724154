"""Passwords in store URLs never reach output: redact() for every reserved character, and the CLI end to end."""

from __future__ import annotations

import logging
from urllib.parse import quote

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.store import open_store
from kvtool.store.url import redact

#: RFC 3986's reserved characters, the percent sign and a space: each may sit in a password, plainly written.
RESERVED = ":/?#[]@!$&'()*+,;=% "
#: Two halves of a password around one reserved character; neither may ever be shown.
HALVES = ("Qz7k", "Wv9m")


def urls(char: str) -> list[str]:
    password = HALVES[0] + char + HALVES[1]
    return [
        f"redis://user:{password}@127.0.0.1:1/0?timeout=0.2&connect_timeout=0.2",
        f"redis://:{password}@127.0.0.1:1/0",
        f"rediss://:{password}@127.0.0.1:1",
        f"memory://,redis://:{password}@127.0.0.1:1/0?timeout=0.2",
        f"redis://:{quote(password, safe='')}@127.0.0.1:1/0",
        f"redis+cluster://:{password}@127.0.0.1:1,127.0.0.1:2?connect_timeout=0.2",
    ]


def shows_a_secret(text: str) -> bool:
    return any(half in text for half in HALVES)


@pytest.mark.parametrize("char", RESERVED)
def test_redact_hides_passwords_holding_any_reserved_character(char):
    for url in urls(char):
        shown = redact(url)
        assert not shows_a_secret(shown), (url, shown)
        assert "127.0.0.1" in shown or "unparseable" in shown


def test_redact_keeps_what_is_not_secret():
    assert redact("redis://127.0.0.1:6379/0?ttl=3") == "redis://127.0.0.1:6379/0?ttl=3"
    assert redact("redis://user:pw@host:6379/0") == "redis://user:***@host:6379/0"
    assert redact("redis://secret@host") == "redis://***@host"
    assert redact("memory://?capacity=1GiB, file:///var/cache/kv") == "memory://?capacity=1GiB,file:///var/cache/kv"
    assert "pw" not in redact("redis://[::1:pw@host")
    assert redact("redis://h[::1") == "redis://<unparseable, hidden>"
    assert redact("no scheme, but a:pw@host") == "<text with an '@', hidden>"


@pytest.mark.parametrize("char", RESERVED)
def test_cli_never_shows_a_password(char, caplog):
    runner = CliRunner()
    with caplog.at_level(logging.DEBUG, logger="kvtool"):
        for url in urls(char):
            for command in (["ls"], ["stats", "--json"], ["put", "k", "-"]):
                result = runner.invoke(app, ["store", *command, "--store", url], input=b"v")
                assert not shows_a_secret(result.output), (url, command, result.output)
                assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert not shows_a_secret(caplog.text)


@pytest.mark.parametrize("command", ["ls", "stats"])
def test_listing_an_unreachable_redis_fails_in_one_line(command):
    for url in (
        "redis://127.0.0.1:1/0?connect_timeout=0.2",
        "memory://,redis://:pw@127.0.0.1:1/0?connect_timeout=0.2",
        "redis+cluster://:pw@127.0.0.1:1,127.0.0.1:2?connect_timeout=0.2",
    ):
        result = CliRunner().invoke(app, ["store", command, "--store", url])
        assert result.exit_code == 3, result.output
        assert result.stderr.startswith("kvtool: error: cannot reach the redis store redis")
        assert result.stderr.count("\n") == 1 and result.stdout == ""
        assert ":pw@" not in result.stderr


def test_a_password_with_reserved_characters_works_percent_encoded(redis_server):
    import redis

    password = "p@s:s/w#r?d%" + HALVES[0]
    redis.Redis(port=redis_server.port).config_set("requirepass", password)
    url = f"redis://:{quote(password, safe='')}@127.0.0.1:{redis_server.port}/0?timeout=10&connect_timeout=10"  # a loaded machine is slow, not down
    with open_store(url) as store:
        assert store.put("k", b"v") and store.get("k") == b"v"
        assert not shows_a_secret(repr(store)) and not shows_a_secret(str(store.stats()))
    result = CliRunner().invoke(app, ["store", "ls", "--json", "--store", url])
    assert result.exit_code == 0 and '"k"' in result.stdout and not shows_a_secret(result.output)
