"""The code paths chosen by device, checked without a GPU (docs/gpu.md): the GPU of a torchrun
process, peak memory by the step's device."""
from __future__ import annotations

import pytest
import torch

from functional_pp.devices.launch import use_local_gpu
from functional_pp.step.io import peak_memory


def _gpus(monkeypatch, count: int) -> list:
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_each_torchrun_process_takes_its_local_gpu(monkeypatch):
    chosen = _gpus(monkeypatch, 8)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert use_local_gpu() == 3 and chosen == [3]


def test_more_processes_than_gpus_is_refused_naming_both(monkeypatch):
    chosen = _gpus(monkeypatch, 2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=2 but this process sees 2 GPU.*--nproc-per-node at most 2"):
        use_local_gpu()
    assert chosen == []


def test_no_gpu_no_device_selection(monkeypatch):
    chosen = _gpus(monkeypatch, 0)
    assert use_local_gpu() is None and chosen == []


def test_peak_memory_follows_the_step_device_not_the_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)       # a GPU machine
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 12345)
    assert peak_memory(torch.device("cuda", 0)) == 12345
    assert peak_memory(torch.device("cpu")) != 12345 and peak_memory(None) > 0   # a CPU step: RSS
