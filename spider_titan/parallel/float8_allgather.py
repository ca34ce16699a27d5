"""FSDP2's all-gather, moving float8 payloads as uint8 bytes (and counting them).

With the float8 converter's ``tensorwise`` recipe and ``enable_fsdp_float8_all_gather``, torchao's
``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`` hands FSDP2 the weight already cast to
float8 (1 byte per element; the scale is precomputed on every rank after each optimizer step by
``precompute_float8_dynamic_scale_for_fsdp``, so it never travels) and ``fsdp_post_all_gather``
wraps the gathered bytes back into a ``Float8TrainingTensor``. A unit that also holds ordinary
parameters is gathered as one uint8 buffer by FSDP2 itself; a unit whose inputs are all float8 is
gathered in float8, which gloo rejects ("Invalid scalar type"). :class:`BytesAllGather` views
float8 buffers as uint8 for the collective: the same bytes, so the same results, and on CPU the
exact fp8 path that runs on GPUs is exercised. NCCL could carry float8 itself; the uint8 view
costs nothing there, so it is used on every backend.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather  # FSDP2's custom-comm interface (not re-exported)

from spider_titan.parallel.comm_counter import CountingComm

# torch >= 2.12 name; 2.11 has only the older one (deprecated since, the same collective)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

FLOAT8_DTYPES = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)


def as_bytes_if_float8(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of ``t`` when it is float8 (same storage), else ``t``."""
    return t.view(torch.uint8) if t.dtype in FLOAT8_DTYPES else t


class BytesAllGather(CountingComm, AllGather):
    """FSDP2 custom all-gather (``FSDPModule.set_custom_all_gather``): float8 moves as uint8;
    bytes are counted per process group (:class:`CountingComm`)."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ):
        out, inp = as_bytes_if_float8(output_tensor), as_bytes_if_float8(input_tensor)
        self.count("all_gather", group, out.numel() * out.element_size())
        return _all_gather_single(out, inp, group=group, async_op=async_op)
