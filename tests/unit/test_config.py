"""Config parsing: TOML + CLI precedence, typed conversion, collected errors, shipped configs."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest
import tomli

from spider_titan.config.help import help_text, to_toml
from spider_titan.config.manager import ConfigError, parse_args
from spider_titan.job_config import JobConfig, Range

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "train_configs").glob("*.toml"))


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_defaults_without_file():
    cfg = parse_args([], env={})
    assert cfg == parse_args([], env={})
    assert isinstance(cfg, JobConfig) and cfg.training.seq_len == JobConfig().training.seq_len


def test_cli_overrides_toml_overrides_defaults(tmp_path):
    path = write(tmp_path, "[training]\nseq_len = 64\nsteps = 7\n[optimizer]\nlr = 0.5\n")
    cfg = parse_args(["--job.config_file", path, "--training.steps", "9", "--optimizer.lr=0.25"], env={})
    assert cfg.training.seq_len == 64  # TOML over default
    assert cfg.training.steps == 9  # CLI over TOML, space form
    assert cfg.optimizer.lr == 0.25  # CLI over TOML, = form


@pytest.mark.parametrize(
    "arg, value, expected",
    [
        ("training.compile", "true", True),
        ("training.compile", "0", False),
        ("training.target_tokens", "1_000", 1000),
        ("optimizer.lr", "1e-3", 1e-3),
        ("model.converters", "float8", ["float8"]),
        ("model.converters", "", []),
        ("activation_checkpoint.mode", "full", "full"),
    ],
)
def test_cli_value_types(arg, value, expected):
    section, key = arg.split(".")
    try:
        cfg = parse_args([f"--{arg}", value], env={})
    except ConfigError as e:  # float8 may not be registered in every build: then it must say so
        assert "float8" in str(e) and expected == ["float8"]
        return
    assert getattr(getattr(cfg, section), key) == expected


def test_model_overrides_are_typed_by_model_args():
    cfg = parse_args(["--model.name", "dense", "--model.n_layers", "3"], env={})
    assert cfg.model.overrides == {"n_layers": 3}
    with pytest.raises(ConfigError, match="model.n_layers: expected an integer"):
        parse_args(["--model.name", "dense", "--model.n_layers", "three"], env={})
    with pytest.raises(ConfigError, match="unknown key model.n_layerz"):
        parse_args(["--model.name", "dense", "--model.n_layerz", "3"], env={})


def test_problems_are_collected_together(tmp_path):
    path = write(tmp_path, "[training]\nseq_len = 'long'\n[bogus]\nx = 1\n")
    with pytest.raises(ConfigError) as info:
        parse_args(
            [
                "--job.config_file",
                path,
                "--training.stepz",
                "3",
                "--activation_checkpoint.mode",
                "most",
                "--optimizer.name",
                "SGD",
            ],
            env={},
        )
    problems = info.value.problems
    assert len(problems) == 5, problems
    joined = "\n".join(problems)
    for needle in ("training.seq_len", "[bogus]", "training.stepz", "activation_checkpoint.mode", "optimizer.name"):
        assert needle in joined
    assert all("\n" not in p for p in problems)


def test_parallel_degrees_checked_against_world_size():
    with pytest.raises(ConfigError, match=r"dp_replicate\(2\) \* dp_shard\(2\) = 4 != WORLD_SIZE\(6\)"):
        parse_args(
            ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"],
            env={"WORLD_SIZE": "6"},
        )
    cfg = parse_args(["--parallelism.data_parallel_replicate_degree", "2"], env={"WORLD_SIZE": "4"})
    assert cfg.parallelism.data_parallel_shard_degree == -1


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        parse_args(["--job.config_file", "/nonexistent/job.toml"], env={})


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_parses_round_trips_and_assembles(path, tmp_path):
    """Each config is valid on one node of 8 ranks, writes back to an equal TOML, and its model
    assembles on the meta device with its converters and activation checkpointing."""
    from spider_titan.components.builder import build_model

    env = {"WORLD_SIZE": "8"}
    cfg = parse_args(["--job.config_file", str(path)], env=env)
    again = parse_args(["--job.config_file", write(tmp_path, to_toml(cfg))], env=env)
    again.job.config_file = cfg.job.config_file
    assert again == cfg
    cfg.moe.backend = "torch"  # the Triton backend needs a GPU or its interpreter; tested on its own
    _, _, model = build_model(cfg)
    assert all(p.device.type == "meta" for p in model.parameters())


def test_shipped_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {
        "debug_model.toml",
        "debug_dense.toml",
        "spider_1b.toml",
        "spider_1b_fp8_fsdp_ep.toml",
        "spider_1b_1gpu.toml",
    } <= names


def test_help_lists_every_key_with_its_doc():
    text = help_text()
    for section in ("job", "model", "training", "optimizer", "lr_scheduler", "parallelism", "metrics", "validation"):
        assert f"[{section}]" in text
    assert "--training.gradient_accumulation_steps" in text
    assert "Micro-batches per optimizer step" in text


def test_data_parallel_without_fsdp_is_refused():
    with pytest.raises(ConfigError, match="unsynchronised"):
        parse_args(["--parallelism.fsdp", "never"], env={"WORLD_SIZE": "2"})
    assert parse_args(["--parallelism.fsdp", "never"], env={"WORLD_SIZE": "1"})


def test_help_lists_registered_names_for_registry_keys():
    from spider_titan import registry
    from spider_titan.config.validate import REGISTRY_KEYS

    lines = help_text().splitlines()
    for dotted, kind in REGISTRY_KEYS.items():
        (line,) = [ln for ln in lines if ln.startswith(f"  --{dotted} (")]
        assert "|".join(registry.names(kind)) in line, line
    # kinds that no key names (the metric loggers) are listed too
    (line,) = [ln for ln in lines if ln.startswith("  metric_logger ")]
    assert all(name in line for name in registry.names("metric_logger"))


def _model_row(text: str, model_name: str, key: str) -> list[str]:
    """The cells of ``--model.<key>`` in the flavor table of ``model_name`` (columns are two or
    more spaces apart; a list value such as ``[1, 4]`` holds single spaces)."""
    table = text.split(f"[model] args of {model_name!r}")[1].split("\n\n")[0]
    (row,) = [ln for ln in table.splitlines() if ln.split()[:1] == [f"--model.{key}"]]
    return re.split(r"\s{2,}", row.strip())


@pytest.mark.parametrize("model_name", ["spider", "dense"])
def test_help_shows_every_model_arg_per_flavor(model_name):
    """Each arg of each registered model has one column per flavor holding the flavor's value."""
    from spider_titan import registry

    spec = registry.get("model", model_name)
    text = help_text()
    header = text.split(f"[model] args of {model_name!r}")[1].splitlines()[1].split()
    assert header == ["key", "type", *spec.flavors]
    for f in dataclasses.fields(spec.args_cls):
        cells = _model_row(text, model_name, f.name)[2:]
        shown = [tomli.loads(f"v = {cell}")["v"] for cell in cells]
        assert shown == [getattr(args, f.name) for args in spec.flavors.values()], (f.name, cells)


def test_help_after_a_config_file_shows_its_resolved_values():
    from spider_titan import registry

    path = str(REPO / "train_configs" / "debug_model.toml")
    cfg = parse_args(["--job.config_file", path], env={})
    text = help_text(["--job.config_file", path, "--model.n_loops", "3", "--help"])
    (line,) = [ln for ln in text.splitlines() if ln.startswith("  --training.steps (")]
    assert f"this config: {cfg.training.steps}" in line and cfg.training.steps != JobConfig().training.steps
    cells = _model_row(text, cfg.model.name, "n_loops")[2:]
    spec = registry.get("model", cfg.model.name)
    assert cells == [str(args.n_loops) for args in spec.flavors.values()] + ["3"]
    # a bad key does not hide the help: the problem is named and the defaults are shown
    bad = help_text(["--training.stepz", "3"])
    assert "config error" in bad and "training.stepz" in bad and "--training.steps (" in bad


def test_print_config_round_trips_and_builds_nothing(tmp_path, capsys, monkeypatch):
    from spider_titan import train
    from spider_titan.config.help import to_dict

    def no_trainer(cfg):
        raise AssertionError("--print_config must not build a Trainer")

    monkeypatch.setattr(train, "Trainer", no_trainer)
    argv = [
        "--job.config_file",
        str(REPO / "train_configs" / "debug_model.toml"),
        "--training.steps",
        "5",
        "--model.n_loops=3",
    ]
    assert train.main(argv + ["--print_config"]) == 0
    out = capsys.readouterr().out
    cfg = parse_args(argv)
    assert tomli.loads(out) == to_dict(cfg)
    again = parse_args(["--job.config_file", write(tmp_path, out)])
    again.job.config_file = cfg.job.config_file
    assert again == cfg and again.training.steps == 5 and again.model.overrides["n_loops"] == 3


def test_print_config_with_a_bad_key_is_a_one_line_config_error(capsys, monkeypatch):
    from spider_titan import train

    monkeypatch.setattr(train, "Trainer", None)
    assert train.main(["--training.stepz", "5", "--print_config"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: --training.stepz")


def test_a_config_error_is_said_once_per_node(capsys, monkeypatch):
    """Under torchrun every rank parses the same flags: local rank 0 prints the problems, the others
    of its node exit with the same status and print nothing."""
    from spider_titan import train

    for local_rank, expected in (("1", 0), ("0", 1)):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        assert train.main(["--training.stepz", "5"]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("config error: ")]
        assert len(lines) == expected, (local_rank, lines)


# ---------------------------------------------------------------- value ranges (job_config.ranged)

# One bad value per checked number field: (arguments, the key the one line must name). Each goes
# through the real command line (train.main) and must end in exit 2 with one line naming the key.
BAD_VALUES = [
    (["--training.seq_len", "0"], "training.seq_len"),
    (["--training.seq_len", "4096"], "training.seq_len"),  # > the debug flavor's max_seq_len (2048)
    (["--training.local_batch_size", "0"], "training.local_batch_size"),
    (["--training.gradient_accumulation_steps", "-1"], "training.gradient_accumulation_steps"),
    (["--training.steps", "0"], "training.steps"),
    (["--training.target_tokens", "-5"], "training.target_tokens"),
    (["--training.flops_budget", "-1e12"], "training.flops_budget"),
    (["--training.flops_budget", "1e12", "--training.target_tokens", "4096"], "training.flops_budget"),
    (["--training.max_norm", "nan"], "training.max_norm"),
    (["--training.skip_nonfinite_steps", "-1"], "training.skip_nonfinite_steps"),
    (["--training.seed", "-1"], "training.seed"),
    (["--training.seed", "8388608"], "training.seed"),  # seed << 40 no longer fits an int64 sample id
    (["--training.num_workers", "-1"], "training.num_workers"),
    (["--optimizer.lr", "-0.001"], "optimizer.lr"),
    (["--optimizer.lr", "0"], "optimizer.lr"),
    (["--optimizer.beta1", "1"], "optimizer.beta1"),
    (["--optimizer.beta2", "-0.1"], "optimizer.beta2"),
    (["--optimizer.eps", "0"], "optimizer.eps"),
    (["--optimizer.weight_decay", "-0.1"], "optimizer.weight_decay"),
    (["--optimizer.muon_lr", "inf"], "optimizer.muon_lr"),
    (["--lr_scheduler.warmup_steps", "-1"], "lr_scheduler.warmup_steps"),
    (["--lr_scheduler.warmup_start_factor", "1.5"], "lr_scheduler.warmup_start_factor"),
    (["--lr_scheduler.decay_ratio", "2"], "lr_scheduler.decay_ratio"),
    (["--lr_scheduler.min_lr_factor", "-0.5"], "lr_scheduler.min_lr_factor"),
    (["--parallelism.data_parallel_replicate_degree", "0"], "parallelism.data_parallel_replicate_degree"),
    (["--parallelism.data_parallel_shard_degree", "0"], "parallelism.data_parallel_shard_degree"),
    (["--parallelism.expert_parallel_degree", "0"], "parallelism.expert_parallel_degree"),
    (["--parallelism.fsdp_keep_core_gathered_fraction", "1.5"], "parallelism.fsdp_keep_core_gathered_fraction"),
    (["--parallelism.expert_capacity_factor", "0"], "parallelism.expert_capacity_factor"),
    (["--parallelism.expert_capacity_tokens", "-1"], "parallelism.expert_capacity_tokens"),
    (["--parallelism.expert_parallel_dispatch", "static"], "parallelism.expert_parallel_dispatch"),
    (
        ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "0"],
        "activation_checkpoint.selective_ac_option",
    ),
    (["--activation_checkpoint.memory_budget", "1.5"], "activation_checkpoint.memory_budget"),
    # the budget is the compiler's partitioner's: without compile it would do nothing
    (["--training.compile", "false", "--activation_checkpoint.mode", "memory_budget"], "activation_checkpoint.mode"),
    (["--moe.aux_loss_coeff", "-1"], "moe.aux_loss_coeff"),
    (["--moe.bias_update_rate", "-1e-3"], "moe.bias_update_rate"),
    (["--checkpoint.interval", "0"], "checkpoint.interval"),
    (["--comm.init_timeout_seconds", "0"], "comm.init_timeout_seconds"),
    (["--comm.train_timeout_seconds", "-1"], "comm.train_timeout_seconds"),
    (["--checkpoint.keep_latest_k", "-1"], "checkpoint.keep_latest_k"),
    (["--checkpoint.load_step", "-2"], "checkpoint.load_step"),
    (["--metrics.log_freq", "0"], "metrics.log_freq"),
    (["--validation.freq", "0"], "validation.freq"),
    (["--profiling.start_step", "0"], "profiling.start_step"),
    (["--profiling.active_steps", "0"], "profiling.active_steps"),
    (["--profiling.memory_snapshot_step", "-2"], "profiling.memory_snapshot_step"),
    (["--validation.steps", "-7"], "validation.steps"),
    (["--validation.steps", "0"], "validation.steps"),
    (["--calibration.steps", "0"], "calibration.steps"),
    (["--validation.local_batch_size", "-1"], "validation.local_batch_size"),
    (["--validation.ttt_max_bytes", "-1"], "validation.ttt_max_bytes"),
]
# Number fields with no Range, and why any value is meaningful (or checked elsewhere).
UNBOUNDED = {
    "training.steps": "checked with training.target_tokens (steps is ignored when target_tokens > 0)",
    "training.max_norm": "<= 0 disables clipping; only finiteness is required",
    "parallelism.data_parallel_replicate_degree": "checked against WORLD_SIZE by parallel.mesh.ParallelDims",
    "parallelism.data_parallel_shard_degree": "checked against WORLD_SIZE by parallel.mesh.ParallelDims",
    "parallelism.expert_parallel_degree": "checked against WORLD_SIZE by parallel.mesh.ParallelDims",
}


@pytest.mark.parametrize("args, key", BAD_VALUES, ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_bad_values_are_refused_with_their_key(args, key, capsys, monkeypatch):
    from spider_titan import train

    monkeypatch.setattr(train, "Trainer", None)  # refused at config time: nothing is built
    assert train.main(["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), *args]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and "Traceback" not in captured.err, captured.err
    value = args[-1]
    assert value in lines[0] or str(float(value)) in lines[0], lines[0]


def test_every_number_field_is_ranged_or_says_why_not():
    """The audit kept honest: a new int/float field declares its Range (and gets a BAD_VALUES row)
    or is listed in UNBOUNDED with the reason."""
    from spider_titan.config.parse import sections
    from spider_titan.config.validate import field_range

    tested = {key for _, key in BAD_VALUES}
    for name, cls in sections().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            dotted = f"{name}.{f.name}"
            if hints[f.name] not in (int, float):
                continue
            assert field_range(f) != Range() or dotted in UNBOUNDED, f"{dotted}: declare a Range or say why not"
            if field_range(f) != Range():
                assert dotted in tested, f"{dotted}: add a BAD_VALUES row"


def test_range_allows_and_describes():
    r = Range(low=0, high=1, high_open=True)
    assert r.allows(0) and r.allows(0.5) and not r.allows(1) and not r.allows(-1e-9) and not r.allows(float("nan"))
    assert r.describe(float) == "a finite number in [0, 1)"
    steps = Range(low=1, special=((-1, "the whole split"),))
    assert steps.allows(-1) and steps.allows(5) and not steps.allows(0) and not steps.allows(-7)
    assert steps.describe(int) == "-1 (the whole split) or an integer >= 1"
    assert Range().allows(-3) and not Range().allows(float("inf"))  # unbounded, but floats are finite


def test_seq_len_above_max_seq_len_names_both_keys_and_an_override_lifts_it():
    with pytest.raises(ConfigError) as info:
        parse_args(["--training.seq_len", "4096"], env={})
    (line,) = [p for p in info.value.problems if "seq_len" in p]
    assert "training.seq_len = 4096" in line and "model.max_seq_len = 2048" in line
    cfg = parse_args(["--training.seq_len", "4096", "--model.max_seq_len", "4096"], env={})
    assert cfg.training.seq_len == 4096


def test_help_shows_each_range():
    lines = help_text().splitlines()
    (line,) = [ln for ln in lines if ln.startswith("  --validation.steps (")]
    assert "-1 (the whole split) or >= 1" in line
    (line,) = [ln for ln in lines if ln.startswith("  --lr_scheduler.min_lr_factor (")]
    assert "in [0, 1]" in line


def test_a_config_file_that_is_not_utf8_is_one_config_error(tmp_path):
    """Found by tests/integration/test_fuzz_inputs.py: random bytes in a TOML raised UnicodeDecodeError."""
    path = tmp_path / "job.toml"
    path.write_bytes(b"[training]\nsteps = 3 # caf\xe9\n")
    with pytest.raises(ConfigError) as info:
        parse_args(["--job.config_file", str(path)], env={})
    (line,) = info.value.problems
    assert line.startswith(f"job.config_file: {str(path)!r} is not UTF-8 text (byte 26: b'\\xe9')"), line


def test_model_args_declare_ranges_as_config_fields_do():
    """Model args fields declared with ``ranged()`` are checked by the config's one range check
    (config.validate.out_of_range, run by model_args_and_problems) with the config's message."""
    from spider_titan.config.validate import out_of_range
    from spider_titan.job_config import ranged

    @dataclasses.dataclass
    class ToyArgs:
        dim: int = ranged(8, low=1)
        dropout: float = ranged(0.0, low=0, high=1, high_open=True)
        name: str = "toy"

    hints = typing.get_type_hints(ToyArgs)
    assert out_of_range("model", ToyArgs(), hints) == []
    assert out_of_range("model", ToyArgs(dim=0, dropout=1.0), hints) == [
        "model.dim = 0 is not allowed; use an integer >= 1",
        "model.dropout = 1.0 is not allowed; use a finite number in [0, 1)",
    ]


def test_steps_on_the_command_line_outrank_the_tomls_target_tokens():
    """Precedence CLI > TOML > defaults holds for the run's length too: spider_1b.toml's target_tokens
    (78,125,000 steps' worth) gave way to nothing and a --training.steps 1 run logged step 120/78125000.
    Both on the command line is a conflict, refused in one line as flops_budget with target_tokens is."""
    toml = ["--job.config_file", "train_configs/spider_1b.toml"]
    assert parse_args(toml).training.target_tokens > 0  # the TOML alone: its target_tokens decide
    cfg = parse_args([*toml, "--training.steps", "1"])
    assert (cfg.training.steps, cfg.training.target_tokens) == (1, 0)
    cfg = parse_args([*toml, "--training.target_tokens", "4096"])
    assert cfg.training.target_tokens == 4096  # the CLI's own target_tokens still decide over the TOML's steps
    with pytest.raises(ConfigError) as e:
        parse_args([*toml, "--training.steps", "1", "--training.target_tokens", "4096"])
    assert e.value.problems == [
        "--training.steps 1 and --training.target_tokens 4096 both set the run's length; keep one"
    ]


@pytest.mark.parametrize(
    "key, value, how",
    [
        ("checkpoint.folder", ".", "is the dump folder itself"),
        ("checkpoint.folder", "sub/..", "is the dump folder itself"),
        ("metrics.save_tb_folder", ".", "is the dump folder itself"),
        ("metrics.save_tb_folder", "..", "holds the dump folder"),
        ("profiling.save_traces_folder", "/", "holds the dump folder"),
        ("checkpoint.folder", "", "empty"),
    ],
)
def test_a_run_subfolder_that_is_the_dump_folder_or_around_it_is_refused(key, value, how, tmp_path):
    """``--checkpoint.folder .`` or ``--metrics.save_tb_folder .`` wrote the run's step folders or event
    files among its own, and every later start in that folder crashed: refused before anything starts."""
    with pytest.raises(ConfigError) as e:
        parse_args([f"--{key}", value, "--job.dump_folder", str(tmp_path / "run")])
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(f"{key}"), e.value.problems
    assert how in e.value.problems[0] and "name a folder of its own" in e.value.problems[0]
    assert not (tmp_path / "run").exists()
    cfg = parse_args([f"--{key}", str(tmp_path / "elsewhere"), "--job.dump_folder", str(tmp_path / "run")])
    assert cfg is not None  # an absolute folder of its own is fine
