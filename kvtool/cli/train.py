"""``kvtool train``: learn a model dictionary (.kvd) for the ``ctxans`` codec from real caches of a model."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from kvtool import api
from kvtool.cli._common import JSON_OPTION, Command, existing_file, print_json
from kvtool.cli.dicts import DICT_OPTION, use_dictionaries
from kvtool.fileio import atomic_write
from kvtool.modeldict import train as trainer
from kvtool.units import format_size


def train(
    caches: List[Path] = typer.Argument(..., help="KV caches of one model (safetensors dumps or .kvz files)."),
    out: Path = typer.Option(..., "--out", "-o", help="Where to write the dictionary (NAME.kvd)."),
    classes: int = typer.Option(trainer.DEFAULT_CLASSES, "--classes", min=1, max=64, help="Channel classes to learn."),
    chunk_tokens: int = typer.Option(256, "--chunk-tokens", min=1, help="Tokens per block, as the caches will be stored."),
    dictionaries: Optional[List[Path]] = DICT_OPTION,
    json_out: bool = JSON_OPTION,
):
    """Learn a model dictionary from caches of a model; use it as the recipe `ctxans:NAME.kvd`.

    A cache coded with a dictionary records its id (a hash of its content); decoding finds the dictionary by that id beside the file, with --dict, on KVTOOL_DICT_PATH, in the recipe, or in the store that holds the cache.
    """
    for path in caches:
        existing_file(path)
    use_dictionaries(caches, dictionaries)
    loaded = (cache for _, cache in api.iter_caches(caches))
    dictionary = trainer.train(loaded, classes=classes, chunk_tokens=chunk_tokens)
    data = dictionary.to_bytes()
    with atomic_write(out) as f:
        f.write(data)
    report = {"out": str(out), "id": dictionary.id, "bytes": len(data), **dictionary.meta}
    if json_out:
        print_json(report)
        return
    texts = ", ".join(source["text"] for source in dictionary.meta["trained_on"])
    typer.echo(
        f"{out}: dictionary {dictionary.id}, {format_size(len(data))}, {dictionary.classes} classes x "
        f"{dictionary.contexts} contexts, from {texts}; {dictionary.meta['bits_per_value']} bits per value "
        f"for sign, exponent and top mantissa bit there. Use it as --recipe 'ctxans:{out}'; "
        f"a reader finds it beside the .kvz, with --dict {out}, or on KVTOOL_DICT_PATH"
    )


def register(app: typer.Typer) -> None:
    app.command("train", cls=Command)(train)
