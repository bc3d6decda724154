"""``kvtool compress`` / ``decompress`` / ``verify``.

A KV cache (a safetensors dump) compresses into a ``.kvz`` container with a
recipe; any other file compresses into one plain codec stream, so standard tools
read it (``gzip -d`` for qat and isal, ``zstd -d``, ``lz4 -d``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from kvtool import api, container
from kvtool.cache import FORMAT_TAG
from kvtool.cli._common import JSON_OPTION, existing_file, print_json, progress
from kvtool.cli.inspect import lossy_note
from kvtool.codecs import get_codec, sniff_codec
from kvtool.errors import DecodeError, UnavailableError, UsageError
from kvtool.fileio import atomic_write
from kvtool.recipe import DEFAULT_RECIPE, Recipe
from kvtool.units import parse_size

PATTERN_OPTION = typer.Option(
    None, "--pattern", help="Treat IN as a KV cache whose tensors are named like 'model.layers.{layer}.self_attn.{k|v}'."
)


def compress(
    src: Path = typer.Argument(..., help="A KV cache (.safetensors) or any file."),
    dst: Path = typer.Argument(..., help="Output: a .kvz for a KV cache, a plain codec stream otherwise."),
    recipe: Optional[str] = typer.Option(
        None, "--recipe", "-r",
        help=f"Recipe for a KV cache [default: {DEFAULT_RECIPE}]; lossy only when it names a lossy stage, e.g. 'int:6,group=64|zstd:3'.",
    ),
    codec: Optional[str] = typer.Option(None, "--codec", "-c", help="Write one plain codec stream (ID[:LEVEL]) instead of a .kvz."),
    chunk_tokens: int = typer.Option(container.DEFAULT_CHUNK_TOKENS, "--chunk-tokens", help="Tokens per chunk in a .kvz."),
    threads: int = typer.Option(0, "--threads", "-t", help="Worker threads (0: one per core)."),
    pattern: Optional[str] = PATTERN_OPTION,
):
    """Compress a KV cache into a .kvz, or any file into one codec stream."""
    existing_file(src)
    if codec and recipe:
        raise UsageError("give --recipe (a .kvz of a KV cache) or --codec (a plain stream), not both")
    if codec or not (pattern or _is_kv_cache(src)):
        if recipe:
            raise UsageError(f"{src} is not a KV cache safetensors file; --recipe applies only to KV caches")
        _compress_plain(src, dst, codec or "zstd:3")
        return
    cache = api.load(src, pattern=pattern)
    parsed = Recipe.parse(recipe or DEFAULT_RECIPE)
    _require_available(parsed.codec, *parsed.plane_codecs.values())
    api.save(cache, dst, parsed, chunk_tokens=chunk_tokens, threads=threads or None, progress=True)
    if parsed.lossy:
        with container.open_kvz(dst) as reader:
            typer.echo(f"kvtool: note: {lossy_note(reader)}", err=True)


def decompress(
    src: Path = typer.Argument(..., help="A .kvz, or a file made by `kvtool compress --codec`, gzip, zstd or lz4."),
    dst: Path = typer.Argument(..., help="Output: a safetensors KV cache for a .kvz, the original bytes otherwise."),
    codec: Optional[str] = typer.Option(None, "--codec", "-c", help="Codec of a plain stream; recognised from its magic bytes when omitted."),
    layers: Optional[str] = typer.Option(None, "--layers", help="Only these layers of a .kvz, e.g. '0,7' or '0-3'."),
    tokens: Optional[str] = typer.Option(None, "--tokens", help="Only this token range of a .kvz, e.g. '0:128'."),
    threads: int = typer.Option(0, "--threads", "-t", help="Worker threads (0: one per core)."),
    max_size: str = typer.Option("16GiB", "--max-size", help="Refuse to produce more than this from a plain stream."),
):
    """Decompress a .kvz back into a safetensors cache (bit-exact, or the approximation a lossy recipe stored), or a plain stream into its bytes."""
    existing_file(src)
    if container.is_kvz(src) and not codec:
        with container.open_kvz(src) as reader, progress(total=reader.sizes()["total"]["raw"], unit="B", unit_scale=True, desc=src.name, leave=False) as bar:
            cache = reader.read(parse_layers(layers), parse_tokens(tokens), threads or None, on_progress=bar.update)
        if reader.lossy:  # the written cache keeps saying what it is
            cache.provenance["lossy_recipe"] = reader.recipe.spec()
            typer.echo(f"kvtool: note: {lossy_note(reader)}", err=True)
        cache.save(dst)
        return
    if layers or tokens:
        raise UsageError("--layers and --tokens apply only to .kvz files")
    data = src.read_bytes()
    coder = get_codec(codec) if codec else sniff_codec(data[:8])
    if coder is None:
        raise DecodeError(f"{src}: neither a .kvz nor a gzip, zstd or lz4 stream; name its codec with --codec")
    out = coder.decode(data, max_size=parse_size(max_size))
    with atomic_write(dst) as f:
        f.write(out)


def verify(
    src: Path = typer.Argument(..., help="A .kvz file."),
    full: bool = typer.Option(False, "--full", help="Also decode every chunk and check the decoded bytes."),
    json_out: bool = JSON_OPTION,
):
    """Check a .kvz's header, index and every chunk checksum."""
    existing_file(src)
    with container.open_kvz(src) as reader, progress(total=reader.sizes()["total"]["raw"], unit="B", unit_scale=True, desc=src.name, leave=False) as bar:
        reader.verify(full=full, on_progress=bar.update)
        report = {"file": str(src), "ok": True, "chunks": len(reader.index), "decoded": full, "lossy": reader.lossy is not None}
        note = f" ({lossy_note(reader)}; the checksums cover what was stored)" if reader.lossy else ""
    if json_out:
        print_json(report)
    else:
        typer.echo(f"{src}: ok, {report['chunks']} chunks verified{' and decoded' if full else ''}{note}")


def parse_layers(text: str | None) -> list[int] | None:
    """``'0,7'`` or ``'0-3,9'`` -> layer ids."""
    if not text:
        return None
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, dash, hi = part.strip().partition("-")
            out.extend(range(int(lo), int(hi) + 1) if dash else [int(lo)])
    except ValueError:
        raise UsageError(f"bad layer list {text!r}; write e.g. '0,7' or '0-3'") from None
    return out


def parse_tokens(text: str | None) -> slice | None:
    """``'0:128'``, ``':128'``, ``'256:'`` -> a slice."""
    if not text:
        return None
    lo, colon, hi = text.partition(":")
    try:
        if not colon:
            raise ValueError
        return slice(int(lo) if lo.strip() else None, int(hi) if hi.strip() else None)
    except ValueError:
        raise UsageError(f"bad token range {text!r}; write e.g. '0:128'") from None


def _is_kv_cache(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            return (f.metadata() or {}).get("kvtool.format") == FORMAT_TAG
    except Exception:  # not a safetensors file at all: a plain file
        return False


def _compress_plain(src: Path, dst: Path, codec_spec: str) -> None:
    coder = get_codec(codec_spec)
    _require_available(coder)
    data = src.read_bytes()
    with atomic_write(dst) as f:
        f.write(coder.encode(data))


def _require_available(*codecs) -> None:
    for coder in codecs:
        avail = type(coder).available()
        if not avail.ok:
            raise UnavailableError(f"codec {coder.codec_id!r} is unavailable: {avail.reason}")


def register(app: typer.Typer) -> None:
    app.command("compress")(compress)
    app.command("decompress")(decompress)
    app.command("verify")(verify)
