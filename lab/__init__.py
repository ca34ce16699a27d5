"""The lab: studies, benches and corpus makers around spider_titan (not installed; run as python -m lab.<pkg>.<module>)."""
