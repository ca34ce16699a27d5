"""``SpiderConfig``: the export's config.json as a transformers config (the ``model`` block holds the
model name, flavor and every argument, as spider_titan writes it)."""

from __future__ import annotations

from transformers import PretrainedConfig

from spider_titan.vocab import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE


class SpiderConfig(PretrainedConfig):
    model_type = "spider_titan"

    def __init__(self, model: dict | None = None, **kwargs):
        self.model = model or {}
        kwargs.setdefault("vocab_size", VOCAB_SIZE)
        kwargs.setdefault("bos_token_id", BOS_ID)
        kwargs.setdefault("eos_token_id", EOS_ID)
        kwargs.setdefault("pad_token_id", PAD_ID)
        # generate() decodes with Spider's own cache (decode.py), handed around as past_key_values
        kwargs.setdefault("use_cache", True)
        super().__init__(**kwargs)
