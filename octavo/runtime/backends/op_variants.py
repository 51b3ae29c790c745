"""The builds of the ONNX Runtime custom op: the portable variants a wheel ships (and the compiler flags each is
built with), this CPU's feature flags, and where built libraries go.

Run-time side: octavo.runtime.backends.oplib chooses among the variants at load time; the op's build tool
(octavo.oplib_build) reads the same table to compile them. Standard library only (and `octavo` for its folder):
setup.py imports it, through octavo.oplib_build, in pip's isolated build environment, where numpy is absent.
"""
from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path


LIBRARY_NAME = "liboctavo_ort.so"


@dataclass(frozen=True, slots=True)
class Variant:
    """One portable build of the op: the compiler flags it is built with and the CPU flags it needs."""

    name: str
    compile_flags: tuple[str, ...]
    cpu_flags: frozenset[str]  # as /proc/cpuinfo spells them

    @property
    def file_name(self) -> str:
        return f"liboctavo_ort.{self.name}.so"

    def missing(self, available: frozenset[str]) -> list[str]:
        return sorted(self.cpu_flags - available)


# x86-64-v3 = AVX, AVX2, BMI1, BMI2, F16C, FMA, LZCNT ("abm"), MOVBE, XSAVE (Haswell, Zen 1 and later);
# -mtune=generic: no one vendor's scheduling model.
_V3_FLAGS = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
X86_64_V3 = Variant("x86-64-v3", ("-march=x86-64-v3", "-mtune=generic"), _V3_FLAGS)
# x86-64-v4 adds AVX-512 F/BW/CD/DQ/VL (Skylake-X, Ice Lake, Zen 4 and later): 16-float vectors in the kernel.
X86_64_V4 = Variant("x86-64-v4", ("-march=x86-64-v4", "-mtune=generic"),
                    _V3_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})
GENERIC = Variant("generic", (), frozenset())


def packaged_variants(machine: str | None = None) -> tuple[Variant, ...]:
    """The portable builds a wheel for MACHINE (default: this one) carries, widest first."""
    machine = (machine or platform.machine()).lower()
    if machine in ("x86_64", "amd64"):
        return (X86_64_V4, X86_64_V3)
    return (GENERIC,)


def cpu_flags() -> frozenset[str] | None:
    """This CPU's feature flags from /proc/cpuinfo (Linux clears those the OS does not enable); None if unreadable."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        return None
    return None


def library_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "_lib"  # octavo/_lib
