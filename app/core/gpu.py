"""What the host's NVIDIA GPUs are doing, as `nvidia-smi` reports it (the console's engine page)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

QUERY = "index,name,utilization.gpu,memory.used,memory.total"


@dataclass(frozen=True)
class GpuUsage:
    index: int
    name: str
    utilization_percent: int
    memory_used_mib: int
    memory_total_mib: int


def gpu_usage(timeout: float = 2.0) -> list[GpuUsage]:
    """Each GPU's utilisation and memory; empty on a host without `nvidia-smi` or where it does not answer."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return []
    try:
        done = subprocess.run(
            [binary, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return [usage for line in done.stdout.splitlines() if (usage := _parse(line)) is not None]


def _parse(line: str) -> GpuUsage | None:
    fields = [field.strip() for field in line.split(",")]
    if len(fields) != 5:
        return None
    try:
        return GpuUsage(int(fields[0]), fields[1], int(fields[2]), int(fields[3]), int(fields[4]))
    except ValueError:  # "[N/A]" on some boards
        return None
