"""One line that names the machine a figure was measured on: its GPU and CUDA, or its CPU and cores, and torch."""

from __future__ import annotations

import os
import platform

import torch


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}), torch {torch.__version__}"
    return f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
