"""What the gates read about the machine from nvidia-smi, and the folders a process keeps for its lifetime."""

import subprocess
from types import SimpleNamespace

import torch

from gates.core import machine

SMI_ROWS = "00000000:19:00.0, 1980\n00000000:3B:00.0, 1410\n"  # two GPUs, as --format=csv,noheader,nounits gives


def _fake_smi(monkeypatch, stdout: str) -> list:
    asked = []
    monkeypatch.setattr(machine.shutil, "which", lambda name: "/usr/bin/nvidia-smi")

    def run(argv, **_):
        asked.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout=stdout)

    monkeypatch.setattr(machine.subprocess, "run", run)
    return asked


def test_the_maximum_sm_clock_is_the_current_devices_matched_by_its_pci_address(monkeypatch):
    asked = _fake_smi(monkeypatch, SMI_ROWS)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    device = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: device)
    assert machine.max_sm_clock_mhz() == 1410.0
    assert asked[0][1] == "--query-gpu=pci.bus_id,clocks.max.sm"
    device.pci_bus_id = 0x40  # no GPU nvidia-smi lists: unknown, not another GPU's
    assert machine.max_sm_clock_mhz() is None


def test_the_driver_version_is_the_first_gpus(monkeypatch):
    _fake_smi(monkeypatch, "580.65.06\n580.65.06\n")
    assert machine._driver() == "580.65.06"
    monkeypatch.setattr(machine.shutil, "which", lambda name: None)
    assert machine._driver() is None


def test_a_process_keeps_one_folder_per_name_and_place(tmp_path):
    first = machine.folder_of_this_process("k3forge-test-", str(tmp_path))
    assert first.is_dir() and first.parent == tmp_path and first.name.startswith("k3forge-test-")
    assert machine.folder_of_this_process("k3forge-test-", str(tmp_path)) == first
    assert machine.folder_of_this_process("k3forge-other-", str(tmp_path)) != first
