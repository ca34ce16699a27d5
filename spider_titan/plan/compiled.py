"""Blocks run as torch.compile partitions them (:class:`CompiledSaves`): AOT autograd with Inductor's
decompositions and min-cut partitioner, each graph one opaque op whose outputs are counted and whose
own buffers are followed as its kernels write and free them."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._pytree import tree_flatten

from spider_titan.plan.recorder import _LiveStorages


@contextmanager
def _compiling() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` reads True, as while Dynamo traces: the blocks skip their
    host-side checks (moe/base.py) exactly as in a compiled run."""
    flag = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = flag


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _is(node: torch.fx.Node, tag: torch.Tag) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and tag in node.target.tags


def _fused_nodes(nodes: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """The call_function nodes Inductor computes inside other kernels instead of into a buffer of their
    own: views, and pointwise ops whose every reader is a reduction or is itself computed inline (a graph
    output, a matmul's or any other extern op's input is a buffer)."""
    inline: set[torch.fx.Node] = set()  # nodes whose every reader computes them inline
    fused: set[torch.fx.Node] = set()
    for node in reversed(nodes):
        if node.op != "call_function":
            continue
        view = node.target is operator.getitem or getattr(node.target, "is_view", False)
        if all(u.op == "call_function" and (_is(u, torch.Tag.reduction) or u in inline) for u in node.users):
            if view or _is(node, torch.Tag.pointwise):
                inline.add(node)
        if view or node in inline:
            fused.add(node)
    return fused


def _bytes_of(val) -> int:
    return sum(t.untyped_storage().nbytes() for t in tree_flatten(val)[0] if isinstance(t, torch.Tensor))


class _Buffers:
    """The buffers a graph's own kernels write as it runs, its outputs included: each op that is not
    fused (:func:`_fused_nodes`) writes one, freed after the last kernel that reads it, directly or through
    fused ops. :meth:`peak` is the most they hold at once above what was alive as the graph started,
    given which of its inputs die when the graph drops them (then at their last read, as in Inductor's
    code). Matters where backward recomputes (a memory budget): the recomputed buffers live only in there."""

    def __init__(self, gm: torch.fx.GraphModule):
        nodes = list(gm.graph.nodes)
        index = {n: i for i, n in enumerate(nodes)}
        outputs = set(next(n for n in reversed(nodes) if n.op == "output").all_input_nodes)
        fused = _fused_nodes(nodes)
        read_at: dict[torch.fx.Node, int] = {}  # when a node's value is read: its own kernel, or its consumers'
        for node in reversed(nodes):
            read_at[node] = max((read_at[u] for u in node.users), default=index[node]) if node in fused else index[node]
        last_read = {n: max((read_at[u] for u in n.users), default=index[n]) for n in nodes}
        self.inputs_read = [last_read[n] for n in nodes if n.op == "placeholder"]  # by input position
        # (position, bytes) as the graph runs: a buffer is written at its op's index and freed just after
        # its last reader's (an output is never freed here)
        self.events: list[tuple[float, int]] = []
        for node in nodes:
            if node.op == "call_function" and node not in fused:
                nbytes = _bytes_of(node.meta.get("val"))
                self.events.append((index[node], nbytes))
                if node not in outputs:
                    self.events.append((last_read[node] + 0.5, -nbytes))
        self.events.sort()

    def peak(self, dying: dict[int, int]) -> int:
        """``dying``: input position -> bytes freed once read for the last time."""
        freed = [(self.inputs_read[position] + 0.5, -nbytes) for position, nbytes in dying.items()]
        live = peak = 0
        for _, nbytes in sorted(self.events + freed) if freed else self.events:
            live += nbytes
            peak = max(peak, live)
        return peak


class _OneOp:
    """A traced graph as one opaque op on fake tensors: its outputs are made from the metadata the trace
    left on them (new storages, or views of the inputs they alias), and its FLOPs are counted once from
    the same metadata; none of its ops runs."""

    def __init__(self, gm: torch.fx.GraphModule, formulas: dict):
        nodes = list(gm.graph.nodes)
        inputs = [n.meta.get("val") for n in nodes if n.op == "placeholder"]
        aliased = {t.untyped_storage()._cdata: i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)}
        self.outputs: list[tuple | None] = []  # (input index or None, storage group, the output's metadata)
        groups: dict[int, int] = {}
        for node in next(n for n in reversed(nodes) if n.op == "output").args[0]:
            val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
            if not isinstance(val, torch.Tensor):
                self.outputs.append(None)
                continue
            key = val.untyped_storage()._cdata
            self.outputs.append((aliased.get(key), groups.setdefault(key, len(groups)), val))
        self.flops = 0
        for node in nodes:
            count = formulas.get(getattr(node.target, "_overloadpacket", None)) if node.op == "call_function" else None
            if count is not None:
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
                self.flops += count(*args, **kwargs, out_val=node.meta.get("val"))
        self.buffers = _Buffers(gm)

    def __call__(self, inputs: list) -> list:
        bases: dict[int, torch.Tensor] = {}
        out = []
        for spec in self.outputs:
            if spec is None:
                out.append(None)
                continue
            index, group, val = spec
            if index is not None:
                base = inputs[index]
            elif group in bases and bases[group].dtype == val.dtype:
                base = bases[group]
            else:
                nbytes = val.untyped_storage().nbytes()
                base = bases[group] = torch.empty(nbytes // val.element_size(), dtype=val.dtype)
            out.append(base.as_strided(val.shape, val.stride(), val.storage_offset()))
        return out


_PASSED = object()  # CompiledSaves: a tensor argument, passed to the trace (the others are bound)


class CompiledSaves(nn.Module):
    """Runs ``block`` as torch.compile partitions it for backward: AOT autograd with Inductor's
    decompositions and its min-cut partitioner (Inductor recomputes cheap ops in backward instead of
    saving them). Each graph, forward and backward, is one opaque op (:class:`_OneOp`) for ``recorder``:
    what it returns is counted, not its intermediates, which Inductor's fused kernels mostly never
    write. Blocks alike (same class, weights and inputs) share one trace in ``traced``."""

    def __init__(self, block: nn.Module, recorder: _LiveStorages, traced: dict):
        super().__init__()
        self.block = block
        self.recorder = recorder
        self.traced = traced

    def _as_one_op(self, gm: torch.fx.GraphModule, example_inputs) -> Callable:
        """AOT's "compiler" (boxed): :class:`_OneOp` of the graph, counted by ``recorder``."""
        recorder = self.recorder
        op = _OneOp(gm, recorder.formulas)

        def run(args):
            live = recorder.live
            storages = [t.untyped_storage() if isinstance(t, torch.Tensor) else None for t in args]
            keys = [None if u is None else u._cdata for u in storages]
            sizes = {k: u.nbytes() for k, u in zip(keys, storages, strict=True) if k in recorder.refs}
            del storages
            inputs = list(args)
            args.clear()  # the inputs the outputs do not alias die here, as in Inductor's code
            paused, recorder.paused = recorder.paused, True  # the outputs' allocations: counted below
            try:
                out = op(inputs)
            finally:
                recorder.paused = paused
            del inputs
            if not recorder.paused:
                recorder.flops += op.flops
                # the graph's own buffers while it ran, above what was alive as it started; an input that
                # died with it was freed at its last read (once per storage)
                dying = {}
                for position, key in enumerate(keys):
                    if key in sizes and key not in recorder.refs:
                        dying[position] = sizes.pop(key)
                recorder.peak = max(recorder.peak, live + op.buffers.peak(dying))
                recorder.count_outputs(out)
            return out

        run._boxed_call = True
        return run

    def _call(self, bound: tuple, weights, *args, **kwargs):
        given = iter(args)
        args = tuple(next(given) if b is _PASSED else b for b in bound)
        return torch.func.functional_call(self.block, weights, args, kwargs)

    def forward(self, *args, **kwargs):
        from torch._functorch.aot_autograd import aot_function
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        from torch._inductor.decomposition import select_decomp_table

        weights = {**dict(self.block.named_parameters()), **dict(self.block.named_buffers())}
        # AOT makes a graph input of every argument, a None (a core block's Engram memory) or a number (the
        # byte n-grams' first byte) too, one without a value that the budget partitioner cannot size: those
        # are bound, the tensors passed
        bound = tuple(_PASSED if isinstance(a, torch.Tensor) else a for a in args)
        args = tuple(a for a in args if isinstance(a, torch.Tensor))
        leaves = tree_flatten((args, kwargs, weights))[0]
        key = (type(self.block), repr(bound), *weights, *(_signature(t) for t in leaves))
        fn = self.traced.get(key)
        if fn is None:
            fn = self.traced[key] = aot_function(
                functools.partial(self._call, bound),
                fw_compiler=self._as_one_op,
                bw_compiler=self._as_one_op,
                partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
                decompositions=select_decomp_table(),
            )
            self.recorder.paused = True
            try:  # the first call traces; what it saves is hidden from an enclosing checkpoint, and dies here
                with _compiling(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
                    fn(weights, *args, **kwargs)
            finally:
                self.recorder.paused = False
        with _compiling():
            return fn(weights, *args, **kwargs)


def _signature(x) -> tuple | str:
    return (tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else repr(x)


def compile_like_trainer(model: nn.Module, spec, recorder: _LiveStorages) -> None:
    """Puts :class:`CompiledSaves` in place of each block the trainer compiles (parallel/compile.py). A
    checkpointed block keeps its wrapper, which keeps the block's inputs, and runs its block compiled
    inside: the recompute in backward then holds what the compiled block saves. The spec's
    ``compiled_modules`` are wrapped as well."""
    traced: dict = {}
    for fqn, block in spec.blocks(model) + spec.compiled_extras(model):
        if isinstance(block, CheckpointWrapper):
            block._checkpoint_wrapped_module = CompiledSaves(block._checkpoint_wrapped_module, recorder, traced)
        else:
            container, _, name = fqn.rpartition(".")
            model.get_submodule(container).register_module(name, CompiledSaves(block, recorder, traced))
