"""``pdserve bench gpu`` on a machine without a GPU: a clear message and exit code 2, before
any work; and the table's met/missed logic."""

from __future__ import annotations

import pytest
import torch

from loadtest import bench_gpu
from services.cli import main as cli_main


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path without CUDA")
def test_without_cuda_it_says_so_and_exits_2(capsys, monkeypatch):
    ran = []
    monkeypatch.setattr(bench_gpu, "run_kernel_tests", lambda: ran.append("tests"))
    assert cli_main(["bench", "gpu"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and torch.__version__ in err
    assert ran == []


def test_preflight_names_a_missing_triton(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_gpu.importlib.util, "find_spec", lambda name: None)
    assert "triton" in bench_gpu.preflight()


def test_targets_and_table(capsys):
    checks = [bench_gpu.Check("bw", 3500.0, 0.7 * 4800, "GB/s"), bench_gpu.Check("graphs", 1.5, 2.0, "x"),
              bench_gpu.Check("info", 1.2, None, "x"), bench_gpu.Check("broken", None, 1.0, "", "FAILED: boom")]
    assert [c.met for c in checks] == [True, False, None, False]
    bench_gpu.print_table(checks)
    lines = capsys.readouterr().out.splitlines()
    assert "met" in lines[2] and "MISSED" in lines[3] and "info" in lines[4] and "FAILED: boom" in lines[5]
    assert bench_gpu.hbm_gbps("NVIDIA H200") == 4800 and bench_gpu.hbm_gbps("NVIDIA H100 PCIe") == 2000
    assert bench_gpu.hbm_gbps("Some Card") is None
