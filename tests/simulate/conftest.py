"""Shared fixtures for the simulator tests: round-number hardware, tiny models, hand-made tokens."""
from __future__ import annotations

import pytest

from scheduler import Step, Token
from simulate import ExecConfig, Hardware, ModelSpec


def round_hardware(**overrides) -> Hardware:
    """Numbers chosen so that times come out in whole microseconds."""
    fields = dict(name="round", gpu_name="g", gpu_mem_bytes=2**30, gpu_mem_gbps=100.0, gpu_tflops=100.0,
                  launch_s=1e-6, pcie_h2d_gbps=10.0, pageable_gbps=5.0, copy_latency_s=10e-6, cpu_name="c",
                  cpu_threads=4, cpu_mem_gbps=100.0, cpu_thread_gbps=5.0, cpu_task_s=20e-6)
    fields.update(overrides)
    return Hardware(**fields)


def tiny_model(**overrides) -> ModelSpec:
    """One-layer model with 4 F16 experts of 3*1000*500*2 = 3,000,000 bytes each."""
    fields = dict(name="tiny", num_layers=1, num_experts=4, top_k=2, hidden=1000, expert_ffn=500, num_heads=4,
                  num_kv_heads=2, head_dim=8, vocab=1000, expert_quant="F16", dense_quant="F16")
    fields.update(overrides)
    return ModelSpec(**fields)


def decode_tokens(routes: list[list[tuple[int, ...]]]) -> list[Token]:
    """routes[token][layer] = experts of that step, one sequence, positions 0.."""
    return [Token(i, 0, i, "decode", tuple(Step(l, tuple(ex)) for l, ex in enumerate(row)))
            for i, row in enumerate(routes)]


@pytest.fixture
def hw() -> Hardware:
    return round_hardware()


@pytest.fixture
def model() -> ModelSpec:
    return tiny_model()


@pytest.fixture
def exec_cfg() -> ExecConfig:
    return ExecConfig(dense_kernels=2, expert_kernels=3)
