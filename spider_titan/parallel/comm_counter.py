"""Count the bytes every collective of a training step moves, per kind and per owner.

Filled in by the collectives themselves: FSDP2's all-gather and reduce-scatter go through this
package's custom comms (float8_allgather.py, fsdp.py), tagged with the FSDP unit's FQN (``root``
for the root unit, ``<unit>.experts`` for expert weights sharded over the ``efsdp`` mesh), and
the expert-parallel all-to-alls (expert_parallel.py) are tagged with their MoE layer.

Bytes are the logical collective sizes on this rank (what nccl-tests calls "size"):
    all_gather      the gathered output, world_size x the local shard
    reduce_scatter  the input, i.e. the unsharded gradient buffer
    all_to_all      what this rank sends (its receive counts are another rank's sends)
HSDP's all-reduce of the sharded gradient across replicas is FSDP2's plain ``dist.all_reduce``
and is not seen here; it moves the reduce-scatter's output, 1/shard of its input.

:meth:`CommCounter.step` closes a step's tally (the parallelize component hands it to the builder as
a post-step hook, so it runs after every optimizer step), and with a ``path`` rank 0 appends it as
one JSON line (``step`` counts the optimizer steps of this process, so a resumed run starts again
at 1).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

COMM_COUNTS_FILE = "comm_counts.jsonl"  # <dump_folder>/comm_counts.jsonl: one line per step, on rank 0


class CommCounter:
    """Running byte totals keyed by (kind, tag), and the per-step tallies."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else None
        self._totals: dict[tuple[str, str], int] = defaultdict(int)
        self._at_last_step: dict[tuple[str, str], int] = {}
        self.steps: list[dict[str, dict[str, int]]] = []

    def add(self, kind: str, tag: str, nbytes: int) -> None:
        self._totals[(kind, tag)] += int(nbytes)

    def totals(self) -> dict[str, dict[str, int]]:
        """``{kind: {tag: bytes}}`` since the counter was made."""
        return _nest(self._totals)

    def step(self) -> dict[str, dict[str, int]]:
        """Close the current step: its ``{kind: {tag: bytes}}`` (also kept in ``steps``)."""
        delta = {k: v - self._at_last_step.get(k, 0) for k, v in self._totals.items()}
        self._at_last_step = dict(self._totals)
        tally = _nest({k: v for k, v in delta.items() if v})
        self.steps.append(tally)
        if self.path is not None and _rank() == 0:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": len(self.steps), "rank": 0, **tally}) + "\n")
        return tally

    def post_step(self) -> None:
        """The post-step hook (``protocol.PostStepHook``): closes the step; its bytes go to the file,
        not to the step's metrics."""
        self.step()


def step_total(tally: dict[str, dict[str, int]], kind: str, prefix: str = "") -> int:
    """Bytes of ``kind`` in one step's tally, over the tags that start with ``prefix``."""
    return sum(v for tag, v in tally.get(kind, {}).items() if tag.startswith(prefix))


def read_comm_counts(path: str | Path) -> list[dict]:
    """The rows a :class:`CommCounter` with a ``path`` wrote, one per optimizer step."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _nest(flat: dict[tuple[str, str], int]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for (kind, tag), v in sorted(flat.items()):
        out.setdefault(kind, {})[tag] = v
    return out


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class CountingComm:
    """What the custom FSDP2 collectives share (fsdp.py, float8_allgather.py): the buffer they
    allocate and where their bytes are counted.

    ``tags`` maps a process group to the name its bytes are counted under (``default_tag`` for
    the others), so one FSDP unit with dense and expert parameter groups counts them apart.
    """

    def __init__(self, counter: CommCounter | None = None, default_tag: str = "", tags: dict | None = None):
        self.counter = counter
        self.default_tag = default_tag
        self.tags = tags or {}

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def count(self, kind: str, group, nbytes: int) -> None:
        if self.counter is not None:
            self.counter.add(kind, self.tags.get(group, self.default_tag), nbytes)
