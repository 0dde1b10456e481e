"""The flag table: the charts' argument lists, the reference's zap and deprecated flags, the
one-line errors, ``--help`` and ``docs/flags.md``."""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web

from adapters.prometheus.scrape import MetricsDataSource
from app.cli import parse_settings
from app.config.loader import load_config
from app.config.overrides import ConfigOverrides
from app.flags import FLAGS, build_parser, render_markdown, startup_notices
from app.logsetup import JsonFormatter, LogOptions, TextFormatter
from app.plugins import build_registry
from domain.datalayer.plugins.core_metrics_extractor import CoreMetricsExtractor
from ports.datalayer import MetricsText
from ports.endpoints import EndpointAddress, EndpointInfo
from tests.support.charts import (
    GIE_DEFAULT_PLUGINS,
    LLMD_DEFAULT_PLUGINS,
    LLMD_PAYLOAD_AGNOSTIC,
    ChartPod,
    gie_args,
    llmd_args,
)
from tests.support.scheduling import endpoint, plugin_handle

ROOT = Path(__file__).resolve().parents[2]
GIE_CONFIGS = {"default-plugins.yaml": GIE_DEFAULT_PLUGINS}
LLMD_CONFIGS = {
    "default-plugins.yaml": LLMD_DEFAULT_PLUGINS,
    "payload-agnostic.yaml": LLMD_PAYLOAD_AGNOSTIC,
}


@pytest.fixture(autouse=True)
def _no_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NAMESPACE", raising=False)


def chart(args: list[str], tmp_path: Path) -> list[str]:
    """``args`` as the pod runs them, with the chart's config files written (each chart's
    own ``default-plugins.yaml``: the llm-d chart's passes ``--grpc-health-port``)."""
    configs = LLMD_CONFIGS if "--grpc-health-port" in args else GIE_CONFIGS
    return ChartPod(args=args, configs=configs, config_dir=tmp_path / "config").command_args()


# -- what the charts pass ----------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        gie_args(),
        gie_args(replicas=3, tracing=True),
        gie_args(engine="sglang"),
        gie_args(engine="triton-tensorrt-llm"),
        gie_args(engine="trtllm-serve", metrics_auth=False),
        llmd_args(),
        llmd_args(replicas=3, tracing=True, plugins_file="payload-agnostic.yaml"),
        llmd_args(
            flags=[("v", "2"), ("drain-timeout", "15s"), ("enable-grpc-stream-metrics", "true")]
        ),
    ],
    ids=[
        "reference",
        "reference-3-replicas-tracing",
        "reference-sglang",
        "reference-triton",
        "reference-trtllm-serve",
        "llm-d",
        "llm-d-3-replicas-tracing-payload-agnostic",
        "llm-d-flags",
    ],
)
def test_every_chart_argument_list_starts(args: list[str], tmp_path: Path) -> None:
    settings = parse_settings(chart(args, tmp_path))
    assert settings.pool_name == "vllm-qwen"
    assert settings.pool_namespace == "default"
    assert settings.log_format == "json"  # --zap-encoder json
    assert settings.tracing is ("--tracing=true" in args)
    assert settings.ha_enable_leader_election is ("--ha-enable-leader-election" in args)
    assert settings.config_file is not None
    assert settings.config_file.is_file()


def test_the_chart_values_mean_what_they_mean_there(tmp_path: Path) -> None:
    sglang = parse_settings(chart(gie_args(engine="sglang"), tmp_path)).legacy_metrics
    # the chart's quotes are part of the rendered argument; the spec is what is inside
    assert sglang.queued_requests_spec == "sglang:num_queue_reqs"
    assert sglang.cache_info_spec == "sglang:cache_config_info"
    triton = parse_settings(chart(gie_args(engine="triton-tensorrt-llm"), tmp_path))
    assert triton.legacy_metrics.kv_usage_spec == (
        "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=fraction}"
    )
    assert triton.legacy_metrics.lora_spec == ""  # the chart turns LoRA scraping off
    trtllm = parse_settings(chart(gie_args(engine="trtllm-serve"), tmp_path)).legacy_metrics
    assert trtllm.path == "/prometheus/metrics"
    flagged = parse_settings(
        chart(llmd_args(flags=[("drain-timeout", "15s"), ("v", "4")]), tmp_path)
    )
    assert flagged.drain_timeout == pytest.approx(15.0)
    assert LogOptions.from_settings(flagged).level == logging.DEBUG


# -- the zap logging flags -------------------------------------------------------------------

POOL = ["--pool-name", "pool"]


@pytest.mark.parametrize(
    ("argv", "level", "log_format"),
    [
        ([], logging.INFO, "text"),
        (["-v", "4"], logging.DEBUG, "text"),
        (["--zap-encoder", "json"], logging.INFO, "json"),
        (["--zap-encoder=console", "--log-format=json"], logging.INFO, "json"),  # last wins
        (["--log-format=json", "--zap-encoder=console"], logging.INFO, "text"),
        (["--zap-log-level", "debug"], logging.DEBUG, "text"),
        (["--zap-log-level=error", "-v", "5"], logging.ERROR, "text"),  # wins over -v
        (["--zap-log-level", "panic"], logging.CRITICAL, "text"),
        (["--zap-log-level", "3"], logging.DEBUG, "text"),  # an integer is a verbosity
        (["--zap-log-level", "2"], logging.INFO, "text"),
    ],
)
def test_zap_flags_set_the_level_and_format(argv: list[str], level: int, log_format: str) -> None:
    options = LogOptions.from_settings(parse_settings([*POOL, *argv]))
    assert (options.level, options.format) == (level, log_format)


def _record(level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord("epp.test", level, __file__, 1, "hello", None, None)


def test_the_time_encoding_is_zaps() -> None:
    record = _record()
    record.created = 1764355261.25
    encoded = {
        name: json.loads(JsonFormatter(LogOptions(time_encoding=name)).format(record))["ts"]
        for name in ("epoch", "millis", "nano", "iso8601", "rfc3339", "rfc3339nano")
    }
    assert encoded == {
        "epoch": 1764355261.25,
        "millis": 1764355261250.0,
        "nano": 1764355261250000000,
        "iso8601": "2025-11-28T18:41:01.250Z",
        "rfc3339": "2025-11-28T18:41:01Z",
        "rfc3339nano": "2025-11-28T18:41:01.25Z",
    }
    text = TextFormatter(LogOptions(time_encoding="epoch")).format(record)
    assert text.startswith("1764355261.25 WARNING epp.test: hello")


def test_zap_devel_puts_the_stack_on_warnings_and_the_stacktrace_level_moves_it() -> None:
    def lines(argv: list[str], level: int) -> dict[str, object]:
        options = LogOptions.from_settings(parse_settings([*POOL, "--zap-encoder=json", *argv]))
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        handler.setFormatter(JsonFormatter(options))
        logger = logging.getLogger("epp.test.stack")
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
        try:
            logger.log(level, "something")
        finally:
            logger.removeHandler(handler)
        line: dict[str, object] = json.loads(stream.getvalue())
        return line

    assert "stacktrace" not in lines([], logging.ERROR)
    devel = lines(["--zap-devel"], logging.WARNING)
    assert "test_flags.py" in str(devel["stacktrace"])  # where it was logged
    assert "stacktrace" not in lines(["--zap-devel"], logging.INFO)
    assert "stacktrace" not in lines(["--zap-devel", "--zap-stacktrace-level=error"], 30)
    assert "stacktrace" in lines(["--zap-stacktrace-level=error"], logging.ERROR)


# -- deprecated and ignored flags ------------------------------------------------------------


def test_a_deprecated_flag_warns_once_naming_its_replacement() -> None:
    settings = parse_settings([*POOL, "--model-server-metrics-path", "/prometheus/metrics"])
    assert startup_notices(settings) == [
        (
            logging.WARNING,
            "flag --model-server-metrics-path is deprecated: use the metrics-data-source's "
            "parameters in the EndpointPickerConfig (path); applied: '/prometheus/metrics'",
        )
    ]
    assert startup_notices(parse_settings(POOL)) == []


def test_a_flag_that_cannot_apply_is_logged_as_ignored() -> None:
    settings = parse_settings([*POOL, "--allow-experimental-plugins"])
    ((level, message),) = startup_notices(settings)
    assert level == logging.INFO
    assert message.startswith("flag --allow-experimental-plugins accepted and ignored: ")


def test_feature_gates_from_the_flag_turn_gates_on_and_off() -> None:
    settings = parse_settings([*POOL, "--feature-gates", "flowControl=true,somethingNew"])
    assert settings.feature_gates == (("flowControl", True), ("somethingNew", True))
    notices = [m for _, m in startup_notices(settings)]
    assert notices[0] == "flag --feature-gates: applied flowControl=true"
    assert notices[1].startswith("flag --feature-gates: accepted and ignored somethingNew:")
    registry = build_registry()
    on = load_config(
        None,
        registry=registry,
        handle=plugin_handle(),
        overrides=ConfigOverrides.from_settings(settings),
    )
    assert "flowControl" in on.feature_gates
    assert on.flow_control is not None
    off = ConfigOverrides(gates={"flowControl": False})
    gated = "featureGates: [flowControl]\n"
    loaded = load_config(gated, registry=registry, handle=plugin_handle(), overrides=off)
    assert loaded.flow_control is None


SGLANG_BODY = """\
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 7
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 3
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.5
"""


def test_the_old_metric_flags_change_what_the_default_engine_reads(tmp_path: Path) -> None:
    """The reference's chart passes SGLang's metric names as flags: with the vLLM engine
    (no defaultEngine in the config), the flags alone make the EPP read SGLang's metrics."""
    settings = parse_settings(chart(gie_args(engine="sglang"), tmp_path))
    loaded = load_config(
        GIE_DEFAULT_PLUGINS,
        registry=build_registry(),
        handle=plugin_handle(),
        overrides=ConfigOverrides.from_settings(settings),
    )
    extractor = loaded.plugins["core-metrics-extractor"]
    assert isinstance(extractor, CoreMetricsExtractor)
    pod = endpoint("pod-a")
    extractor.extract(MetricsText(body=SGLANG_BODY.encode(), fetched_at=0.0), pod, 1.0)
    assert pod.metrics is not None
    assert (pod.metrics.waiting_queue_size, pod.metrics.running_requests_size) == (7, 3)
    assert pod.metrics.kv_cache_usage_percent == pytest.approx(0.5)


async def test_the_old_metrics_path_flag_wins_over_the_charts_config(tmp_path: Path) -> None:
    """The chart renders ``path: "/metrics"`` into the config and passes
    ``--model-server-metrics-path="/prometheus/metrics"`` for trtllm-serve: the flag wins,
    and the EPP scrapes a model server that serves its metrics only there."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="trtllm_num_requests_waiting 4\n")

    app = web.Application()
    app.router.add_get("/prometheus/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    settings = parse_settings(chart(gie_args(engine="trtllm-serve"), tmp_path))
    loaded = load_config(
        GIE_DEFAULT_PLUGINS,
        registry=build_registry(),
        handle=plugin_handle(),
        overrides=ConfigOverrides.from_settings(settings),
    )
    source = loaded.plugins["metrics-data-source"]
    assert isinstance(source, MetricsDataSource)
    try:
        scraped = await source.poll(
            EndpointInfo(name="pod-a", address=EndpointAddress(ip="127.0.0.1", port=port))
        )
        assert scraped.body == b"trtllm_num_requests_waiting 4\n"
    finally:
        await source.close()
        await runner.cleanup()


# -- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["--zap-encoder", "xml"],
            "epp: --zap-encoder: 'xml' is not a zap encoder (json or console)",
        ),
        (["--no-such-flag"], "epp: unknown flag --no-such-flag (epp --help lists the flags)"),
        (
            ["--grpc-max-recv-msg-size", "lots"],
            "epp: --grpc-max-recv-msg-size: 'lots' is not a size in bytes (e.g. 16Mi, 16MiB, "
            "25MB, 4194304)",
        ),
        (
            ["--total-queued-requests-metric", "a{b"],
            "epp: --total-queued-requests-metric: 'a{b' is not a metric spec",
        ),
    ],
)
def test_a_bad_flag_is_one_line_naming_the_flag_and_value(argv: list[str], line: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "app", *POOL, *argv], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stdout == ""
    (printed,) = done.stderr.splitlines()
    assert printed.startswith(line)


@pytest.mark.parametrize(
    ("text", "size"),
    [("4194304", 4194304), ("16Mi", 16 << 20), ("10MiB", 10 << 20), ("25MB", 25_000_000)],
)
def test_message_sizes_take_quantities(text: str, size: int) -> None:
    assert parse_settings([*POOL, "--grpc-max-recv-msg-size", text]).grpc_max_recv_msg_size == size


def test_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "app", "--version"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0
    assert re.fullmatch(r"epp \d+\.\d+\.\d+\S*\n", done.stdout)


# -- the help and the reference -------------------------------------------------------------


def test_help_is_grouped_and_lists_every_flag_of_the_table() -> None:
    help_text = build_parser().format_help()
    listed = set(re.findall(r"^\s{2}(-{1,2}[a-z][a-z0-9-]*)", help_text, re.MULTILINE))
    listed |= set(re.findall(r"^\s{2}-v N, (--v)\b", help_text, re.MULTILINE))
    table = {name for flag in FLAGS for name in flag.names}
    assert listed == table | {"-h", "--version"}
    headings = re.findall(r"^([a-z ]+):$", help_text, re.MULTILINE)
    assert headings == [
        "options",
        "serving",
        "discovery",
        "scheduling and data",
        "shared state",
        "workers",
        "observability",
        "security",
        "compatibility",
    ]


def test_docs_flags_md_is_the_generated_reference() -> None:
    """Regenerate with ``.venv/bin/python -m app.flags > docs/flags.md``."""
    assert (ROOT / "docs" / "flags.md").read_text() == render_markdown()


def test_every_flag_either_chart_passes_is_in_the_table() -> None:
    names = {name for flag in FLAGS for name in flag.names}
    passed: set[str] = set()
    for args in (
        gie_args(replicas=3, tracing=True, metrics_auth=False),
        *(gie_args(engine=e) for e in ("sglang", "triton-tensorrt-llm", "trtllm-serve")),
        llmd_args(replicas=3, tracing=True, metrics_auth=False),
    ):
        passed |= {a.split("=", 1)[0] for a in args if a.startswith("--")}
    assert passed <= names
    assert passed == {
        "--pool-name",
        "--pool-namespace",
        "--pool-group",
        "--zap-encoder",
        "--config-file",
        "--ha-enable-leader-election",
        "--grpc-health-port",
        "--tracing",
        "--metrics-endpoint-auth",
        "--total-queued-requests-metric",
        "--total-running-requests-metric",
        "--kv-cache-usage-percentage-metric",
        "--cache-info-metric",
        "--lora-info-metric",
        "--model-server-metrics-path",
    }
