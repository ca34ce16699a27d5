"""Optimizer builders: ``build_*(model, cfg: OptimizerConfig) -> torch.optim.Optimizer`` (the [optimizer] section).

Weight decay goes to matrices only: norms, biases, the LTI decay and other vectors are not decayed,
and neither are embedding tables (decaying rarely used byte rows only shrinks them).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from spider_titan.config.job_config import Optimizer as OptimizerConfig

logger = logging.getLogger("spider_titan")

# Parameters whose FQN contains one of these are not decayed: embedding tables (decaying rarely
# used rows only shrinks them) and per-loop LoRA adapters (the adapters of loops a run never
# reaches get no gradient, and decay alone would erode them).
_NO_DECAY_NAMES = ("embed_tokens", "loop_embedding", "engram", "lora")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: decayed matrices and everything else."""
    return _split_decay([(n, p) for n, p in model.named_parameters() if p.requires_grad], weight_decay)


def _split_decay(named_params, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in named_params:
        if p.ndim >= 2 and not any(n in name for n in _NO_DECAY_NAMES):
            decay.append(p)
        else:
            no_decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_adamw(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    # foreach is the fast path for DTensor (FSDP2) parameters on both CPU and GPU; fused has no
    # CPU DTensor kernel.
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True
    )


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on the 2-D hidden weight matrices, AdamW on everything else, as one optimizer.

    Muon (torch.optim.Muon) orthogonalises each 2-D update with Newton-Schulz iterations; it is
    meant for hidden matrices only, so embeddings, the lm_head, vectors and the 3-D expert weights
    stay on AdamW. Both inner optimizers step together and their state is saved as one dict.
    """

    def __init__(self, model: nn.Module, cfg: OptimizerConfig):
        muon_params, adam_named = [], []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if p.ndim == 2 and not any(n in name for n in _NO_DECAY_NAMES + ("lm_head",)):
                muon_params.append(p)
            else:
                adam_named.append((name, p))
        self.muon = torch.optim.Muon(muon_params, lr=cfg.muon_lr, weight_decay=cfg.weight_decay)
        self.adamw = torch.optim.AdamW(
            _split_decay(adam_named, cfg.weight_decay),
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            foreach=True,
        )
        # Not Optimizer.__init__: the groups and state belong to the two inner optimizers; this
        # object only exposes them (the LR scheduler scales every group's lr).
        self.defaults = {}
        self.state = {}
        self.param_groups = self.muon.param_groups + self.adamw.param_groups
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        logger.info("Muon on %d matrices, AdamW on %d tensors", len(muon_params), len(adam_named))

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
