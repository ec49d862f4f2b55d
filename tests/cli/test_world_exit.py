"""A run under torchrun leaves nothing running at the interpreter's exit: no process group (a gloo
group's C++ worker threads alive while Python is torn down abort a rank now and then, ``terminate
called without an active exception``) and no engine thread. Two ranks are started as torchrun starts
them (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT), each runs ``zinf-fn train`` and reports
what is left when the command returns."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from cli_helpers import ROOT, TINY_GPT
from dist_utils import free_port

REPORT = """
import json, sys, threading
import torch.distributed as dist
from zinf_cli.main import main
status = main(sys.argv[1:])
print(json.dumps({"status": status, "process_group": dist.is_initialized(),
                  "threads": sorted(t.name for t in threading.enumerate())}))
"""


def test_two_ranks_leave_no_process_group_and_no_thread(tmp_path):
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "PYTHONPATH": ROOT,
            "OMP_NUM_THREADS": "1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        args = ["train", *TINY_GPT, "steps=3", f"run_dir={tmp_path}", "placement=cpu"]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", REPORT, *args],
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        report = json.loads(out.strip().splitlines()[-1])
        assert report == {"status": 0, "process_group": False, "threads": ["MainThread"]}, report
