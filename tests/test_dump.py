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


# How far a dump on another CPU may lie from the committed sample (made on an AMD CPU with AVX2).
# benchmarks/rounding.py measures the sample's first 64 tokens against the same tokens computed in
# fp64, which no fp32 rounding reaches: 689 of 737,280 bf16 values (0.09%) differ, each by at most
# one bf16 unit in the last place (2^-7 relative) or 0.016 absolute, and the next-token accuracy is
# the same. Another CPU's fp32 dump deviates from fp64 about as much, so it may differ from the
# sample by twice that; the share of differing values is allowed ten times the measured share.
RTOL, ATOL = 2**-6, 2e-3
MAX_DIFFERING_SHARE = 0.01
ACCURACY_64 = 24 / 63  # of the sample's first 64 tokens, measured by benchmarks/rounding.py


def assert_agrees_with_sample(cache: KVCache, tokens: int) -> None:
    sample = KVCache.load(CODE_SAMPLE, tokens=slice(0, tokens))
    assert cache.layer_ids == sample.layer_ids and cache.token_start == sample.token_start
    differing = 0
    for a, b in zip(cache.keys + cache.values, sample.keys + sample.values):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=RTOL, atol=ATOL)
        differing += int(np.count_nonzero(a.view(np.uint16) != b.view(np.uint16)))
    assert differing <= MAX_DIFFERING_SHARE * cache.nbytes / 2, f"{differing} bf16 values differ from the sample"


def test_dump_agrees_with_the_committed_sample(cli_model, tmp_path):
    """What holds on any CPU: shapes, dtype, provenance, values within the measured rounding tolerance."""
    out = tmp_path / "code64.safetensors"
    result = run("dump", str(CODE_TEXT), "-o", str(out), "--max-tokens", "64", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["tokens"] == 64 and report["bytes_per_token"] == 23040 and report["dtype"] == "bf16"
    assert abs(report["next_token_accuracy"] - ACCURACY_64) <= 2 / 63  # at most two predictions change

    cache = KVCache.load(out)
    assert cache.dtype.name == "bf16" and cache.num_layers == 30
    assert {a.shape for a in cache.keys + cache.values} == {(3, 64, 64)}
    facts = cache.model
    assert (facts.architecture, facts.num_layers, facts.num_kv_heads, facts.head_dim) == ("llama", 30, 3, 64)
    assert facts.keys_post_rope is True
    prov, sample_prov = cache.provenance, KVCache.load(CODE_SAMPLE).provenance
    assert prov["token_count"] == 64 and prov["text_name"] == CODE_TEXT.name
    assert prov["text_sha256"] == sample_prov["text_sha256"] and prov["chunk_tokens"] == sample_prov["chunk_tokens"]
    assert prov["next_token_accuracy"] == report["next_token_accuracy"]
    # A causal LM's cache of a prefix does not depend on later tokens: the dump is the sample's first 64 tokens,
    # up to the fp32 roundings of this CPU and torch build.
    assert_agrees_with_sample(cache, 64)


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


def test_convert_model_writes_a_plain_folder_with_the_same_model(cli_model, loaded, tmp_path):
    out = tmp_path / "smollm2"
    result = run("convert-model", str(out), "--dtype", "fp32")  # fp32 keeps the dequantised weights exactly
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["num_key_value_heads"] == 3
    assert not list(tmp_path.glob("*.part"))
    converted = LOAD(out)
    # Both models were dequantised and run on this CPU, so they agree bit for bit on any CPU.
    ours, theirs = loaded.model.state_dict(), converted.model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(ours[name].dtype == theirs[name].dtype and ours[name].equal(theirs[name]) for name in ours)
    text = CODE_TEXT.read_text(encoding="utf-8")
    cache = hf.prefill(converted, text, text_name="t", max_tokens=16)
    assert cache.equal_bits(hf.prefill(loaded, text, text_name="t", max_tokens=16))
    assert_agrees_with_sample(cache, 16)
