"""Named hardware for ``kvtool plan --hardware NAME``: tiers, codecs, build rate, and the prefill
of the models each was measured or estimated for. docs/PLAN.md gives every number's source.

A preset's prefill belongs to a model on that machine: for any other model the caller gives
the prefill (``--prefill-tps``/``--prefill-fit``), so one model's speed never stands in for
another's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtool.costmodel import CodecCost, Prefill, Tier

GB = 1e9


@dataclass(frozen=True)
class Preset:
    name: str
    machine: str  # one line: what the numbers describe, and whether they were measured
    tiers: tuple[Tier, ...]
    codecs: tuple[CodecCost, ...]
    build_rate: float  # raw bytes per second into the engine's cache
    chunk_tokens: int
    prefill: dict[str, Prefill] = field(default_factory=dict)  # model name -> its prefill on this machine

    def prefill_for(self, model: str) -> Prefill | None:
        """The prefill of ``model`` on this machine, if the preset has one: the model's name starts
        with it, ignoring case and an organisation (``HuggingFaceTB/SmolLM2-135M-Instruct`` is SmolLM2-135M)."""
        plain = model.lower().rsplit("/", 1)[-1]
        return next((fit for name, fit in self.prefill.items() if plain.startswith(name.lower())), None)


PRESETS = {
    preset.name: preset
    for preset in (
        Preset(
            "dev-vm",
            "measured by `kvtool bench ttft` (HF engine on CPU, SmolLM2-135M, bf16 KV) on a shared 2-core AMD EPYC VM "
            "(BENCHMARKS.md, Restore beats recompute)",
            # From benchmarks/results/ttft_hf_2048.json (`kvtool plan --calibrate` on it, fastest of 3 repeats),
            # except "default": that run's old default decoded at 0.137 GB/s; exphuff, the default since, costs
            # 2.7-3.0x less CPU per GB in kvtool.load (benchmarks/load_bench.py), so 0.137 x 2.85 GB/s.
            tiers=(Tier("memory", 9.6e9), Tier("file", 4.7e9), Tier("redis", 1.04e9)),
            codecs=(CodecCost("none", 0.998, 0.38e9), CodecCost("default", 1.505, 0.39e9),
                    CodecCost("qat", 1.391, 0.169e9)),
            build_rate=1.56e9,
            chunk_tokens=128,
            prefill={"SmolLM2-135M": Prefill(0.110, 2.66e-3, 1.18e-7)},
        ),
        Preset(
            "h800",
            "estimated, not measured: one H800/L20-class GPU, PCIe 5.0 x16, DDR5, NVMe Gen4, Redis over 25 GbE "
            "(docs/PLAN.md, Predictions for Qwen3-8B and Qwen3-32B)",
            tiers=(Tier("dram", 25 * GB, 0.005e-3), Tier("nvme-gen4", 6.5 * GB, 0.1e-3),
                   Tier("redis-25GbE", 2.5 * GB, 0.2e-3)),
            codecs=(CodecCost("none", 1.0, 3.0 * GB), CodecCost("default", 1.505, 3.1 * GB),
                    CodecCost("qat", 1.391, 1.35 * GB)),
            build_rate=50 * GB,
            chunk_tokens=256,
            prefill={"Qwen3-8B": Prefill(0.02, 6.67e-5, 1.23e-9), "Qwen3-32B": Prefill(0.03, 2.67e-4, 4.4e-9)},
        ),
    )
}
