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
from kvtool.cli._common import JSON_OPTION, distinct_output, existing_file, print_json, progress
from kvtool.cli.inspect import lossy_note
from kvtool.codecs import get_codec, sniff_codec
from kvtool.errors import DecodeError, UnavailableError, UsageError
from kvtool.fileio import atomic_write
from kvtool.recipe import DEFAULT_RECIPE, Recipe
from kvtool.units import parse_size

PATTERN_OPTION = typer.Option(
    None, "--pattern", help="Treat IN as a KV cache whose tensors are named like 'model.layers.{layer}.self_attn.{k|v}'."
)
THREADS_OPTION = typer.Option(0, "--threads", "-t", min=0, help="Worker threads (0: one per core).")
MAX_SIZE_OPTION = typer.Option(
    "16GiB", "--max-size", help="Refuse to decode more than this many bytes (e.g. 512MiB), checked before decoding."
)
#: More layer ids than any model has; a longer --layers list is a typo, not a request.
MAX_LAYER_SELECTION = 1 << 16


def compress(
    src: Path = typer.Argument(..., help="A KV cache (.safetensors) or any file."),
    dst: Path = typer.Argument(..., help="Output: a .kvz for a KV cache, a plain codec stream otherwise."),
    recipe: Optional[str] = typer.Option(
        None, "--recipe", "-r",
        help=f"Recipe for a KV cache [default: {DEFAULT_RECIPE}]; lossy only when it names a lossy stage, e.g. 'int:6,group=64|zstd:3'.",
    ),
    codec: Optional[str] = typer.Option(None, "--codec", "-c", help="Write one plain codec stream (ID[:LEVEL]) instead of a .kvz."),
    chunk_tokens: int = typer.Option(container.DEFAULT_CHUNK_TOKENS, "--chunk-tokens", help="Tokens per chunk in a .kvz."),
    threads: int = THREADS_OPTION,
    pattern: Optional[str] = PATTERN_OPTION,
):
    """Compress a KV cache into a .kvz, or any file into one codec stream."""
    distinct_output(existing_file(src), dst)
    if codec and recipe:
        raise UsageError("give --recipe (a .kvz of a KV cache) or --codec (a plain stream), not both")
    not_kv = None if pattern else _not_a_kv_cache(src)
    if codec or not_kv:
        if recipe:
            raise UsageError(f"{src} is not a KV cache ({not_kv}); --recipe applies only to KV caches")
        if dst.suffix == ".kvz":
            why = "--codec writes a plain codec stream" if codec else f"{src} is not a KV cache ({not_kv})"
            raise UsageError(f"{why}, but {dst.name} is named as a .kvz container; name the output otherwise, e.g. {dst.stem}.zst")
        if not codec and src.suffix == ".safetensors":
            typer.echo(f"kvtool: {src} is not a KV cache ({not_kv}); writing one plain zstd:3 stream", err=True)
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
    threads: int = THREADS_OPTION,
    max_size: str = MAX_SIZE_OPTION,
):
    """Decompress a .kvz back into a safetensors cache (bit-exact, or the approximation a lossy recipe stored), or a plain stream into its bytes."""
    distinct_output(existing_file(src), dst)
    limit = parse_size(max_size)
    if container.is_kvz(src) and not codec:
        with container.open_kvz(src, max_size=limit) as reader, progress(total=reader.sizes()["total"]["raw"], unit="B", unit_scale=True, desc=src.name, leave=False) as bar:
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
    out = coder.decode(data, max_size=limit)
    with atomic_write(dst) as f:
        f.write(out)


def verify(
    src: Path = typer.Argument(..., help="A .kvz file."),
    full: bool = typer.Option(False, "--full", help="Also decode every chunk and check the decoded bytes."),
    max_size: str = MAX_SIZE_OPTION,
    json_out: bool = JSON_OPTION,
):
    """Check a .kvz's header, index and every chunk checksum."""
    existing_file(src)
    with container.open_kvz(src, max_size=parse_size(max_size)) as reader, progress(total=reader.sizes()["total"]["raw"], unit="B", unit_scale=True, desc=src.name, leave=False) as bar:
        reader.verify(full=full, on_progress=bar.update)
        report = {"file": str(src), "ok": True, "chunks": len(reader.index), "decoded": full, "lossy": reader.lossy is not None}
        note = f" ({lossy_note(reader)}; the checksums cover what was stored)" if reader.lossy else ""
    if json_out:
        print_json(report)
    else:
        typer.echo(f"{src}: ok, {report['chunks']} chunks verified{' and decoded' if full else ''}{note}")


def parse_layers(text: str | None) -> list[int] | None:
    """``'0,7'`` or ``'0-3,9'`` -> layer ids, each once, ranges from low to high."""
    if not text:
        return None
    bad = UsageError(f"bad layer list {text[:80]!r}; write e.g. '0,7' or '0-3'")
    out: list[int] = []
    for part in text.split(","):
        lo, dash, hi = (s.strip() for s in part.partition("-"))
        if not (lo.isascii() and lo.isdigit()) or (dash and not (hi.isascii() and hi.isdigit())):
            raise bad
        first, last = int(lo), int(hi) if dash else int(lo)
        if first > last:
            raise UsageError(f"layer range {part.strip()!r} runs backwards; write it low to high, e.g. '{last}-{first}'")
        if len(out) + last - first + 1 > MAX_LAYER_SELECTION:
            raise UsageError(f"layer list {text[:80]!r} names more than {MAX_LAYER_SELECTION} layers")
        out.extend(range(first, last + 1))
    if len(set(out)) != len(out):
        raise UsageError(f"layer list {text[:80]!r} names a layer twice")
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


def _not_a_kv_cache(path: Path) -> str | None:
    """Why ``path`` is not a kvtool KV cache in safetensors, or None when it is one."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            tagged = (f.metadata() or {}).get("kvtool.format") == FORMAT_TAG
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own types: a plain file, or a damaged one
        return f"not a readable safetensors file: {str(exc)[:120]}"
    return None if tagged else "a safetensors file without kvtool's KV cache tag; --pattern reads other tools' dumps"


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
