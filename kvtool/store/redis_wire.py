"""How the redis tier talks to a server: large values go to the socket without being copied first."""

from __future__ import annotations

from typing import Any

import redis
from redis.connection import PythonRespSerializer


class _UnbufferedValues:
    """redis-py's Python packer: a value above 6 kB goes to the socket as its own buffer.

    With hiredis installed redis-py packs every command with hiredis, which
    copies each value into one new command string first (94 MB for a large
    entry); replies are still parsed by hiredis.
    """

    _buffer_cutoff: int  # redis.Connection's, which this mixin precedes
    encoder: Any

    def _construct_command_packer(self, packer: Any) -> Any:
        return packer or PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)


class UnbufferedConnection(_UnbufferedValues, redis.Connection):
    """A plain TCP connection that sends large values without copying them (TLS copies anyway)."""
