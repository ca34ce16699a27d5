"""``SpiderForCausalLM``: spider_titan's Spider behind transformers' ``PreTrainedModel`` API.

The Spider module itself is ``self.model`` (``base_model_prefix``), so the export's tensor names
(Spider's own FQNs) load as they are. ``forward`` returns the logits of every position (fp32 in
the model's dtype) and, with labels, the mean next-byte loss. Generation recomputes the whole
context each step (no key/value cache yet), so ``generate`` is correct but slow on long outputs.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from spider_titan.hf.configuration_spider import SpiderConfig
from spider_titan.models.spider.args import SpiderArgs
from spider_titan.models.spider.model import Spider
from spider_titan.protocol import lm_loss_mean
from spider_titan.vocab import IGNORE_INDEX, PAD_ID


def spider_args(config: SpiderConfig) -> SpiderArgs:
    """The SpiderArgs of the config's ``model`` block (unknown keys are an error, as in spider_titan)."""
    names = {f.name for f in dataclasses.fields(SpiderArgs)}
    args = dict(config.model.get("args", {}))
    unknown = sorted(set(args) - names)
    if unknown:
        raise ValueError(f"config.json: model.args has keys this code does not know: {unknown}")
    return SpiderArgs(**args)


class SpiderForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = SpiderConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _supports_cache_class = False

    def __init__(self, config: SpiderConfig):
        super().__init__(config)
        self.model = Spider(spider_args(config))
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        if module is self.model:  # Spider initialises itself (models/spider/model.py init_weights)
            module.init_weights()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutput:
        """Logits (B, T, vocab) for ``input_ids``; positions the mask zeroes become PAD bytes, which
        Spider keeps out of its segments' statistics (a left-padded batch is read as such)."""
        if attention_mask is not None:
            input_ids = input_ids.masked_fill(attention_mask == 0, PAD_ID)
        logits = self.model(input_ids).logits
        loss = None
        if labels is not None:
            shifted = labels[:, 1:].masked_fill(labels[:, 1:] == PAD_ID, IGNORE_INDEX)
            loss = lm_loss_mean(logits[:, :-1], shifted)
        return CausalLMOutput(loss=loss, logits=logits)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # Spider's state is not per-layer keys and values; generate() passes no cache

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, attention_mask=None, **kwargs) -> dict:
        return {"input_ids": input_ids, "attention_mask": attention_mask}
