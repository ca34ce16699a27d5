"""spider_titan: a TorchTitan-style modular parallel trainer for the Spider byte-level model."""

__version__ = "0.1.0"
