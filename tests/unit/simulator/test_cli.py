"""The simulator's command line: every parameter is a flag, presets, overrides."""

from __future__ import annotations

import pytest

from tests.simulator.__main__ import _parser, parse_config, slow_overrides
from tests.simulator.config import H100_8B_NUM_GPU_BLOCKS, SimulatorConfig


def test_no_flags_give_the_fast_defaults() -> None:
    assert parse_config([]) == SimulatorConfig()


def test_preset_gives_h100_timings() -> None:
    config = parse_config(["--preset", "h100-8b"])
    assert config == SimulatorConfig.h100_8b()
    assert config.prefill_overhead == pytest.approx(0.030)
    assert config.prefill_per_token == pytest.approx(0.00025)
    assert config.itl == pytest.approx(0.012)
    assert config.num_gpu_blocks == H100_8B_NUM_GPU_BLOCKS
    assert config.max_model_len == 131_072
    assert config.time_scale == 1.0


def test_flags_override_the_preset() -> None:
    config = parse_config(
        [
            "--preset", "h100-8b",
            "--time-scale", "0.01",
            "--prefill-overhead-ms", "50",
            "--prefill-per-token-ms", "0.5",
            "--itl-ms", "20",
            "--load-alpha", "3",
            "--num-gpu-blocks", "1024",
            "--block-size", "32",
            "--max-num-seqs", "64",
            "--max-loras", "4",
            "--lora", "sql", "--lora", "tweet",
            "--model", "base", "--model", "alias",
            "--default-max-tokens", "100",
            "--enable-prompt-tokens-details",
        ]
    )  # fmt: skip
    assert config.time_scale == pytest.approx(0.01)
    assert config.prefill_overhead == pytest.approx(0.050)
    assert config.prefill_per_token == pytest.approx(0.0005)
    assert config.itl == pytest.approx(0.020)
    assert config.load_alpha == 3.0
    assert (config.num_gpu_blocks, config.block_size) == (1024, 32)
    assert config.max_model_len == 1024 * 32  # the preset's 128k no longer fits
    assert (config.max_num_seqs, config.max_loras) == (64, 4)
    assert config.lora_adapters == ("sql", "tweet")
    assert config.served_model_names == ("base", "alias")
    assert config.default_max_tokens == 100
    assert config.enable_prompt_tokens_details is True


def test_earlier_flags_in_seconds_still_work() -> None:
    config = parse_config(["--ttft", "0.5", "--itl", "0.25", "--max-model-len", "100"])
    assert config.prefill_overhead == 0.5
    assert config.itl == 0.25
    assert config.max_model_len == 100


def test_slow_instances_are_the_first_ones_slowed_down() -> None:
    args = _parser().parse_args(
        ["--instances", "4", "--preset", "h100-8b", "--slow-instances", "1", "--slowdown", "3"]
    )
    config = parse_config(["--preset", "h100-8b"])
    overrides = slow_overrides(args, config)
    assert list(overrides) == [0]
    assert overrides[0].prefill_per_token == pytest.approx(3 * config.prefill_per_token)
    assert overrides[0].itl == pytest.approx(3 * config.itl)
    assert overrides[0].num_gpu_blocks == config.num_gpu_blocks


@pytest.mark.parametrize(
    "argv",
    [["--instances", "2", "--slow-instances", "3"], ["--slow-instances", "1", "--slowdown", "0"]],
)
def test_bad_slow_instances_are_refused(argv: list[str]) -> None:
    args = _parser().parse_args(argv)
    with pytest.raises(ValueError, match="slow"):
        slow_overrides(args, SimulatorConfig())


@pytest.mark.parametrize(
    "argv",
    [
        ["--preset", "a100"],
        ["--time-scale", "-1"],
        ["--num-gpu-blocks", "0"],
        ["--num-gpu-blocks", "2", "--max-model-len", "64"],
    ],
)
def test_bad_values_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err
