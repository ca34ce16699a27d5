"""The run's configuration: job_config.py (one typed dataclass per TOML table), parse.py, validate.py,
help.py, and manager.py (parse_args, the entry)."""
