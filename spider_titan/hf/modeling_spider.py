"""``SpiderForCausalLM``: spider_titan's Spider behind transformers' ``PreTrainedModel`` API.

The Spider module itself is ``self.model`` (``base_model_prefix``), so the export's tensor names
(Spider's own FQNs) load as they are. ``forward`` returns the logits of every position (fp32 in
the model's dtype) and, with labels, the mean next-byte loss. ``generate`` decodes with Spider's own
cache (models/spider/decode.py) through ``past_key_values``: one byte's work per new byte.
The model block of config.json and the export's tensor names are read and checked by
export_format.py, the checks spider_titan's own reader makes (checkpoint/export.py): ``from_pretrained``
refuses an export whose tensors are not the model's (transformers alone would initialise the missing
ones at random, with only a warning) or holds NaN or inf weights, as scripts/generate.py does. A quantized export (int8 / int4,
torchao) is loaded here rather than by transformers' loader, the way spider_titan loads it
(quantization/weight_only.py ``load_quantized``; docs/hf.md says why not ``TorchAoConfig``), dequantized once
at load unless ``from_pretrained(..., keep_quantized=True)``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from spider_titan.export_format import (
    CONFIG_FILE,
    check_quantized_files,
    check_tensor_names,
    export_tensor_names,
    nonfinite_problem,
    nonfinite_tensor,
    read_model_block,
    read_tensors,
)
from spider_titan.hf.configuration_spider import SpiderConfig
from spider_titan.models.spider.args import SpiderArgs
from spider_titan.models.spider.decode import SpiderCache, decode, new_cache, unsupported
from spider_titan.models.spider.model import SPIDER_SPEC, Spider
from spider_titan.protocol import DTYPES, ModelSpec, lm_loss_mean
from spider_titan.quantization.weight_only import (
    dequantize_weights,
    load_quantized,
    read_method,
    tensor_parts,
    unflatten_quantized,
)
from spider_titan.vocab import IGNORE_INDEX, PAD_ID


def _spider_spec(name: str) -> ModelSpec:
    """The spec of the one model this code builds; ValueError for any other name."""
    if name != SPIDER_SPEC.name:
        raise ValueError(f"unknown model {name!r}; this folder's code builds {SPIDER_SPEC.name!r}")
    return SPIDER_SPEC


def spider_args(config: SpiderConfig, folder: Path | None = None) -> SpiderArgs:
    """The SpiderArgs of the config's ``model`` block, read as spider_titan reads it
    (export_format.read_model_block: fields added since filled in, retired ones dropped, every arg
    checked); errors name ``folder``'s config.json (default: the config's own folder)."""
    where = Path(folder or config.name_or_path or ".") / CONFIG_FILE
    return read_model_block(config.model, _spider_spec, where)[1]


class SpiderForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = SpiderConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"

    def __init__(self, config: SpiderConfig):
        super().__init__(config)
        self.model = Spider(spider_args(config))
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        if module is self.model:  # Spider initialises itself (models/spider/model.py init_weights)
            module.init_weights()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """transformers' loader, refusing an export that lacks a tensor of the model or holds one it
        has not (transformers would initialise the missing at random and only warn). A local folder
        is checked before any weight is read; anything else (a hub id) by transformers' own load
        report, after it. A quantized export (a local folder) is loaded by :meth:`_from_quantized`."""
        config = kwargs.get("config")
        folder = None if pretrained_model_name_or_path is None else Path(pretrained_model_name_or_path)
        if folder is not None and kwargs.get("subfolder"):
            folder = folder / kwargs["subfolder"]
        # None without either weights file: transformers then says what it looked for
        names = export_tensor_names(folder) if folder is not None and folder.is_dir() else None
        if names is not None:
            if not isinstance(config, SpiderConfig):
                config = cls.config_class.from_pretrained(folder)
            with torch.device("meta"):
                expected = set(Spider(spider_args(config, folder)).state_dict())
            check_tensor_names(folder, expected, names)
            method = read_method({"quantization": getattr(config, "quantization", None)}, folder / CONFIG_FILE)
            check_quantized_files(folder, method)
            if method is not None:
                return _finite(cls._from_quantized(folder, config, method, kwargs), folder)
        kwargs.pop("keep_quantized", None)  # an unquantized export has nothing to keep
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(
            pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
        )
        prefix = f"{cls.base_model_prefix}."
        missing = {k.removeprefix(prefix) for k in info["missing_keys"]}
        unexpected = {k.removeprefix(prefix) for k in info["unexpected_keys"]}
        expected = set(model.model.state_dict())
        check_tensor_names(pretrained_model_name_or_path, expected, (expected - missing) | unexpected)
        _finite(model, pretrained_model_name_or_path)
        return (model, info) if want_info else model

    @classmethod
    def _from_quantized(cls, folder: Path, config: SpiderConfig, method: str, kwargs: dict) -> SpiderForCausalLM:
        """The int8 / int4 export in ``folder``, loaded as spider_titan's ``load_model`` loads it: the
        model built, the same linears and experts quantized, every tensor loaded strictly, then dequantized
        once into the compute dtype unless ``keep_quantized=True`` (memory over speed). Of ``from_pretrained``'s
        ``kwargs`` it honours ``dtype`` (the compute dtype; default or "auto": the export's), a ``device_map``
        naming one device and ``keep_quantized``."""
        saved = DTYPES.get(str(config.dtype).removeprefix("torch."))
        if saved is None:
            raise ValueError(f"{folder / CONFIG_FILE}: dtype {config.dtype!r} is not one of {sorted(DTYPES)}")
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        dtype = saved if dtype in (None, "auto") else getattr(torch, dtype) if isinstance(dtype, str) else dtype
        device = kwargs.get("device_map") or "cpu"
        if isinstance(device, dict) and len(set(device.values())) == 1:  # {"": "cpu"}, as lm-eval passes it
            device = next(iter(device.values()))
        if not isinstance(device, (str, int, torch.device)):
            raise ValueError(f"{folder}: a quantized export loads onto one device; pass device_map='cpu' or 'cuda'")
        model = cls(config)
        load_quantized(model.model, read_tensors(folder, unflatten_quantized), method, dtype=saved, where=folder)
        model = model.to(device=device, dtype=dtype).eval()
        if not kwargs.get("keep_quantized", False):
            dequantize_weights(model, dtype)
        return (model, {"missing_keys": [], "unexpected_keys": []}) if kwargs.get("output_loading_info") else model

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # Spider's state is its own SpiderCache (decode.py), not per-layer keys and values

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        past_key_values: SpiderCache | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits (B, T, vocab) for ``input_ids``. With ``use_cache`` the bytes go through Spider's
        incremental decoder (decode.py) and the cache comes back as ``past_key_values``: the next call
        passes only the new columns. There, positions the mask zeroes (a left-padded batch) are left
        out of their row, as if absent (their logits are zeros). Without the cache they become PAD
        bytes, which Spider keeps out of its segments' statistics."""
        if (use_cache or past_key_values is not None) and labels is None and unsupported(self.model) is None:
            cache = past_key_values if past_key_values is not None else new_cache(self.model, input_ids.shape[0])
            return CausalLMOutputWithPast(
                logits=_decode_masked(self.model, input_ids, attention_mask, cache), past_key_values=cache
            )
        if attention_mask is not None:
            input_ids = input_ids.masked_fill(attention_mask == 0, PAD_ID)
        logits = self.model(input_ids).logits
        loss = None
        if labels is not None:
            shifted = labels[:, 1:].masked_fill(labels[:, 1:] == PAD_ID, IGNORE_INDEX)
            loss = lm_loss_mean(logits[:, :-1], shifted)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(
        self, input_ids: torch.Tensor, past_key_values=None, attention_mask=None, use_cache=None, **kwargs
    ) -> dict:
        if isinstance(past_key_values, SpiderCache):  # feed the columns the cache has not seen
            seen = past_key_values.columns
            mask = None if attention_mask is None else attention_mask[:, seen:]
            return {"input_ids": input_ids[:, seen:], "attention_mask": mask, "past_key_values": past_key_values}
        return {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": use_cache}


def _finite(loaded, where: object):
    """``loaded`` (a model, or ``(model, info)``) once every weight is finite; ValueError naming the tensor
    otherwise, as spider_titan's reader refuses it (transformers would generate NUL bytes from it)."""
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    bad = nonfinite_tensor(model.model.state_dict(), tensor_parts)
    if bad is not None:
        raise ValueError(nonfinite_problem(where, bad))
    return loaded


def _decode_masked(model: Spider, ids: torch.Tensor, mask: torch.Tensor | None, cache: SpiderCache) -> torch.Tensor:
    """``decode`` of the columns ``ids (B, t)`` whose ``mask`` is set, each row's in order; their logits
    at the same places of a (B, t, vocab) tensor (zeros where the mask is 0)."""
    cache.columns += ids.shape[1]
    if mask is None or bool(mask.all()):
        return decode(model, ids, cache)
    keep = mask.bool()
    lengths = keep.sum(dim=1).tolist()
    order = torch.argsort((~keep).to(torch.uint8), dim=1, stable=True)  # each row's kept columns first
    logits = decode(model, ids.gather(1, order), cache, lengths=lengths)
    out = torch.zeros_like(logits)
    for i, n in enumerate(lengths):
        out[i, order[i, :n]] = logits[i, :n]
    return out
