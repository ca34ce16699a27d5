"""Optimizer builders: ``build_*(model, cfg: OptimizerConfig) -> torch.optim.Optimizer`` (the [optimizer] section).

Weight decay goes to matrices only: norms, biases, the LTI decay and other vectors are not decayed,
and neither are embedding tables (decaying rarely used byte rows only shrinks them).

Per-module learning rates (``optimizer.lr_multipliers``, entries ``PREFIX=FACTOR``): a parameter
whose FQN is PREFIX or starts with ``PREFIX.`` trains at ``FACTOR x lr`` (the longest matching
prefix wins; ``*`` matches every parameter no other entry does). This is H-Net's per-stage
learning rate (goombalab/hnet ``utils/train.py``: outer, byte-level stages higher), e.g. for
Spider ``["*=2", "core=1"]``. A module may carry its own ``lr_multiplier`` (the byte n-gram tables': a
model argument), which multiplies the factor of every parameter it holds. Each (decayed?, factor) pair
is one parameter group with its own ``lr``; the LR scheduler scales every group's initial lr, and the
groups come out in the same order for the same model and config, so a checkpoint resumes into the same
groups.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from spider_titan.job_config import Optimizer as OptimizerConfig

logger = logging.getLogger("spider_titan")

# Parameters whose FQN contains one of these are not decayed: embedding tables (decaying rarely
# used rows only shrinks them) and per-loop LoRA adapters (the adapters of loops a run never
# reaches get no gradient, and decay alone would erode them).
_NO_DECAY_NAMES = ("embed_tokens", "byte_ngrams", "loop_embedding", "engram", "lora")


# Wrapper modules that insert themselves into FQNs (activation checkpointing, torch.compile).
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def parse_lr_multipliers(entries: list[str]) -> tuple[dict[str, float], list[str]]:
    """``["PREFIX=FACTOR", ...]`` -> ({prefix: factor}, problems, one line each naming the entry)."""
    rules, problems = {}, []
    for entry in entries:
        prefix, sep, value = entry.partition("=")
        prefix = prefix.strip()
        try:
            factor = float(value)
        except ValueError:
            factor = float("nan")
        if not sep or not prefix or not factor > 0 or factor == float("inf"):
            problems.append(
                f"optimizer.lr_multipliers: {entry!r} is not PREFIX=FACTOR with a module FQN prefix (or *) and a "
                'factor > 0, e.g. "core=1.0" or "*=2.0"'
            )
        elif prefix in rules:
            problems.append(f"optimizer.lr_multipliers: {prefix!r} is given twice; keep one entry")
        else:
            rules[prefix] = factor
    return rules, problems


def _matches(name: str, prefix: str) -> bool:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name == prefix or name.startswith(prefix + ".")


def lr_factor(name: str, rules: dict[str, float]) -> float:
    """The multiplier of parameter ``name``: its longest matching prefix in ``rules``, else ``*``, else 1."""
    best = max((p for p in rules if p != "*" and _matches(name, p)), key=len, default=None)
    return rules[best] if best is not None else rules.get("*", 1.0)


def _named_trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def param_groups(model: nn.Module, weight_decay: float, lr: float, lr_multipliers: list[str] = ()) -> list[dict]:
    """Decayed matrices and everything else, each split by learning-rate factor (module docstring)."""
    return _groups(_named_trainable(model), weight_decay, lr, _rules(model, lr_multipliers), module_lr_factors(model))


def module_lr_factors(model: nn.Module) -> dict[str, float]:
    """Parameter FQN -> the product of the ``lr_multiplier`` of the modules holding it, where one is not 1."""
    factors: dict[str, float] = {}
    for prefix, module in model.named_modules():
        factor = getattr(module, "lr_multiplier", 1.0)
        if factor != 1.0:
            for name, _ in module.named_parameters(prefix=prefix):
                factors[name] = factors.get(name, 1.0) * factor
    return factors


def _rules(model: nn.Module, entries: list[str]) -> dict[str, float]:
    """Parsed ``lr_multipliers``; ValueError (one line) for a bad entry or a prefix that matches no parameter."""
    rules, problems = parse_lr_multipliers(list(entries))
    if problems:
        raise ValueError(problems[0])
    unmatched = unmatched_prefixes(rules, [n for n, _ in _named_trainable(model)])
    if unmatched:
        raise ValueError(unmatched[0])
    return rules


def unmatched_prefixes(rules: dict[str, float], names: list[str]) -> list[str]:
    """One problem line per prefix of ``rules`` that matches none of the parameter ``names``."""
    top = sorted({n.split(".")[0] for n in names})
    return [
        f"optimizer.lr_multipliers: {prefix!r} matches no parameter of the model; its top-level modules are {top}"
        for prefix in rules
        if prefix != "*" and not any(_matches(n, prefix) for n in names)
    ]


def _groups(named_params, weight_decay: float, lr: float, rules: dict[str, float], own: dict[str, float]) -> list[dict]:
    """One group per (decayed?, lr factor); without rules or modules' own factors exactly two: decayed,
    then not decayed. ``own``: module_lr_factors."""
    buckets: dict[tuple[bool, float], list] = {(True, 1.0): [], (False, 1.0): []} if not (rules or own) else {}
    for name, p in named_params:
        decay = p.ndim >= 2 and not any(n in name for n in _NO_DECAY_NAMES)
        buckets.setdefault((decay, lr_factor(name, rules) * own.get(name, 1.0)), []).append(p)
    return [
        {"params": ps, "weight_decay": weight_decay if decay else 0.0, "lr": lr * factor}
        for (decay, factor), ps in sorted(buckets.items(), key=lambda kv: (not kv[0][0], kv[0][1]))
    ]


def adamw_kernels(params: list[torch.Tensor], implementation: str) -> dict[str, bool]:
    """AdamW's ``fused`` / ``foreach`` keywords for ``optimizer.implementation`` (``auto``: fused when
    every parameter is on CUDA, where it is one kernel launch per group instead of one per op and
    tensor chunk; foreach otherwise: there is no fused kernel for CPU DTensors)."""
    if implementation == "auto":
        implementation = "fused" if params and all(p.device.type == "cuda" for p in params) else "foreach"
    if implementation == "fused" and any(isinstance(p, DTensor) and p.device.type == "cpu" for p in params):
        raise ValueError(
            'optimizer.implementation = "fused": torch has no fused AdamW for sharded (FSDP) CPU parameters; '
            'use "foreach" or "auto"'
        )
    return {"fused": implementation == "fused", "foreach": implementation == "foreach"}


def _adamw(groups: list[dict], cfg: OptimizerConfig) -> torch.optim.AdamW:
    params = [p for g in groups for p in g["params"]]
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        **adamw_kernels(params, cfg.implementation),
    )


def build_adamw(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return _adamw(param_groups(model, cfg.weight_decay, cfg.lr, cfg.lr_multipliers), cfg)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on the 2-D hidden weight matrices, AdamW on everything else, as one optimizer.

    Muon (torch.optim.Muon) orthogonalises each 2-D update with Newton-Schulz iterations; it is
    meant for hidden matrices only, so embeddings, the lm_head, vectors and the 3-D expert weights
    stay on AdamW. Both inner optimizers step together and their state is saved as one dict.
    """

    def __init__(self, model: nn.Module, cfg: OptimizerConfig):
        rules, own = _rules(model, cfg.lr_multipliers), module_lr_factors(model)
        muon_named, adam_named = [], []
        for name, p in _named_trainable(model):
            if p.ndim == 2 and not any(n in name for n in _NO_DECAY_NAMES + ("lm_head",)):
                muon_named.append((name, p))
            else:
                adam_named.append((name, p))
        muon_factors: dict[float, list] = {}
        for name, p in muon_named:
            muon_factors.setdefault(lr_factor(name, rules) * own.get(name, 1.0), []).append(p)
        muon_groups = [{"params": ps, "lr": cfg.muon_lr * f} for f, ps in sorted(muon_factors.items())]
        self.muon = torch.optim.Muon(muon_groups, lr=cfg.muon_lr, weight_decay=cfg.weight_decay)
        self.adamw = _adamw(_groups(adam_named, cfg.weight_decay, cfg.lr, rules, own), cfg)
        # Not Optimizer.__init__: the groups and state belong to the two inner optimizers; this
        # object only exposes them (the LR scheduler scales every group's lr).
        self.defaults = {}
        self.state = {}
        self.param_groups = self.muon.param_groups + self.adamw.param_groups
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        logger.info("Muon on %d matrices, AdamW on %d tensors", len(muon_named), len(adam_named))

    def step(self, closure=None):
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self):
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict) -> None:
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])


def build_muon(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return MuonWithAdamW(model, cfg)
