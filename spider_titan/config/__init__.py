from spider_titan.config.job_config import JobConfig
from spider_titan.config.manager import ConfigError, parse_args

__all__ = ["ConfigError", "JobConfig", "parse_args"]
