"""The engine's default compute dtype for this CPU.

vLLM's CPU backend runs bfloat16 linears through oneDNN, which needs AVX-512 (or AMX). On an
x86 CPU with only AVX2, oneDNN refuses the bf16 matmul ("Failed to create oneDNN linear,
fallback to torch linear") and torch's emulated bf16 path is ~4-5x slower than float32
(measured: a 604-token prefill of SmolLM2-135M took 8.7 s in bfloat16 and 1.9 s in float32 on
a 2-core AMD EPYC without AVX-512). So the default is bfloat16 where the CPU has AVX-512 or
AMX, and float32 elsewhere on x86. Other architectures keep bfloat16. An explicit ``dtype``
always wins. float32 doubles the KV bytes per token, so a fixed KV budget holds half the blocks.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

__all__ = ["cpu_flags", "default_dtype"]

#: Flags whose presence lets oneDNN run bfloat16 matmuls natively.
_BF16_READY = ({"avx512f", "avx512bw", "avx512vl"}, {"avx512_bf16"}, {"amx_bf16"})
_X86 = {"x86_64", "amd64", "i686", "i386"}


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU feature flags from the first ``flags`` line of ``cpuinfo`` (Linux); empty when the
    file is missing or unreadable. Reads a few KiB once per call."""
    try:
        with cpuinfo.open(encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        return frozenset()
    return frozenset()


def choose_dtype(machine: str, flags: frozenset[str]) -> str:
    """``"bfloat16"`` unless ``machine`` is x86 and ``flags`` lack AVX-512 and AMX bf16 support
    (then ``"float32"``); an x86 machine whose flags are unknown (empty) keeps bfloat16."""
    if machine.lower() not in _X86 or not flags:
        return "bfloat16"
    if any(needed <= flags for needed in _BF16_READY):
        return "bfloat16"
    return "float32"


@functools.cache
def default_dtype() -> str:
    """The dtype ``EngineSettings`` and ``craft-rag serve`` use when none is given (cached)."""
    return choose_dtype(platform.machine(), cpu_flags())
