"""Reading the run's configuration into ``spider_titan.job_config.JobConfig``: parse.py (TOML + CLI),
validate.py (every problem at once), help.py (``--help``, ``--print_config``) and manager.py (parse_args,
the entry)."""
