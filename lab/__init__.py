"""The laboratory: studies, benches and corpus makers that measure spider_titan rather than being it.

Run from the repository root as ``python -m lab.<package>.<module> ...``. The lab imports the installed
``spider_titan`` package; nothing in ``spider_titan/`` or ``scripts/`` imports the lab
(tests/unit/test_layering.py holds both rules).
"""
