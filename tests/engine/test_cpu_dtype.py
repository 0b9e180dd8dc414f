"""The engine's default dtype follows the CPU: bfloat16 where oneDNN runs it (AVX-512/AMX),
float32 on x86 without (bf16 matmuls fall back to a ~4-5x slower path there)."""

from __future__ import annotations

from pathlib import Path

import pytest

from craft_rag.engine import EngineSettings
from craft_rag.engine.backends.server.serve import ServeConfig, server_command
from craft_rag.engine.cpu_dtype import choose_dtype, cpu_flags, default_dtype

AVX2 = frozenset({"fpu", "sse2", "avx", "avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


@pytest.mark.parametrize(
    ("machine", "flags", "expected"),
    [
        ("x86_64", AVX2, "float32"),
        ("x86_64", AVX512, "bfloat16"),
        ("x86_64", AVX2 | {"avx512f"}, "float32"),  # AVX-512 foundation alone is not enough
        ("x86_64", AVX2 | {"amx_bf16"}, "bfloat16"),
        ("AMD64", AVX2 | {"avx512_bf16"}, "bfloat16"),
        ("x86_64", frozenset(), "bfloat16"),  # unknown flags: vLLM's own default
        ("aarch64", frozenset({"asimd", "fp"}), "bfloat16"),
    ],
)
def test_choose_dtype(machine: str, flags: frozenset[str], expected: str) -> None:
    assert choose_dtype(machine, flags) == expected


def test_cpu_flags_reads_the_first_flags_line(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx avx2 fma\n"
        "processor\t: 1\nflags\t\t: fpu avx512f\n",
        encoding="ascii",
    )
    assert cpu_flags(info) == {"fpu", "avx", "avx2", "fma"}
    assert cpu_flags(tmp_path / "missing") == frozenset()
    info.write_text("processor\t: 0\n", encoding="ascii")
    assert cpu_flags(info) == frozenset()


def test_settings_default_to_this_cpus_dtype_and_keep_an_explicit_one() -> None:
    assert default_dtype() in ("bfloat16", "float32")
    assert EngineSettings().dtype == default_dtype()
    assert EngineSettings(dtype="bfloat16").dtype == "bfloat16"
    argv = server_command(ServeConfig(model="/m"), python="py")
    assert argv[argv.index("--dtype") + 1] == default_dtype()
    forced = server_command(ServeConfig(model="/m", dtype="bfloat16"), python="py")
    assert forced[forced.index("--dtype") + 1] == "bfloat16"


@pytest.mark.parametrize("dtype", ["", "fp8", "--enable-lora", "float32 "])
def test_serve_config_refuses_an_unknown_dtype(dtype: str) -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        ServeConfig(model="/m", dtype=dtype)
