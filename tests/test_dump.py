"""``kvtool dump`` over a real model (needs the ``model`` extra) and ``kvtool import`` (does not)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from typer.testing import CliRunner

from kvtool.cache import KVCache
from kvtool.cli import app
from kvtool.errors import UnavailableError
from kvtool.sources import hf

SAMPLES = Path(__file__).resolve().parents[1] / "samples"
CODE_TEXT = SAMPLES / "texts" / "functools.py.txt"
CODE_SAMPLE = SAMPLES / "code.safetensors"
FOREIGN_PATTERN = "model.layers.{layer}.self_attn.{k|v}"
LOAD = hf.load  # the real loader, for when CLI runs reuse the module's model


def run(*args: str, input: str | None = None):
    return CliRunner().invoke(app, list(args), input=input)


# -- without torch -------------------------------------------------------------


def test_importing_the_model_source_loads_no_torch():
    code = "import sys, kvtool.cli, kvtool.sources.hf; print([m for m in ('torch', 'transformers') if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_missing_model_extra_names_it(monkeypatch):
    real = hf.importlib.util.find_spec
    monkeypatch.setattr(hf.importlib.util, "find_spec", lambda name: None if name == "torch" else real(name))
    with pytest.raises(UnavailableError, match=r"kvtool\[model\]"):
        hf.load()


def _foreign_dump(tmp_path):
    """The code sample as another tool writes it: HF tensor names, a batch axis, no kvtool metadata."""
    cache = KVCache.load(CODE_SAMPLE)
    tensors = {}
    for layer, kind, array in cache.tensors():
        tensors[f"model.layers.{layer}.self_attn.{kind}"] = np.ascontiguousarray(array[None])
    path = tmp_path / "foreign.safetensors"
    path.write_bytes(safetensors.numpy.save(tensors))
    return cache, path


def test_import_adopts_a_foreign_dump(tmp_path):
    original, foreign = _foreign_dump(tmp_path)
    out = tmp_path / "ours.safetensors"
    result = run(
        "import", str(foreign), "-o", str(out), "--pattern", FOREIGN_PATTERN,
        "--model-id", "SmolLM2-135M-Instruct", "--architecture", "llama", "--keys-post-rope", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["layers"], report["kv_heads"], report["tokens"], report["head_dim"]) == (30, 3, 256, 64)
    adopted = KVCache.load(out)
    assert adopted.equal_bits(original)
    assert adopted.model.model_id == "SmolLM2-135M-Instruct"
    assert adopted.model.architecture == "llama"
    assert adopted.model.keys_post_rope is True
    assert (adopted.model.num_layers, adopted.model.num_kv_heads, adopted.model.head_dim) == (30, 3, 64)
    assert adopted.provenance["source"] == "import"


def test_import_with_a_pattern_that_matches_nothing_fails_in_one_line(tmp_path):
    _, foreign = _foreign_dump(tmp_path)
    result = run("import", str(foreign), "-o", str(tmp_path / "x.safetensors"), "--pattern", "L{layer}.{k|v}")
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "no tensor matches" in result.stderr
    assert not (tmp_path / "x.safetensors").exists()


# -- with the model extra ------------------------------------------------------


@pytest.fixture(scope="module")
def loaded():
    for name in ("torch", "transformers"):
        pytest.importorskip(name, reason="needs the model extra: pip install 'kvtool[model]'")
    return hf.load()


@pytest.fixture
def cli_model(loaded, monkeypatch):
    """Let CLI runs reuse the module's model instead of loading it again."""
    monkeypatch.setattr(hf, "load", lambda model=None: loaded)


def test_dump_reproduces_the_committed_sample(cli_model, tmp_path):
    out = tmp_path / "code64.safetensors"
    result = run("dump", str(CODE_TEXT), "-o", str(out), "--max-tokens", "64", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["tokens"] == 64 and report["bytes_per_token"] == 23040 and report["dtype"] == "bf16"
    assert report["next_token_accuracy"] > 0.3

    cache = KVCache.load(out)
    assert cache.dtype.name == "bf16" and cache.num_layers == 30
    assert {a.shape for a in cache.keys + cache.values} == {(3, 64, 64)}
    facts = cache.model
    assert (facts.architecture, facts.num_layers, facts.num_kv_heads, facts.head_dim) == ("llama", 30, 3, 64)
    assert facts.keys_post_rope is True
    prov = cache.provenance
    assert prov["token_count"] == 64 and prov["text_name"] == CODE_TEXT.name
    assert prov["next_token_accuracy"] == report["next_token_accuracy"]
    # A causal LM's cache of a prefix does not depend on later tokens, and both runs fit one chunk.
    assert cache.equal_bits(KVCache.load(CODE_SAMPLE, tokens=slice(0, 64))), (
        "the 64-token dump differs from the committed sample's first 64 tokens: "
        "a different torch build or CPU computes other fp32 roundings"
    )


def test_dump_fp16_from_stdin_agrees_with_bf16(cli_model, tmp_path):
    out = tmp_path / "stdin.safetensors"
    text = CODE_TEXT.read_text(encoding="utf-8")
    result = run("dump", "-", "-o", str(out), "--max-tokens", "32", "--dtype", "fp16", input=text)
    assert result.exit_code == 0, result.output
    cache = KVCache.load(out)
    assert cache.dtype.name == "fp16" and cache.num_tokens == 32
    assert cache.provenance["text_name"] == "stdin"
    sample = KVCache.load(CODE_SAMPLE, tokens=slice(0, 32))
    # Both are roundings of the same fp32 tensors; bf16 keeps 8 significant bits.
    for a, b in zip(cache.keys + cache.values, sample.keys + sample.values):
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=2**-8, atol=1e-3)


def test_chunked_prefill_matches_one_chunk_closely(loaded):
    text = CODE_TEXT.read_text(encoding="utf-8")
    whole = hf.prefill(loaded, text, text_name="t", max_tokens=48, chunk_tokens=48, dtype="fp16")
    chunked = hf.prefill(loaded, text, text_name="t", max_tokens=48, chunk_tokens=16, dtype="fp16")
    assert chunked.provenance["token_ids_hash"] == whole.provenance["token_ids_hash"]
    for a, b in zip(chunked.keys + chunked.values, whole.keys + whole.values):
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=2**-9, atol=1e-3)


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--dtype", "fp8_e4m3"], "cache dtype"), (["--chunk-tokens", "0"], "chunk-tokens")],
)
def test_dump_rejects_bad_options(cli_model, tmp_path, args, message):
    result = run("dump", str(CODE_TEXT), "-o", str(tmp_path / "x.safetensors"), "--max-tokens", "8", *args)
    assert result.exit_code == 2 and message in result.stderr


def test_dump_of_empty_text_fails_cleanly(cli_model, tmp_path):
    result = run("dump", "-", "-o", str(tmp_path / "x.safetensors"), input="")
    assert result.exit_code == 2 and "no tokens" in result.stderr


def test_convert_model_writes_a_plain_folder_with_the_same_model(cli_model, tmp_path):
    out = tmp_path / "smollm2"
    result = run("convert-model", str(out), "--dtype", "fp32")  # fp32 keeps the dequantised weights exactly
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["num_key_value_heads"] == 3
    assert not list(tmp_path.glob("*.part"))
    text = CODE_TEXT.read_text(encoding="utf-8")
    cache = hf.prefill(LOAD(out), text, text_name="t", max_tokens=16)
    assert cache.equal_bits(KVCache.load(CODE_SAMPLE, tokens=slice(0, 16)))
