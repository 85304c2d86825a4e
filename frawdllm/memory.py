"""How much memory a new allocation may take: what refuses work that would not fit (a KV
cache, a beam search) before any of it is allocated, instead of the kernel's OOM killer
ending the process without a word."""

from __future__ import annotations

from pathlib import Path

import torch


def free_memory(device: torch.device) -> int | None:
    """Bytes a new allocation may take on `device`: a GPU's free memory plus what PyTorch
    holds unused; on the CPU the memory the system has available (and this process's cgroup
    allows); None when unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        available = int(meminfo["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    try:  # a container's limit (cgroup v2), below the machine's
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available


__all__ = ["free_memory"]
