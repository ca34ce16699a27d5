"""Every shipped flavor's outputs, pinned: a change that is meant to leave the model as it is (a
retired option, a moved module, a renamed spec field) must leave these numbers as they are.

Each registered model's every flavor is built on the meta device, materialised on the CPU and
initialised under ``torch.manual_seed(SEED)``, then run in eval mode on one fixed row of
``LENGTH`` bytes, labels the same row. The reference (``tests/fixtures/flavor_outputs.json``) keeps,
per ``model/flavor`` key: the float64 sum, absolute sum and squared sum of all the logits, the full
logit rows at ``POSITIONS``, the loss and the model's scalar ``aux`` figures; ``EXTRA`` pins a few
forward arguments besides (Spider debug at its test-time depth). It was written at
bf75ae5 (the ``medium`` flavors at 14e6b7a, the commit that added them, before the retirements) by

    python -m tests.unit.test_flavor_outputs --write

which adds the flavors the file lacks and never rewrites one it has (a reference rewritten with
the code it checks pins nothing); delete an entry by hand only when a change is meant to alter
that flavor's outputs, and say so in the commit.

Tolerance: ``RTOL`` / ``ATOL`` on the logits and 1e-5 relative on the sums. The same code on the
same machine reproduces them bit for bit; fp32 matmuls summed in another order (another BLAS
kernel or thread count) move a logit by about 1e-6 of its size, while any change to the model (an
initialisation drawn in another order, a term dropped or added) moves them by orders of magnitude
more. The 1B flavors take tens of seconds each on one CPU core (4 GB of fp32 weights): ``slow``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

from spider_titan import registry
from spider_titan.vocab import BOS_ID

REFERENCE = Path(__file__).resolve().parents[1] / "fixtures" / "flavor_outputs.json"
SEED = 1234
LENGTH = 64
POSITIONS = (1, LENGTH - 1)
RTOL = ATOL = 1e-4
# flavors whose build and forward take longer than a unit test should (1B parameters on a CPU)
SLOW = {"1B"}

TEXT = b"def spider(web):\n    return [strand for strand in web if strand]\n\n# the end of it all."


# forward keyword arguments of extra pinned cases, by reference key: debug trains one core loop, so
# its test-time depth (every loop up to max_loops, the eval-only loop gains) is pinned apart
EXTRA = {"spider/debug@loops4": ("spider", "debug", {"n_loops": 4})}


def reference_keys() -> dict[str, tuple[str, str, dict]]:
    """Every (model, flavor) the registry ships, then the ``EXTRA`` cases, by reference key."""
    keys = {f"{m}/{f}": (m, f, {}) for m in registry.names("model") for f in registry.get("model", m).flavors}
    return {**keys, **EXTRA}


def flavor_cases() -> list:
    """The reference keys as test cases, the big flavors marked ``slow``."""
    return [
        pytest.param(key, id=key, marks=[pytest.mark.slow] if flavor in SLOW else [])
        for key, (_, flavor, _) in reference_keys().items()
    ]


def input_row() -> torch.Tensor:
    """(1, LENGTH) int64: BOS then the first LENGTH - 1 bytes of ``TEXT``."""
    return torch.tensor([[BOS_ID, *TEXT[: LENGTH - 1]]], dtype=torch.int64)


@torch.no_grad()
def flavor_outputs(model_name: str, flavor: str, forward_kwargs: dict | None = None) -> dict:
    """The figures the reference keeps for one flavor (module docstring)."""
    spec = registry.get("model", model_name)
    model = spec.build_on_meta(spec.build_args(flavor))
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    model.init_weights()
    model.eval()
    ids = input_row()
    out = model(ids, labels=ids, **(forward_kwargs or {}))
    logits = out.logits.double()
    del model
    return {
        "sum": float(logits.sum()),
        "abs_sum": float(logits.abs().sum()),
        "sq_sum": float((logits**2).sum()),
        "rows": {str(p): out.logits[0, p].tolist() for p in POSITIONS},
        "loss": float(out.loss),
        "aux": {k: float(v) for k, v in sorted(out.aux.items()) if v.numel() == 1},
    }


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=rel)


@pytest.mark.parametrize("key", flavor_cases())
def test_flavor_outputs_match_the_reference(key):
    """Logits, loss and aux figures of every shipped flavor equal the reference (module docstring)."""
    refs = json.loads(REFERENCE.read_text())
    assert key in refs, (
        f"{key}: no reference in {REFERENCE}; add it with python -m tests.unit.test_flavor_outputs --write"
    )
    ref, got = refs[key], flavor_outputs(*reference_keys()[key])
    for p in POSITIONS:
        torch.testing.assert_close(
            torch.tensor(got["rows"][str(p)]), torch.tensor(ref["rows"][str(p)]), rtol=RTOL, atol=ATOL
        )
    for k in ("sum", "abs_sum", "sq_sum", "loss"):
        assert _close(got[k], ref[k]), f"{key} {k}: {got[k]!r} != reference {ref[k]!r}"
    assert sorted(got["aux"]) == sorted(ref["aux"]), f"{key} aux keys: {sorted(got['aux'])} != {sorted(ref['aux'])}"
    bad = {k: (got["aux"][k], v) for k, v in ref["aux"].items() if not _close(got["aux"][k], v, 1e-4)}
    assert not bad, f"{key} aux (got, reference): {bad}"


def main() -> None:
    p = argparse.ArgumentParser(
        description="Write the references of the flavors tests/fixtures/flavor_outputs.json lacks."
    )
    p.add_argument("--write", action="store_true", help="compute and add the missing flavors' references")
    args = p.parse_args()
    refs = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {}
    missing = [key for key in reference_keys() if key not in refs]
    print(f"missing: {missing}")
    if not args.write:
        return
    torch.set_num_threads(1)
    for key in missing:
        refs[key] = flavor_outputs(*reference_keys()[key])
        print(f"{key}: sum {refs[key]['sum']:.6f}")
    REFERENCE.parent.mkdir(parents=True, exist_ok=True)
    REFERENCE.write_text(json.dumps(refs, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
