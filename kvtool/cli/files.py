"""``kvtool compress`` / ``kvtool decompress`` for plain byte files.

The output of ``compress --codec ID`` is that codec's own stream, so standard
tools read it (``gzip -d`` for qat and isal, ``zstd -d``, ``lz4 -d``).
"""

from __future__ import annotations

from pathlib import Path

import typer

from kvtool.cli._common import existing_file
from kvtool.codecs import get_codec, sniff_codec
from kvtool.errors import UsageError
from kvtool.fileio import atomic_write
from kvtool.units import parse_size


def compress(
    src: Path = typer.Argument(..., help="File to compress."),
    dst: Path = typer.Argument(..., help="Where to write the compressed stream."),
    codec: str = typer.Option("zstd:3", "--codec", "-c", help="Codec spec, ID[:LEVEL]; see `kvtool codecs`."),
):
    """Compress a file into one codec stream."""
    coder = get_codec(codec)
    _require_available(coder)
    data = existing_file(src).read_bytes()
    with atomic_write(dst) as f:
        f.write(coder.encode(data))


def decompress(
    src: Path = typer.Argument(..., help="Compressed file."),
    dst: Path = typer.Argument(..., help="Where to write the decompressed bytes."),
    codec: str = typer.Option(None, "--codec", "-c", help="Codec id; recognised from the stream's magic bytes when omitted."),
    max_size: str = typer.Option("16GiB", "--max-size", help="Refuse to produce more than this many bytes."),
):
    """Decompress a file made by `kvtool compress` or by gzip, zstd or lz4."""
    data = existing_file(src).read_bytes()
    coder = get_codec(codec) if codec else sniff_codec(data[:8])
    if coder is None:
        raise UsageError(f"{src}: format not recognised from its first bytes; name it with --codec")
    _require_available(coder)
    out = coder.decode(data, max_size=parse_size(max_size))
    with atomic_write(dst) as f:
        f.write(out)


def _require_available(coder) -> None:
    avail = type(coder).available()
    if not avail.ok:
        from kvtool.errors import UnavailableError

        raise UnavailableError(f"codec {coder.codec_id!r} is unavailable: {avail.reason}")


def register(app: typer.Typer) -> None:
    app.command("compress")(compress)
    app.command("decompress")(decompress)
