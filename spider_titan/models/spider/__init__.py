"""Spider: byte-level recurrent-depth MoE transformer (docs/model.md). Registered as model ``spider``."""

from spider_titan.models.spider.args import SPIDER_FLAVORS, SpiderArgs
from spider_titan.models.spider.flops import spider_flops_breakdown, spider_flops_per_byte
from spider_titan.models.spider.model import SPIDER_SPEC, Spider, SpiderOutput, parameter_breakdown

__all__ = [
    "SPIDER_FLAVORS",
    "SPIDER_SPEC",
    "Spider",
    "SpiderArgs",
    "SpiderOutput",
    "parameter_breakdown",
    "spider_flops_breakdown",
    "spider_flops_per_byte",
]
