"""``Config.host_mmap_threshold``: with a state kind on NVMe, a step's large temporaries are mapped,
not heaped; and the engine's large host buffers ask for transparent huge pages
(``io.heap.advise_huge``).

glibc marks a chunk it mapped with bit 1 (IS_MMAPPED) of the size word just before the chunk's
memory. After a freed 30 MiB block, glibc's sliding threshold would put a 4 MiB tensor on the heap
(where its memory stays resident after it is freed); with the threshold fixed at 1 MiB it gets its
own mapping. Each case runs in a fresh interpreter: the setting is process-wide.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zinf_fn as zf
from zinf_fn.io.buffers import PAGE, aligned_empty
from zinf_fn.io.heap import HUGE_PAGE

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import ctypes, sys, torch
sys.path.insert(0, {root!r})
import zinf_fn as zf
from layers import gpt
config = {config}
if config is not None:
    cfg = gpt.Config(vocab_size=32, d_model=16, n_heads=2, n_layers=1, seq_len=8)
    zf.init(gpt.model(cfg), zf.adamw(), config)
big = torch.ones(30 << 18)
del big   # a freed 30 MiB mapping: glibc's sliding threshold rises to 30 MiB
t = torch.ones(1 << 20)   # 4 MiB
print(bool(ctypes.c_size_t.from_address(t.untyped_storage().data_ptr() - 8).value & 2))
"""

glibc = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the setting is glibc's mallopt"
)


def mapped_after(*configs: str) -> list[bool]:
    """For each of ``configs``, whether a 4 MiB tensor is mmapped in a fresh interpreter after
    ``zf.init`` with it (``PROBE``): the interpreters run side by side, each its own heap."""
    probes = [
        subprocess.Popen(
            [sys.executable, "-c", PROBE.format(root=str(ROOT), config=config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for config in configs
    ]
    out = []
    for probe in probes:
        stdout, stderr = probe.communicate(timeout=300)
        assert probe.returncode == 0, stderr[-3000:]
        out.append(stdout.strip().splitlines()[-1] == "True")
    return out


@glibc
def test_a_run_with_states_on_nvme_maps_large_temporaries(tmp_path):
    assert mapped_after(
        f"zf.Config(offload_params='nvme', offload_optimizer='nvme', nvme_path={str(tmp_path)!r})"
    ) == [True]


@glibc
def test_in_memory_runs_and_zero_leave_malloc_alone(tmp_path):
    assert mapped_after(
        "None",  # the probe itself: glibc slides its threshold
        "zf.Config()",
        f"zf.Config(offload_optimizer='nvme', nvme_path={str(tmp_path)!r}, host_mmap_threshold=0)",
    ) == [False, False, False]


def test_the_threshold_resolves_by_placement_and_is_checked():
    assert zf.Config().resolved_mmap_threshold() == 0
    assert zf.Config(offload_optimizer="nvme", nvme_path="/x").resolved_mmap_threshold() == 1 << 20
    assert (
        zf.Config(
            offload_optimizer="cpu", spill_optimizer="2:nvme", nvme_path="/x"
        ).resolved_mmap_threshold()
        == 1 << 20
    )
    assert zf.Config(host_mmap_threshold=4 << 20).resolved_mmap_threshold() == 4 << 20
    for bad in (-1, 1 << 31, 1.5, True, "1M"):
        with pytest.raises(
            ValueError, match=r"host_mmap_threshold must be None \(auto\), 0 .* got"
        ):
            zf.Config(host_mmap_threshold=bad)


def _vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    sys.platform != "linux", reason="madvise(MADV_HUGEPAGE) and /proc/self/smaps are Linux's"
)
def test_large_host_buffers_start_on_a_huge_page_advised_as_such_and_small_ones_on_a_page():
    big = aligned_empty(3 << 20, torch.float32)  # 12 MiB: six huge pages
    assert big.data_ptr() % HUGE_PAGE == 0
    assert "hg" in _vm_flags(big.data_ptr())  # VM_HUGEPAGE: the kernel took the advice
    big.fill_(1.0)
    assert float(big.sum()) == 3 << 20
    small = aligned_empty(1000, torch.bfloat16)
    assert small.data_ptr() % PAGE == 0
