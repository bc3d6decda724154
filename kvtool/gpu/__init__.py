"""GPU decoders (Triton) of kvtool's formats, straight into paged KV blocks: the chunks of codecs that say
``gpu_decodes`` (today exphuff-lanes).

An optional extra (``pip install kvtool[gpu]``: Triton; torch comes with the
serving stack). Nothing here is imported by ``import kvtool``. ``status()``
says whether the GPU path can run and, if not, why; the kernels also run in
Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors, which is how the
tests prove them equal to the numpy reference without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def interpreted() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``): kernels on CPU tensors, slowly."""
    return os.environ.get("TRITON_INTERPRET", "0").strip() not in ("", "0")


def status() -> tuple[bool, str]:
    """(whether GPU decoding can run here, in words how or why not)."""
    for module, extra in (("torch", "torch"), ("triton", "kvtool[gpu]")):
        if importlib.util.find_spec(module) is None:
            return False, f"{module} is not installed (pip install {extra})"
    import torch
    import triton

    if interpreted():
        return True, f"Triton {triton.__version__} interpreter on CPU tensors (TRITON_INTERPRET=1; for tests, slow)"
    if not torch.cuda.is_available():
        return False, f"no CUDA device visible to torch {torch.__version__} (Triton {triton.__version__} is installed)"
    return True, f"Triton {triton.__version__} on {torch.cuda.get_device_name()}"


def dtype_name(dtype: torch.dtype) -> str | None:
    """kvtool's name of a torch dtype the GPU decoder writes (bf16, fp16, fp32, both fp8), or None."""
    import torch

    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    for attr, name in (("float8_e4m3fn", "fp8_e4m3"), ("float8_e5m2", "fp8_e5m2")):
        if hasattr(torch, attr):
            names[getattr(torch, attr)] = name
    return names.get(dtype)
