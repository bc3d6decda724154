"""Conformance suites that every codec, layout and store must pass.

They are pytest base classes shipped in the package, so a third-party plug-in
proves itself with the same tests kvtool runs on its own components::

    from kvtool.testing import CodecTests

    class TestMyCodec(CodecTests):
        @pytest.fixture
        def codec(self):
            return MyCodec(level=3)

The suites need pytest and hypothesis (the ``test`` extra).
"""

from __future__ import annotations

import importlib
from typing import Any

#: Each suite and helper, and the module that defines it: imported when first asked for, so that a module of its
#: own here (``kvtool.testing.offload``, vLLM's side of a tier) loads where pytest's plug-ins are not installed.
_HOMES = {
    "ArrayCodecTests": "arraycodecs", "CodecTests": "codecs", "require_available": "codecs", "kv_like_bf16": "data",
    "LayoutTests": "layouts", "LossyLayoutTests": "lossy", "BoundedStoreTests": "stores",
    "SharedStoreTests": "stores", "StoreTests": "stores",
}

__all__ = ["ArrayCodecTests", "BoundedStoreTests", "CodecTests", "LayoutTests", "LossyLayoutTests", "SharedStoreTests",
           "StoreTests", "kv_like_bf16", "require_available"]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"kvtool.testing.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
