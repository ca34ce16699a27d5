"""Checkpoints (DCP save / resume, manager.py) and safetensors exports (export.py)."""

from spider_titan.checkpoint.export import export_checkpoint, load_export_tensors, read_export_config, write_export
from spider_titan.checkpoint.manager import Checkpointer, ModelIdentity, build_checkpointer, list_checkpoints

__all__ = [
    "Checkpointer",
    "ModelIdentity",
    "build_checkpointer",
    "export_checkpoint",
    "list_checkpoints",
    "load_export_tensors",
    "read_export_config",
    "write_export",
]
