"""The NVMe tier on its own: bitwise round trips on both engines, each reading the other's files,
rows an earlier run left, and buffers freed as their writes complete.

Every comparison here is bitwise: moving a state to disk and back must not change a bit.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorstore as ts
import torch
from engine_helpers import run_engine
from nvme_helpers import all_states, bits

import zinf_fn as zf
from zinf_fn.io.buffers import aligned_empty
from zinf_fn.offload import nvme
from zinf_fn.offload.nvme import NvmeTier
from zinf_fn.state import view

# -- the tier on its own
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", nvme.ENGINES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_bitwise(tmp_path, engine, dtype):
    tier = NvmeTier(tmp_path, "rank0/params", engine=engine)
    numel = 3 * 4096 + 37  # an aligned body and a sub-page tail
    tier.allocate("blocks/param", 3, numel, dtype)
    rows = [torch.randn(numel).to(dtype) for _ in range(3)]
    rows[1][:5] = torch.tensor([float("nan"), -0.0, float("inf"), 1e-40, -1.0]).to(dtype)
    for r, src in enumerate(rows):  # aligned (pool-style) and unaligned source buffers
        buf = aligned_empty(numel, dtype).copy_(src) if r % 2 == 0 else src.clone()
        tier.write_("blocks/param", r, buf).result()
    for r, src in enumerate(rows):
        out = aligned_empty(numel, dtype) if r % 2 else torch.empty(numel, dtype=dtype)
        tier.read_("blocks/param", r, out).result()
        assert torch.equal(bits(out), bits(src))
    assert tier.bytes_written == tier.bytes_read == 3 * numel * dtype.itemsize
    # The files are plain zarr3 that tensorstore reads (bf16 stored as zarr bfloat16).
    path = str(tmp_path / "rank0/params/blocks/param")
    arr = ts.open(
        {"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}, open=True
    ).result()
    assert arr.dtype.name == ("bfloat16" if dtype == torch.bfloat16 else "float32")
    on_disk = np.asarray(arr[1].read().result()).view(np.uint8)
    assert np.array_equal(on_disk, bits(rows[1]).numpy())
    tier.close()


@pytest.mark.parametrize("writer, reader", [("direct", "tensorstore"), ("tensorstore", "direct")])
def test_both_engines_move_the_same_files(tmp_path, writer, reader):
    """The two engines are two ways to the same zarr3 arrays: rows one writes, the other reads back
    bitwise, and overwrites in place."""
    numel = 2 * 4096 + 37
    first = NvmeTier(tmp_path, "rank0/optimizer", engine=writer)
    first.allocate("blocks/master", 3, numel, torch.float32)
    rows = [torch.randn(numel) for _ in range(3)]
    for r, src in enumerate(rows):
        first.write_("blocks/master", r, aligned_empty(numel, torch.float32).copy_(src)).result()
    first.close()
    second = NvmeTier(
        tmp_path, "rank0/optimizer", engine=reader
    )  # the same stable names: the same files
    second.allocate("blocks/master", 3, numel, torch.float32)
    out = aligned_empty(numel, torch.float32)
    for r, src in enumerate(rows):
        second.read_("blocks/master", r, out).result()
        assert torch.equal(bits(out), bits(src))
    newer = torch.randn(numel)
    second.write_("blocks/master", 1, aligned_empty(numel, torch.float32).copy_(newer)).result()
    second.close()
    third = NvmeTier(tmp_path, "rank0/optimizer", engine=writer)
    third.allocate("blocks/master", 3, numel, torch.float32)
    third.read_("blocks/master", 1, out).result()
    assert torch.equal(bits(out), bits(newer))
    third.close()


def test_config_nvme_engine_selects_the_engine_and_trains_the_same(tmp_path):
    """zf.Config(nvme_engine=...) picks the NVMe tier's engine; both give the same training,
    bitwise."""
    with pytest.raises(ValueError, match="nvme_engine"):
        zf.Config(nvme_engine="mmap")
    runs = {}
    for engine in nvme.ENGINES:
        config = zf.Config(
            offload_params="nvme",
            offload_optimizer="nvme",
            nvme_path=str(tmp_path / engine),
            param_dtype=torch.float32,
            nvme_engine=engine,
        )
        (tmp_path / engine).mkdir()
        assert config.describe()["nvme_engine"] == engine
        losses, final, _, state = run_engine(config, steps=4)
        assert view(state).nvme_engine("param") == engine
        runs[engine] = (losses, all_states(state))
        zf.close(state)
    (direct_losses, direct_states), (ts_losses, ts_states) = runs["direct"], runs["tensorstore"]
    assert direct_losses == ts_losses
    assert sorted(direct_states) == sorted(ts_states)
    for name, rows in direct_states.items():
        assert torch.equal(bits(rows), bits(ts_states[name])), name


def test_unwritten_rows_read_as_zero_and_a_rerun_finds_its_rows(tmp_path):
    tier = NvmeTier(tmp_path, "rank0/optimizer")
    tier.allocate("blocks/master", 2, 1000, torch.float32)
    out = torch.full((1000,), 7.0)
    tier.read_("blocks/master", 1, out).result()
    assert torch.equal(out, torch.zeros(1000))
    src = torch.randn(1000)
    tier.write_("blocks/master", 0, src).result()
    tier.close()
    again = NvmeTier(tmp_path, "rank0/optimizer")  # same stable names: the same files
    again.allocate("blocks/master", 2, 1000, torch.float32)
    again.read_("blocks/master", 0, out).result()
    assert torch.equal(out, src)
    again.close()


@pytest.mark.parametrize("engine", nvme.ENGINES)
@pytest.mark.parametrize("size", [0, 100, 3996, 4004, 8192])
def test_a_rerun_refuses_a_row_file_of_the_wrong_size(tmp_path, engine, size):
    """A row file an earlier run left with another length is an error naming the layer and state
    kind, never a short or overlong read; the row reads again once rewritten."""
    tier = NvmeTier(tmp_path, "rank0/optimizer", engine=engine)
    tier.allocate("blocks/master", 3, 1000, torch.float32)
    src = torch.randn(1000)
    tier.write_("blocks/master", 2, src).result()
    tier.close()
    os.truncate(tmp_path / "rank0/optimizer/blocks/master/c/2/0", size)
    again = NvmeTier(tmp_path, "rank0/optimizer", engine=engine)
    again.allocate("blocks/master", 3, 1000, torch.float32)
    out = torch.empty(1000)
    with pytest.raises(OSError, match=r"layer blocks.2 state 'master'"):
        again.read_("blocks/master", 2, out).result()
    again.write_("blocks/master", 2, src).result()
    again.read_("blocks/master", 2, out).result()
    assert torch.equal(bits(out), bits(src))
    again.close()


@pytest.mark.parametrize("engine", nvme.ENGINES)
def test_a_written_buffer_is_freed_once_its_write_completes(tmp_path, engine):
    """No reference cycle keeps a write's source alive until the garbage collector happens to run:
    zf.init writes a layer at a time, and a cycle per write held several layers' worth of freed
    rows."""
    import gc
    import weakref

    tier = NvmeTier(tmp_path, "rank0/optimizer", engine=engine)
    tier.allocate("blocks/master", 1, 1 << 16, torch.float32)
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(
            2
        ):  # the first write creates the row file, the second overwrites it in place
            src = torch.randn(1 << 16)
            alive = weakref.ref(src)
            tier.write_("blocks/master", 0, src).result()
            del src
            assert alive() is None
    finally:
        if enabled:
            gc.enable()
    tier.close()
