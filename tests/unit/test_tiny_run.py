"""The tests' shared tiny run (tests/utils.py): the trainer reads its flags as the settings say."""

from __future__ import annotations

import pytest

from spider_titan.config.manager import parse_args
from tests.utils import DEBUG_DENSE, ONE_BLOCK, REPO, TINY_RUN, flags, tiny_run


def parsed(argv: list[str]):
    """The JobConfig of ``argv``, its config file read from the repository whatever the cwd."""
    return parse_args([str(REPO / a) if a.endswith(".toml") else a for a in argv], env={})


def test_the_tiny_run_is_what_its_settings_say():
    cfg = parsed(tiny_run())
    assert (cfg.model.name, cfg.training.dataset, cfg.training.steps) == ("spider", "mock", 2)
    assert (cfg.training.seq_len, cfg.training.local_batch_size, cfg.metrics.log_freq) == (64, 2, 1)
    assert not (cfg.validation.enable or cfg.metrics.enable_tensorboard or cfg.checkpoint.export_at_end)
    assert len(tiny_run()) == 2 * len(TINY_RUN)


def test_an_override_replaces_in_place_adds_or_drops_a_key():
    argv = tiny_run(job__config_file=DEBUG_DENSE, training__steps=5, model__n_layers=1, training__dataset=None)
    assert argv.count("--training.steps") == 1 and argv[argv.index("--training.steps") + 1] == "5"
    assert "--training.dataset" not in argv
    cfg = parsed(argv)
    assert cfg.model.name == "dense" and cfg.training.steps == 5
    assert cfg.training.dataset == "builtin"  # the TOML's, once the tiny run's is dropped
    assert tiny_run(checkpoint__export_at_end=True)[-1] == "true"  # a bool as the CLI spells it


@pytest.mark.parametrize("bad", [{"steps": 3}, {"training__": 3}, {"job__config_file": None}])
def test_a_misspelt_override_is_refused(bad):
    with pytest.raises(TypeError, match="tiny_run"):
        tiny_run(**bad)


def test_one_block_is_a_single_core_block_and_flags_spell_it_alone():
    cfg = parsed(tiny_run(**ONE_BLOCK))
    model = cfg.model.overrides
    assert (model["n_prelude"], model["n_core"], model["n_coda"]) == (0, 1, 0)
    assert model["engram_layers"] == [] and model["byte_ngram_orders"] == []
    bare = flags(**ONE_BLOCK, training__steps=3)
    assert bare[:2] == ["--model.n_prelude", "0"] and bare[-2:] == ["--training.steps", "3"]
    assert len(bare) == 2 * (len(ONE_BLOCK) + 1) and "--job.config_file" not in bare
