"""The CPU's instruction sets (``memlayout.machine.cpu_isa``) against torch's own report, and
what the code that depends on them makes of each CPU a test can state."""

from __future__ import annotations

import os
import string

import pytest
import torch

from memlayout import machine
from memlayout.bench.modes import matmul_isa
from memlayout.machine import CpuIsa
from memlayout.plan.candidates.padding import block_sizes, variants
from tests.support.machine import AVX2, AVX512, as_cpu

AMX = CpuIsa("AVX512", frozenset({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}))


@pytest.mark.isa
def test_the_capability_is_what_aten_dispatches_to() -> None:
    isa = machine.cpu_isa()
    assert isa.capability == torch.backends.cpu.get_cpu_capability()
    forced = os.environ.get("ATEN_CPU_CAPABILITY")
    if forced:  # `make test`'s AVX2 re-run: the tests there really see AVX2
        assert isa.capability == forced.upper()


@pytest.mark.parametrize(("isa", "blocks"), [(AMX, (16, 8)), (AVX512, (16, 8)), (AVX2, (8,)),
                                             (CpuIsa("DEFAULT"), (4,))])
def test_padding_tries_the_vector_width_of_the_cpu_it_is_given(isa, blocks, monkeypatch) -> None:
    assert block_sizes("cpu", None, isa) == blocks
    as_cpu(monkeypatch, isa)  # the planner's default: the machine's
    assert block_sizes("cpu", None) == blocks
    assert block_sizes("cuda", None, isa) == (4, 8)  # a GPU's blocks are not the CPU's
    conv = torch.nn.Conv2d(3, 24, 3)
    assert {int(name.lstrip(string.ascii_lowercase)) for name in variants(conv, blocks)} == \
        set(blocks)


@pytest.mark.parametrize(("isa", "bf16", "fp32"), [
    (AMX, "AMX-BF16, AVX512-BF16", "AMX tiles, AVX-512, AVX2"),
    (AVX512, "none (bf16 emulated)", "AVX-512, AVX2"),
    (AVX2, "none (bf16 emulated)", "AVX2"),
])
def test_the_bench_names_the_matrix_instructions_of_the_cpu_it_is_given(isa, bf16, fp32) -> None:
    assert matmul_isa("bf16", "cpu", isa) == f"CPU bf16 instructions: {bf16}"
    assert matmul_isa("fp32", "cpu", isa) == f"CPU vector instructions: {fp32}"
