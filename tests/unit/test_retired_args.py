"""Options that left the Spider model (SPIDER_RETIRED_ARGS): a saved model that used the value the code
still computes loads without them; one that used another value is refused in one line naming the option
and the last release or commit that had it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from spider_titan import registry
from spider_titan.checkpoint.export import full_model_state_dict, write_export
from spider_titan.checkpoint.layout import ModelIdentity
from spider_titan.generation import load_model
from spider_titan.models.spider.args import SPIDER_FLAVORS, SPIDER_RETIRED_ARGS

# What an export of the last commit with these options wrote for them: the shipped values.
SAVED_BEFORE = {
    "byte_dim": 0,
    "byte_mlp": True,
    "halting": "none",
    "act_epsilon": 0.01,
    "ponder_coeff": 0.01,
    "boundary_loss": "ratio",
    "boundary_noise": "none",
    "boundary_temperature": 0.5,
    "boundary_band_inner": 0.0,
    "boundary_standardize": True,
    "boundary_ste": False,
    "boundary_confidence": True,
    "boundary_prelude_grad": True,
    "dechunk_smoothing": True,
    "stage_init": True,
    "extra_loop_gains": True,
    "loop_state_norm": False,
    "pack_segments": True,
    "depth_capacity": [],
    "depth_scale_range": 1.0,
    "loop_sampling": "fixed",
    "loop_tail": 0.1,
    "backprop_loops": 0,
    "loop_init_std": 0.0,
    "loop_step_size": False,
    "loop_lora": True,
    "loop_embedding": True,
    "boundary_band": 0.2,
    "boundary_band_upper": 0.3,
}


def saved_identity(**changes) -> dict:
    args = {**dataclasses.asdict(SPIDER_FLAVORS["debug"]), **SAVED_BEFORE, **changes}
    return {"name": "spider", "flavor": "debug", "args": json.loads(json.dumps(args))}


def test_every_retired_field_is_listed_with_what_it_was_saved_as():
    assert set(SAVED_BEFORE) == set(SPIDER_RETIRED_ARGS)
    assert all(isinstance(commit, str) and commit for _, commit in SPIDER_RETIRED_ARGS.values())


def test_the_shipped_values_load_as_todays_model():
    identity = ModelIdentity.from_json(saved_identity())
    assert identity.build_args() == SPIDER_FLAVORS["debug"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("halting", "act"), ("boundary_loss", "hinge"), ("stage_init", False), ("byte_dim", 64)],
)
def test_another_value_is_refused_in_one_line(field, value):
    with pytest.raises(ValueError) as e:
        ModelIdentity.from_json(saved_identity(**{field: value}))
    line = str(e.value)
    assert "\n" not in line and f"{field} = {value!r}" in line, line
    assert f"last in {SPIDER_RETIRED_ARGS[field][1]}" in line, line


def test_an_export_with_a_retired_option_fails_to_load_in_one_line(tmp_path):
    spec = registry.get("model", "spider")
    args = SPIDER_FLAVORS["debug"]
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights()
    out = tmp_path / "export"
    write_export(full_model_state_dict(model), ModelIdentity.of("spider", "debug", args), out, dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    config["model"]["args"].update({**SAVED_BEFORE, "halting": "act"})  # an export of the ACT model
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"halting = 'act' \(last in commit"):
        load_model(out, device="cpu", dtype=torch.float32)
