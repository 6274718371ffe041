"""The one place that knows about hardware: device resolution and memory queries."""

from __future__ import annotations

import os

import torch


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when a GPU is visible, else the CPU; 'cuda' without a GPU is a clear error."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(
                "device='cuda' was asked for but no CUDA GPU is visible; use device='cpu' or 'auto'"
            )
        device = torch.device(name)
        # an explicit index: torch.cuda.set_device and memory queries need one
        return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def available_memory_bytes(device: torch.device) -> tuple[int, int]:
    """(total, free) bytes of the memory that holds the KV pool on `device`."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, free
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
        return info["MemTotal"], info["MemAvailable"]
    except (OSError, KeyError):  # not Linux: assume half the RAM is free
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total // 2
