"""Conformance suites that every codec, layout and store must pass.

They are pytest base classes shipped in the package, so a third-party plug-in
proves itself with the same tests kvtool runs on its own components::

    from kvtool.testing import CodecTests

    class TestMyCodec(CodecTests):
        @pytest.fixture
        def codec(self):
            return MyCodec(level=3)

Importing this module needs pytest (the ``test`` extra).
"""

from kvtool.testing.arraycodecs import ArrayCodecTests
from kvtool.testing.codecs import CodecTests, require_available
from kvtool.testing.data import kv_like_bf16
from kvtool.testing.layouts import LayoutTests
from kvtool.testing.lossy import LossyLayoutTests
from kvtool.testing.stores import BoundedStoreTests, SharedStoreTests, StoreTests

__all__ = ["ArrayCodecTests", "BoundedStoreTests", "CodecTests", "LayoutTests", "LossyLayoutTests", "SharedStoreTests",
           "StoreTests", "kv_like_bf16", "require_available"]
