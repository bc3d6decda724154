"""``kvtool train``: learn a model dictionary (.kvd) from real caches of a model: context models for the ``ctxans``
and ``ctxtans`` codecs, or (``--basis``) transform bases for the ``pca`` stage."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer

from kvtool import api
from kvtool.cli._common import JSON_OPTION, Command, existing_file, print_json, progress
from kvtool.cli.dicts import DICT_OPTION, use_dictionaries
from kvtool.errors import UsageError
from kvtool.fileio import atomic_write
from kvtool.modeldict import basis_train
from kvtool.modeldict import train as trainer
from kvtool.modeldict.basis import MAX_CLASSES
from kvtool.units import format_size


def train(
    caches: List[Path] = typer.Argument(..., help="KV caches of one model (safetensors dumps or .kvz files)."),
    out: Path = typer.Option(..., "--out", "-o", help="Where to write the dictionary (NAME.kvd)."),
    classes: Optional[int] = typer.Option(
        None, "--classes", min=1, max=64,
        help=f"Channel classes to learn [default: {trainer.DEFAULT_CLASSES}; with --basis, coefficient tables, "
             f"{basis_train.DEFAULT_CLASSES}, at most {MAX_CLASSES}].",
    ),
    chunk_tokens: int = typer.Option(256, "--chunk-tokens", min=1, help="Tokens per block, as the caches will be stored."),
    basis: bool = typer.Option(False, "--basis", help="Learn a transform dictionary (PCA bases) for the pca stage instead."),
    rope_theta: Optional[float] = typer.Option(
        None, "--rope-theta", min=1.0,
        help="With --basis: de-rotate keys with this rotary base (the model config's rope_theta, e.g. 100000 for "
             "SmolLM2) before learning and applying their bases.",
    ),
    components: Optional[int] = typer.Option(
        None, "--components", min=1, help="With --basis: keep each tensor's first N components (a smaller dictionary) [default: all].",
    ),
    dictionaries: Optional[List[Path]] = DICT_OPTION,
    json_out: bool = JSON_OPTION,
):
    """Learn a model dictionary from caches of a model; use it as the recipe `ctxans:NAME.kvd` (or, with --basis, `pca:NAME.kvd,step=0.3|zstd:1`).

    A cache coded with a dictionary records its id (a hash of its content); decoding finds the dictionary by that id beside the file, with --dict, on KVTOOL_DICT_PATH, in the recipe, or in the store that holds the cache.
    """
    for path in caches:
        existing_file(path)
    if (rope_theta is not None or components is not None) and not basis:
        raise UsageError("--rope-theta and --components apply to a transform dictionary: add --basis")
    if basis and classes is not None and classes > MAX_CLASSES:
        raise UsageError(f"--basis learns at most {MAX_CLASSES} coefficient tables, not {classes}")
    use_dictionaries(caches, dictionaries)
    loaded = (cache for _, cache in api.iter_caches(caches))
    with progress(desc="train", unit="cache", total=len(caches)) as bar:
        def step(_: str) -> None:
            bar.update()

        dictionary: Any
        if basis:
            dictionary = basis_train.train_basis(loaded, rope_theta, classes or basis_train.DEFAULT_CLASSES, chunk_tokens, step,
                                                 components)
        else:
            dictionary = trainer.train(loaded, classes=classes or trainer.DEFAULT_CLASSES, chunk_tokens=chunk_tokens)
    data = dictionary.to_bytes()
    with atomic_write(out) as f:
        f.write(data)
    report = {"out": str(out), "id": dictionary.id, "bytes": len(data), **dictionary.meta}
    if json_out:
        print_json(report)
        return
    texts = ", ".join(source["text"] for source in dictionary.meta["trained_on"])
    if basis:
        typer.echo(
            f"{out}: transform dictionary {dictionary.id}, {format_size(len(data))}, {dictionary.describe()}, keys "
            f"{'de-rotated' if dictionary.rope else 'as stored'}, from {texts}. Use it as --recipe 'pca:{out},step=0.3|zstd:1'; "
            f"a reader finds it beside the .kvz, with --dict {out}, or on KVTOOL_DICT_PATH"
        )
        return
    typer.echo(
        f"{out}: dictionary {dictionary.id}, {format_size(len(data))}, {dictionary.classes} classes x "
        f"{dictionary.contexts} contexts, from {texts}; {dictionary.meta['bits_per_value']} bits per value "
        f"for sign, exponent and top mantissa bit there. Use it as --recipe 'ctxans:{out}'; "
        f"a reader finds it beside the .kvz, with --dict {out}, or on KVTOOL_DICT_PATH"
    )


def register(app: typer.Typer) -> None:
    app.command("train", cls=Command)(train)
