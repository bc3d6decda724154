"""The library API for pipeline scripts: load, save and iterate over KV caches.

>>> import kvtool
>>> cache = kvtool.load("samples/code.safetensors", layers=[0, 1], tokens=slice(0, 128))
>>> size = kvtool.save(cache, "/tmp/code.kvz", recipe="byteplane|zstd:1")
>>> kvtool.load("/tmp/code.kvz").equal_bits(cache)
True
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from tqdm import tqdm

from kvtool import kvz
from kvtool.cache import KVCache, ModelFacts
from kvtool.errors import OutputTooLargeError
from kvtool.recipe import DEFAULT_RECIPE, Recipe


def load(
    path: str | os.PathLike,
    layers: Sequence[int] | None = None,
    tokens: slice | None = None,
    pattern: str | None = None,
    model: ModelFacts | None = None,
    threads: int | None = None,
    max_size: int = kvz.DEFAULT_MAX_SIZE,
    max_expansion: int = kvz.DEFAULT_MAX_EXPANSION,
) -> KVCache:
    """A cache from a .kvz or a safetensors file, reading only the layers and tokens asked for.

    ``pattern`` and ``model`` describe safetensors files written by other tools
    (see ``KVCache.load``); ``threads`` decode a .kvz (all cores by default). ``max_size``
    caps the bytes decoded from a .kvz, and ``max_expansion`` how many times its stored size a
    token block may decode to; a file claiming more is refused before anything is decoded. Running
    out of memory is an ``OutputTooLargeError`` (exit status 4), as going over ``max_size`` is.
    """
    if kvz.is_kvz(path):
        with kvz.open_kvz(path, max_size=max_size, max_expansion=max_expansion) as reader:
            return reader.read(layers=layers, tokens=tokens, threads=threads)
    try:
        return KVCache.load(path, layers=layers, tokens=tokens, pattern=pattern, model=model)
    except MemoryError:
        raise OutputTooLargeError(f"{path}: out of memory reading it (fewer layers or tokens, or more memory "
                                  "may fit)") from None


def save(
    cache: KVCache,
    path: str | os.PathLike,
    recipe: Recipe | str = DEFAULT_RECIPE,
    chunk_tokens: int = kvz.DEFAULT_CHUNK_TOKENS,
    threads: int | None = None,
    metadata: dict[str, str] | None = None,
    progress: bool = False,
) -> int:
    """Write ``cache`` as a .kvz with ``recipe`` (atomically); return the file size."""
    with _bar(progress, cache.nbytes, Path(path).name) as bar:
        return kvz.save(cache, path, recipe, chunk_tokens, threads, metadata, on_progress=bar.update)


def iter_caches(
    paths: Iterable[str | os.PathLike],
    layers: Sequence[int] | None = None,
    tokens: slice | None = None,
    progress: bool = True,
) -> Iterator[tuple[Path, KVCache]]:
    """``(path, cache)`` for each file, with a progress bar over the files."""
    paths = [Path(p) for p in paths]
    for path in tqdm(paths, desc="caches", unit="file", file=sys.stderr, disable=None if progress else True):
        yield path, load(path, layers=layers, tokens=tokens)


def _bar(enabled: bool, total: int, desc: str) -> tqdm:
    """A byte progress bar on stderr: silent when disabled or when stderr is not a terminal."""
    return tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
        file=sys.stderr, disable=None if enabled else True, leave=False,
    )
