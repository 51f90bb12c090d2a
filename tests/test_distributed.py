"""DDP and FSDP2 with remat checkpointing, under torchrun with two CPU processes (gloo)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def test_ddp_and_fsdp2_gradients_equal_single_process(tmp_path):
    report = tmp_path / "report.json"
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    command = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    worker = os.path.join(os.path.dirname(__file__), "dist_worker.py")
    out = subprocess.run(
        [*command, "--standalone", "--nproc_per_node", "2", worker, str(report)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-4000:]
    worst = json.loads(report.read_text())
    assert set(worst) == {"ddp", "ddp_static_graph", "ddp_find_unused", "fsdp2"}
    for label, diff in worst.items():
        assert diff < 1e-5, (label, diff)  # all-reduce sums in another order than one process: rounding only
