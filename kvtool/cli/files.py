"""``kvtool compress`` / ``decompress`` / ``verify``.

A KV cache (a safetensors dump) compresses into a ``.kvz`` container with a
recipe; any other file compresses into one plain codec stream, so standard tools
read it (``gzip -d`` for qat and isal, ``zstd -d``, ``lz4 -d``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, List, Optional

import typer

from kvtool import api, kvz
from kvtool.cache import FORMAT_TAG
from kvtool.cli._common import JSON_OPTION, MAX_THREADS, REORDERED_TAG, Command, distinct_output, existing_file, print_json, print_result, progress
from kvtool.cli.dicts import DICT_OPTION, use_dictionaries
from kvtool.cli.inspect import lossy_note
from kvtool.codecs import get_codec, sniff_codec
from kvtool.dtypes import register_numpy_types
from kvtool.errors import DecodeError, UnavailableError, UsageError
from kvtool.fileio import atomic_write
from kvtool.kvz.extract import extract_safetensors
from kvtool.recipe import DEFAULT_RECIPE, Recipe
from kvtool.units import format_size, parse_size

PATTERN_OPTION = typer.Option(
    None, "--pattern", help="Read SRC as a KV cache whose tensors are named like 'model.layers.{layer}.self_attn.{k|v}'."
)
THREADS_OPTION = typer.Option(0, "--threads", "-t", min=0, max=MAX_THREADS, help="Worker threads (0: one per core).")
MAX_SIZE_OPTION = typer.Option(
    "16GiB", "--max-size", help="Refuse to decode more than this many bytes (e.g. 512MiB), checked before decoding."
)
log = logging.getLogger("kvtool.cli.files")

MAX_EXPANSION_OPTION = typer.Option(
    kvz.DEFAULT_MAX_EXPANSION, "--max-expansion", min=1,
    help="Refuse a token block that would decode to more than this many times its stored size, checked before decoding.",
)
#: More layer ids than any model has; a longer --layers list is a typo, not a request.
MAX_LAYER_SELECTION = 1 << 16


def compress(
    src: Path = typer.Argument(..., help="A KV cache (.safetensors) or any file."),
    dst: Path = typer.Argument(..., help="Output: a .kvz for a KV cache, a plain codec stream otherwise."),
    recipe: Optional[str] = typer.Option(
        None, "--recipe", "-r", show_default=DEFAULT_RECIPE,
        help="Recipe for a KV cache, e.g. 'byteplane|zstd:1'; lossy only when it names a lossy stage, e.g. 'int:6,group=64|zstd:3'.",
    ),
    codec: Optional[str] = typer.Option(None, "--codec", "-c", help="Write one plain codec stream (ID[:LEVEL]) instead of a .kvz."),
    chunk_tokens: int = typer.Option(kvz.DEFAULT_CHUNK_TOKENS, "--chunk-tokens", help="Tokens per chunk in a .kvz."),
    threads: int = THREADS_OPTION,
    pattern: Optional[str] = PATTERN_OPTION,
    json_out: bool = JSON_OPTION,
):
    """Compress a KV cache into a .kvz, or any file into one codec stream."""
    register_numpy_types()  # before the clock: the time reported is the command's work, not Python's start-up
    started = time.perf_counter()
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
        log.info("compressing %s as one plain %s stream into %s", src, codec or "zstd:3", dst)
        _compress_plain(src, dst, codec or "zstd:3")
        _summary(src, dst, src.stat().st_size / max(dst.stat().st_size, 1), {"codec": codec or "zstd:3"}, started, json_out)
        return
    log.info("reading the KV cache %s", src)
    cache = api.load(src, pattern=pattern)
    log.info("read %d layers x K/V of %d tokens, %s (%s)", cache.num_layers, cache.num_tokens, cache.dtype.name,
             format_size(cache.nbytes))
    parsed = Recipe.parse(recipe or DEFAULT_RECIPE)
    _require_available(parsed.codec, *parsed.plane_codecs.values())
    log.info("encoding with %s in chunks of %d tokens into %s", parsed.spec(), chunk_tokens, dst)
    api.save(cache, dst, parsed, chunk_tokens=chunk_tokens, threads=threads or None, progress=True)
    log.info("wrote %s (%s)", dst, format_size(dst.stat().st_size))
    if parsed.lossy:
        with kvz.open_kvz(dst) as reader:
            typer.echo(f"kvtool: note: {lossy_note(reader)}", err=True)
    _summary(src, dst, cache.nbytes / max(dst.stat().st_size, 1), {"recipe": parsed.spec()}, started, json_out)


def decompress(
    src: Path = typer.Argument(..., help="A .kvz, or a file made by `kvtool compress --codec`, gzip, zstd or lz4."),
    dst: Path = typer.Argument(..., help="Output: a safetensors KV cache for a .kvz, the original bytes otherwise."),
    codec: Optional[str] = typer.Option(None, "--codec", "-c", help="Codec of a plain stream; recognised from its magic bytes when omitted."),
    layers: Optional[str] = typer.Option(None, "--layers", help="Only these layers of a .kvz, e.g. '0,7' or '0-3'."),
    tokens: Optional[str] = typer.Option(None, "--tokens", help="Only this token range of a .kvz, e.g. '0:128'."),
    threads: int = THREADS_OPTION,
    max_size: str = MAX_SIZE_OPTION,
    dictionaries: Optional[List[Path]] = DICT_OPTION,
    max_expansion: int = MAX_EXPANSION_OPTION,
    json_out: bool = JSON_OPTION,
):
    """Decompress a .kvz back into a safetensors cache (bit-exact, or the approximation a lossy recipe stored), or a plain stream into its bytes."""
    register_numpy_types()  # before the clock, as in compress
    started = time.perf_counter()
    distinct_output(existing_file(src), dst)
    limit = parse_size(max_size)
    if kvz.is_kvz(src) and not codec:
        use_dictionaries([src], dictionaries)
        selected_layers, selected_tokens = parse_layers(layers), parse_tokens(tokens)
        with kvz.open_kvz(src, max_size=limit, max_expansion=max_expansion) as reader, progress(total=reader.sizes()["total"]["raw"], unit="B", unit_scale=True, desc=src.name, leave=False) as bar:
            check_token_range(selected_tokens, reader.num_tokens)
            log.info("decoding %s (recipe %s) into %s", src, reader.recipe.spec(), dst)
            # the written cache keeps saying what it is
            provenance = {**reader.provenance, "lossy_recipe": reader.recipe.spec()} if reader.lossy else None
            written = extract_safetensors(reader, dst, selected_layers, selected_tokens, provenance, threads or None, bar.update)
        if reader.lossy:
            typer.echo(f"kvtool: note: {lossy_note(reader)}", err=True)
        if layers or tokens:  # a part of the file: its ratio says nothing
            selection = {"layers": written.layer_ids, "tokens": _token_text(selected_tokens, written.num_tokens)}
            _summary(src, dst, None, selection, started, json_out)
        else:
            _summary(src, dst, written.nbytes / max(src.stat().st_size, 1), {}, started, json_out)
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
    _summary(src, dst, len(out) / max(len(data), 1), {"codec": coder.codec_id}, started, json_out)


def verify(
    src: Path = typer.Argument(..., help="A .kvz file."),
    full: bool = typer.Option(False, "--full", help="Also decode every chunk and check the decoded bytes."),
    max_size: str = MAX_SIZE_OPTION,
    dictionaries: Optional[List[Path]] = DICT_OPTION,
    max_expansion: int = MAX_EXPANSION_OPTION,
    json_out: bool = JSON_OPTION,
):
    """Check a .kvz's header, index and every chunk checksum."""
    existing_file(src)
    use_dictionaries([src], dictionaries)
    log.info("reading the header and index of %s", src)
    with kvz.open_kvz(src, max_size=parse_size(max_size), max_expansion=max_expansion) as reader, progress(total=reader.sizes()["total"]["raw"], unit="B", unit_scale=True, desc=src.name, leave=False) as bar:
        log.info("%s: recipe %s, %d chunks; %s", src, reader.recipe.spec(), len(reader.index),
                 "checking every checksum, then decoding every chunk" if full else "checking every checksum")
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
    """``'0:128'``, ``':128'``, ``'256:'`` -> a slice of token positions, counted from the cache's first token."""
    if not text:
        return None
    lo, colon, hi = (s.strip() for s in text.partition(":"))
    if not colon or not all(not s or (s.isascii() and s.isdigit()) for s in (lo, hi)):
        raise UsageError(f"bad token range {text[:80]!r}; write e.g. '0:128', ':128' or '256:' (positions from 0)")
    start, stop = int(lo) if lo else None, int(hi) if hi else None
    if start is not None and stop is not None and start >= stop:
        raise UsageError(f"token range {text!r} is empty; write START:STOP with START below STOP")
    return slice(start, stop)


def check_token_range(tokens: slice | None, num_tokens: int) -> None:
    """Refuse a token range that runs past the cache, rather than clip it silently."""
    if tokens is None:
        return
    past = [n for n in (tokens.start, tokens.stop) if n is not None and n > num_tokens]
    if past or (tokens.start is not None and tokens.start == num_tokens):
        start = tokens.start or 0
        raise UsageError(
            f"--tokens {start}:{'' if tokens.stop is None else tokens.stop} runs past the cache, which holds "
            f"{num_tokens} tokens; write e.g. '{min(start, max(num_tokens - 1, 0))}:{num_tokens}' or '{min(start, max(num_tokens - 1, 0))}:'"
        )


def _not_a_kv_cache(path: Path) -> str | None:
    """Why ``path`` is not a kvtool KV cache in safetensors, or None when it is one."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            tag = (f.metadata() or {}).get("kvtool.format")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own types: a plain file, or a damaged one
        return f"not a readable safetensors file: {str(exc)[:120]}"
    if tag == REORDERED_TAG:
        return "a cache's planes written by `kvtool reorder`; `kvtool reorder SRC OUT --inverse` rebuilds the cache"
    return None if tag == FORMAT_TAG else "a safetensors file without kvtool's KV cache tag; --pattern reads other tools' dumps"


def _summary(src: Path, dst: Path, ratio: float | None, how: dict[str, Any], started: float, json_out: bool) -> None:
    """One line (or JSON) saying what was written: sizes, ratio, how, and the wall time."""
    in_bytes, out_bytes, seconds = src.stat().st_size, dst.stat().st_size, time.perf_counter() - started
    data = {"in": str(src), "out": str(dst), "in_bytes": in_bytes, "out_bytes": out_bytes,
            "ratio": None if ratio is None else round(ratio, 4), **how, "seconds": round(seconds, 3)}
    facts = ([] if ratio is None else [f"ratio {ratio:.3f}"]) + [f"{k} {_show(v)}" for k, v in how.items()]
    print_result(data, f"{src} -> {dst}: {format_size(in_bytes)} -> {format_size(out_bytes)} "
                 f"({', '.join(facts)}) in {seconds:.2f} s", json_out)


def _show(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _token_text(tokens: slice | None, count: int) -> str:
    start = (tokens.start or 0) if tokens else 0
    return f"{start}:{start + count}"


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
    app.command("compress", cls=Command)(compress)
    app.command("decompress", cls=Command)(decompress)
    app.command("verify", cls=Command)(verify)
