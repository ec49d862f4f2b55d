"""The memory contract of streamed experts, measured: a MoE block's working memory is its
attention plus the experts in flight, not all E.

``benchmarks/moe.py`` measures, in a fresh subprocess, one training step of a one-layer MoE decoder
(hidden 1024, heads of 128, 16 experts top-2 of width 512: 4M attention and 24M expert parameters)
with bf16 parameters and AdamW states in CPU memory, 128 tokens: working memory = peak RSS of the
step minus the RSS after ``zf.init`` less the staging pool, after a warm-up model paid the lazy
imports. Whole, the step holds the block's 28M parameters at once (the fp32 cast of the row, the
fp32 gradient and its flat copy: ~12 bytes a parameter); streamed, the attention and router, and at
prefetch depth 1 two experts at a time, each with its gradient: (4M + 2 x 1.5M) / (4M + 24M) = 0.25
of it in parameters (``expected_ratio``). Observed: 289 MiB whole, 64 MiB streamed (0.22). The test
asserts the issue's goal, at most half, and at most 1.5x the expected share (the activations, ~1 MiB
a tensor, and a few MiB of RSS noise besides).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).parents[2] / "benchmarks" / "moe.py"
_SPEC = importlib.util.spec_from_file_location("bench_moe", _PATH)
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def test_a_moe_block_working_memory_is_bounded_by_the_experts_in_flight():
    work = bench.in_subprocess("probe", [1024, 64, 2], script=bench.__file__)
    whole, streamed = work["False"], work["True"]
    expected = bench.expected_ratio(bench.model_config(1024, 1, 64, True))
    fp32_block = 4 * 28 * 2**20  # the whole block in fp32: it is all live at once
    assert whole > fp32_block
    mib = f"streamed {streamed / 2**20:.1f} MiB vs whole {whole / 2**20:.1f} MiB"
    assert streamed <= 0.5 * whole, mib
    assert streamed <= 1.5 * expected * whole
