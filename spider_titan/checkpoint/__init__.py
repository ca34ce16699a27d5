"""Checkpoints (DCP save / resume, manager.py), safetensors exports (export.py) and the folder
layout both read (layout.py); the import order is layout <- export <- manager."""

from spider_titan.checkpoint.export import export_checkpoint, load_export_tensors, read_export_config, write_export
from spider_titan.checkpoint.layout import ModelIdentity, list_checkpoints
from spider_titan.checkpoint.manager import Checkpointer, build_checkpointer

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
