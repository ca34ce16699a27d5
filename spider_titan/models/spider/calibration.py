"""Test-time depth calibration (``ModelSpec.calibrate``): the gains of the loops past ``n_loops``.

A model trained at ``n_loops`` loops has never seen the state a further loop hands on, and a full
further loop can move it somewhere worse: measured at debug scale, eval at 2x the loops was up to
0.002 bpb worse than at the trained count (lab/DECISIONS.md, ``[calibration]``). Each loop
``i >= n_loops`` therefore hands on ``h + gain_i (F_i(h) - h)`` at eval (recurrence.py), and the gains
are fitted after training, one loop at a time, on fresh training batches:

    for i = n_loops .. max_loops - 1:
        score the model at i + 1 loops with gain_i in GAINS, pick the best;
        keep it if it beats gain_i = 0 (the model at i loops, which the loop then leaves unchanged)
        by more than Z standard errors of the paired per-window difference, else set gain_i = 0.

A loop whose own parameters never trained (``RecurrentCore.inert_loops``) after one that was left out
receives the state that one received and computes what it computes, so it is not scored again: it is
left out with the same figures (at debug size this cut the calibration from 10 scoring passes to 4).

So on the calibration batches the loss never rises with the loop count (gain 0 reproduces the
previous count bit for bit), and a loop is kept only where it measurably helps: test-time depth is
no worse than the trained depth, and better where a damped further loop helps (measured on the val
split: lab/DECISIONS.md, ``[calibration]``). The trained weights are not touched; the gains are a buffer, saved
and exported with them.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from spider_titan.models.spider.args import SpiderArgs
from spider_titan.protocol import WindowScorer, paired_difference

logger = logging.getLogger("spider_titan")

# Candidate gains of a further loop (0, the loop left out, is the reference each is compared with).
GAINS = (0.25, 0.5, 1.0)
# A gain is kept only when it beats the loop left out by this many standard errors. 3, not 2: the best of
# three candidates is compared, which inflates a chance win, and a wrong keep breaks the promise that more
# loops are no worse. Measured over 25 runs (lab/DECISIONS.md, ``[calibration]``; 32 calibration batches), 4 loops were kept
# at 2 s.e.: the two at 3.1-3.2 s.e. were 0.0003-0.0004 bpb better on the val split too, of the two at 2.7
# s.e. one was 0.0005 better and one 0.0002 worse. 3 gives up the first of those for the promise.
Z = 3.0


@torch.no_grad()
def calibrate_extra_loops(model: nn.Module, args: SpiderArgs, score: WindowScorer) -> dict[str, float]:
    """Fit ``core.extra_loop_gain[n_loops:]`` greedily (module docstring); the figures to log:
    ``loop_gain_<k>`` (the gain of loop k, 1-based), ``calib_diff_bpb_<k>`` (bpb of loop k at its best
    candidate gain minus leaving it out) and ``calib_gain_bpb`` (bpb at ``max_loops`` minus at
    ``n_loops`` on the calibration batches, <= 0)."""
    gains = model.core.extra_loop_gain
    n, top = args.n_loops, args.max_loops
    if top <= n:
        return {}
    ref, count = score({"n_loops": n})
    first = ref
    figures: dict[str, float] = {}
    inert = model.core.inert_loops()
    for i in range(n, top):
        if i > n and gains[i - 1] == 0 and inert[i - 1] and inert[i]:
            gains[i] = 0.0
            figures[f"loop_gain_{i + 1}"] = 0.0
            figures[f"calib_diff_bpb_{i + 1}"] = figures[f"calib_diff_bpb_{i}"]
            logger.info("calibration: loop %d gain 0 (untrained like loop %d, which was left out: the same)", i + 1, i)
            continue
        tried = []
        for g in GAINS:
            gains[i] = g
            ce, _ = score({"n_loops": i + 1})
            tried.append((float(ce.sum()), g, ce))
        _, best, ce = min(tried, key=lambda t: t[0])
        diff, se = paired_difference(ce, ref, count)
        keep = diff < -Z * se
        chosen = best if keep else 0.0
        gains[i] = chosen
        if keep:
            ref = ce
        logger.info(
            "calibration: loop %d gain %g (best of %s: %+.5f +- %.5f bpb against leaving it out; %s)",
            i + 1,
            chosen,
            list(GAINS),
            diff,
            se,
            "kept" if keep else f"not {Z:g} standard errors better, left out",
        )
        figures[f"loop_gain_{i + 1}"] = chosen
        figures[f"calib_diff_bpb_{i + 1}"] = diff
    figures["calib_gain_bpb"] = paired_difference(ref, first, count)[0]
    return figures


def effective_loops(model: nn.Module, n_loops: int | None) -> int | None:
    """``ModelSpec.effective_loops``: the fewest core loops whose output equals ``n_loops``' bit for bit
    (trailing loops past the trained count with gain 0 hand on their input unchanged, so generation
    leaves them out). ``n_loops`` as given in training mode or outside ``n_loops..max_loops``."""
    if n_loops is None or model.training:
        return n_loops
    trained, gains = model.args.n_loops, model.core.extra_loop_gain
    if not trained < n_loops <= model.args.max_loops:
        return n_loops
    needed = n_loops
    while needed > trained and float(gains[needed - 1]) == 0.0:
        needed -= 1
    return needed
