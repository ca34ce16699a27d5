"""The train loop's helpers, so that ``spider_titan/train.py`` reads as the loop itself: step health
(health.py), stop signals (signals.py), the validation pass (validation.py) and throughput
accounting: FLOPs, tokens/s, MFU, ETA (progress.py)."""
