"""``training.cuda_graph``: a step's forwards and backwards as one CUDA graph, replayed every step.

A compiled Spider 1B step on one H200 keeps the GPU idle most of the core's forward: 36 compiled
block calls, each a few dozen kernels launched from Python, plus the glue between them
(docs/benchmarks.md, "Spider 1B on one GPU"). A CUDA graph launches all of them at once. After
``WARMUP_STEPS`` plain steps (the first compiles), the next step's forward and backward over all its
micro-batches (the weight casts, autocast, activation-checkpoint recomputes and compiled blocks
included) is captured once, on the stream the warm-up ran on, and every later step copies its
batch into the graph's input buffers and replays it. Gradient clipping, the optimizer and the
post-step hooks run outside, as before.

What the graph needs, checked when the trainer is built (:func:`graph_blockers`): one CUDA device,
no FSDP or other sharding, and a forward that is the same graph every step: no host read of a
data-dependent size (Spider: ``model.segment_capacity``) and no per-step host choice (the model
spec's ``graph_blockers``). The gradients are created by the graph's first backward (they are
``None`` at capture), so every replay writes them afresh into the same memory; the step hands them
back to the parameters after each replay, since the optimizer's ``zero_grad`` drops them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

FORWARD_BACKWARD = "train.forward_backward"  # the profiler range of what the graph replays
WARMUP_STEPS = 2  # plain steps before the capture: the first compiles, the second meets what the first left
Batches = list[tuple[torch.Tensor, ...]]
Outputs = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


Layout = tuple[list[torch.Size], list[str]]  # the outputs' shapes, and the aux keys in order


def flatten_outputs(outputs: Outputs) -> tuple[torch.Tensor, Layout]:
    """``(ce_total, label_tokens, aux_totals)`` as one flat fp32 tensor (one copy per step reads them
    all), and the layout :func:`unflatten_outputs` takes them apart by."""
    ce, tokens, aux = outputs
    parts = [ce, tokens, *aux.values()]
    flat = torch.cat([t.detach().float().reshape(-1) for t in parts])
    return flat, ([t.shape for t in parts], list(aux))


def unflatten_outputs(flat: torch.Tensor, layout: Layout) -> Outputs:
    """The outputs of :func:`flatten_outputs` again, as views of ``flat``."""
    shapes, keys = layout
    parts, at = [], 0
    for shape in shapes:
        parts.append(flat[at : at + shape.numel()].view(shape))
        at += shape.numel()
    return parts[0], parts[1], dict(zip(keys, parts[2:]))


def _shapes(batches: Batches) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for batch in batches for t in batch]


def graph_blockers(
    *, device: torch.device, world_size: int, model_blockers: Sequence[str], fp32_experts: bool = False
) -> list[str]:
    """Why a training step cannot be one CUDA graph here (empty: it can). ``fp32_experts``: MoE layers
    computing in fp32, whose grouped GEMM on CUDA copies the expert offsets to the host (torch 2.11)."""
    reasons = [] if device.type == "cuda" else [f"a CUDA device (this run is on {device.type})"]
    if world_size > 1:
        reasons.append(f"one process (this run has {world_size}: FSDP and expert parallel communicate per step)")
    if fp32_experts:
        reasons.append(
            "training.mixed_precision_param bfloat16 (fp32's grouped expert GEMM reads its offsets on the host)"
        )
    return reasons + list(model_blockers)


class StepGraph:
    """``step_graph(micro_batches, step)``: ``forward_backward(micro_batches, step)``'s outputs
    ``(ce_total, label_tokens, aux_totals)``, plain for the first ``warmup`` calls, then from one
    captured graph. A new number or shape of micro-batches is refused: the graph is one shape."""

    def __init__(
        self, forward_backward: Callable[[Batches, int], Outputs], model: nn.Module, warmup: int = WARMUP_STEPS
    ):
        self.forward_backward, self.warmup = forward_backward, warmup
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.stream = torch.cuda.Stream()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.calls = 0
        self.inputs: Batches = []
        self.flat = torch.empty(0)  # the graph's outputs, flat: (ce_total, label_tokens, *aux_totals)
        self.layout: Layout = ([], [])
        self.grads: list[torch.Tensor | None] = []

    def __call__(self, micro_batches: Batches, step: int) -> Outputs:
        self.calls += 1
        if self.calls <= self.warmup:
            return self._on_stream(lambda: self.forward_backward(micro_batches, step))
        if self.graph is None:
            self._capture(micro_batches, step)
        if _shapes(micro_batches) != _shapes(self.inputs):
            raise ValueError(
                f"training.cuda_graph: the graph was captured for inputs {_shapes(self.inputs)}, "
                f"this step has {_shapes(micro_batches)}"
            )
        for static, new in zip(self.inputs, micro_batches):
            for s, t in zip(static, new):
                s.copy_(t, non_blocking=True)
        self.graph.replay()
        for p, g in zip(self.params, self.grads):
            p.grad = g
        return unflatten_outputs(self.flat.clone(), self.layout)  # one copy: the next replay overwrites them

    def _on_stream(self, fn: Callable[[], Outputs]) -> Outputs:
        """``fn()`` on the side stream the capture uses (its lazy per-stream state is made in warm-up)."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            out = fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        return out

    def _capture(self, micro_batches: Batches, step: int) -> None:
        self.inputs = [tuple(t.clone() for t in batch) for batch in micro_batches]
        for p in self.params:  # the graph's first backward creates them: each replay writes them afresh
            p.grad = None
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the data loader's pinning thread may use CUDA while this thread captures
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                self.flat, self.layout = flatten_outputs(self.forward_backward(self.inputs, step))
        except RuntimeError as e:
            raise RuntimeError(
                f"training.cuda_graph: the step could not be captured as one CUDA graph ({e}); "
                "something in the forward or backward reads a device value on the host"
            ) from e
        self.grads = [p.grad for p in self.params]
        self.graph = graph
