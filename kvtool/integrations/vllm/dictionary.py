"""The connector's model dictionary: given in its config, or learnt from the first entries it saves.

The ``dictionary`` setting (with a recipe whose codec codes with a model dictionary:
``ctxans``, ``ctxtans``) is a ``.kvd`` file to code
entries with, or ``train`` / ``train:TOKENS``: code with the recipe as given
until the connector has saved TOKENS tokens (default 2048), learn a dictionary
from them on a background thread, then code with it. Either way the dictionary
goes into the store beside the entries (``kvtool.store.dicts``), and the store
is attached, so every process that reads the store decodes them. Entry keys
name the configured recipe, not the dictionary: an entry coded before the
dictionary was learnt and one coded after are both found, and each names the
dictionary it needs in its own header.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Sequence

import numpy as np

from kvtool.cache import KVCache, ModelFacts
from kvtool.codecs.dictionary_codec import DictionaryCodec
from kvtool.errors import UsageError
from kvtool.modeldict import registry
from kvtool.modeldict.format import Dictionary
from kvtool.modeldict.train import train
from kvtool.recipe import Recipe
from kvtool.store import Store, dicts

log = logging.getLogger("kvtool.vllm")

DEFAULT_TRAIN_TOKENS = 2048


def check_setting(setting: str | None, recipe: str) -> None:
    """Refuse a ``dictionary`` setting that cannot work, at startup."""
    if setting is None:
        return
    if not isinstance(setting, str):
        raise UsageError(f"dictionary must be a .kvd file or 'train[:TOKENS]', not {setting!r}")
    if not Recipe.parse(recipe).codec.uses_dictionary:
        raise UsageError(f"the dictionary option needs a recipe whose codec codes with a model dictionary (such as "
                         f"ctxtans), not {recipe!r}")
    if setting.startswith("train"):
        _train_tokens(setting)
    elif not Path(setting).is_file():
        raise UsageError(f"dictionary must be a .kvd file or 'train[:TOKENS]', not {setting!r}")


def _train_tokens(setting: str) -> int:
    name, _, tokens = setting.partition(":")
    if name != "train" or (tokens and not tokens.isdigit()) or (tokens and int(tokens) < 1):
        raise UsageError(f"dictionary must be a .kvd file or 'train[:TOKENS]', not {setting!r}")
    return int(tokens) if tokens else DEFAULT_TRAIN_TOKENS


class DictionaryKeeper:
    """The recipe each saved entry is coded with, and the dictionaries kept in the store."""

    def __init__(self, setting: str | None, recipe: str, store: Store, facts: ModelFacts):
        self._store = store
        self._facts = facts
        self._recipe = Recipe.parse(recipe).spec()
        self._codec = Recipe.parse(recipe).codec.codec_id  # the codec a dictionary, given or learnt, is used with
        self._lock = threading.Lock()
        self._learning: list[KVCache] | None = None
        self._target = 0
        registry.attach(dicts.source(store))
        if setting is not None and setting.startswith("train"):
            self._learning, self._target = [], _train_tokens(setting)
        elif setting is not None:
            self._recipe = f"{self._codec}:{registry.load(setting).id}"
        dicts.publish_all(store, dictionaries_of(self._recipe))

    def recipe_for(self, keys: Sequence[np.ndarray], values: Sequence[np.ndarray]) -> str:
        """The recipe to code this entry with; while learning, the entry joins the training set."""
        with self._lock:
            if self._learning is not None:
                self._learning.append(KVCache([np.array(k) for k in keys], [np.array(v) for v in values], self._facts))
                if sum(c.num_tokens for c in self._learning) >= self._target:
                    caches, self._learning = self._learning, None
                    threading.Thread(target=self._learn, args=(caches,), name="kvtool-train", daemon=True).start()
            return self._recipe

    def _learn(self, caches: list[KVCache]) -> None:
        try:
            dictionary = train(caches)
        except Exception:
            log.exception("kvtool: learning a dictionary failed; entries keep the recipe %s", self._recipe)
            return
        registry.register(dictionary)
        recipe = f"{self._codec}:{dictionary.id}"
        if not dicts.publish(self._store, dictionary):
            log.warning("kvtool: the store refused dictionary %s; entries keep the recipe %s", dictionary.id, self._recipe)
            return
        with self._lock:
            self._recipe = recipe
        log.info("kvtool: learnt dictionary %s from %d tokens; entries now use %s", dictionary.id,
                 sum(c.num_tokens for c in caches), recipe)

    @property
    def recipe(self) -> str:
        with self._lock:
            return self._recipe


def dictionaries_of(recipe: str) -> list[Dictionary]:
    """The model dictionaries ``recipe`` codes with (none for most recipes)."""
    parsed = Recipe.parse(recipe)
    coders = [parsed.codec, *parsed.plane_codecs.values()]
    return [coder.dictionary() for coder in coders if isinstance(coder, DictionaryCodec)]
