"""What memory a node offers models (``exo.system.memory``): the machine's, or on an MLX CUDA node its GPU's.

``nvidia-smi`` is the outer edge here: a script on PATH answers as the real one does (MiB, CSV without header)."""

from __future__ import annotations

import os
import stat

import pytest

from exo import system


@pytest.fixture
def smi(tmp_path, monkeypatch):
    """A fake ``nvidia-smi`` answering for two GPUs; records its arguments."""
    log = tmp_path / "argv"
    script = tmp_path / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {log}\n'
        'case "$*" in *"-i 1"*) echo "81559, 80000" ;; *) printf "24564, 20470\\n81559, 80000\\n" ;; esac\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return log


def test_an_mlx_cuda_node_offers_its_gpu_s_memory_not_the_host_s(smi, monkeypatch):
    monkeypatch.setattr(system, "backend", lambda: "cuda")
    monkeypatch.setattr(system, "_gpu_memory_read", {})
    mem = system.memory()
    assert (mem.total_bytes, mem.available_bytes) == (24564 << 20, 20470 << 20)  # the first GPU: MLX's device
    assert system.memory(budget=8 << 30).total_bytes == 8 << 30  # a budget still caps it
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert system.memory().total_bytes == 81559 << 20
    assert "-i 1" in smi.read_text()
    asked = smi.read_text().count("\n")
    system.memory()
    assert smi.read_text().count("\n") == asked  # read again within the second: nvidia-smi not asked


def test_other_nodes_and_an_unreadable_gpu_offer_the_machine_s_memory(smi, monkeypatch, tmp_path):
    host = system.Memory(64 << 30, 40 << 30)
    monkeypatch.setattr(system, "_os_memory", lambda: host)
    monkeypatch.setattr(system, "backend", lambda: "cpu")
    assert system.memory() == host and not smi.exists()  # nvidia-smi is not asked off CUDA
    monkeypatch.setattr(system, "backend", lambda: "cuda")
    monkeypatch.setattr(system, "_gpu_memory_read", {})
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert system.memory() == host
