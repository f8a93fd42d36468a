"""Command lines and config files written for `vllm serve` start jaxserve unchanged: vLLM's spellings
(`--model`, `--max_model_len`, `32k`), its aliases in YAML, several API keys or VLLM_API_KEY, and its options that
mean nothing under JAX (accepted with a warning naming why); what cannot be honoured is a one-line refusal."""

import logging
import os

import pytest

from jaxserve.cli import main as cli
from jaxserve.cli import serve as cli_serve
from jaxserve.cli.args import token_count
from jaxserve.cli.compat import check_vllm_options, modality_limits, normalize_option_spelling
from jaxserve.config import resolve_dtype
from tests.test_cli import key_required, parse, user_error


def generate(*flags):
    return cli.main(["generate", "--prompt", "Count:", "--max-tokens", "2", *flags])


def test_model_as_an_option_and_underscore_spellings_reach_the_engine(capsys, fake_engine_module):
    assert generate("--model", "org/model", "--max_model_len=8k", "--max_num_batched_tokens", "1K",
                    "--num-gpu-blocks-override", "40", "--dtype", "float") == 0
    built = fake_engine_module
    assert (built["model"], built["max_model_len"], built["max_num_batched_tokens"]) == ("org/model", 8000, 1024)
    assert built["num_kv_blocks"] == 40 and built["dtype"] == "float"
    assert generate("org/model", "--model", "org/model") == 0  # the same model twice is no conflict
    assert "given twice" in user_error(capsys, ["generate", "--prompt", "x", "org/a", "--model", "org/b"])


def test_model_option_overrides_a_config_files_model(tmp_path, fake_engine_module):
    config = tmp_path / "job.yaml"
    config.write_text("model: org/from-file\n")
    assert generate("--config", str(config), "--model", "org/from-flag") == 0
    assert fake_engine_module["model"] == "org/from-flag"
    assert generate("--config", str(config)) == 0
    assert fake_engine_module["model"] == "org/from-file"


@pytest.mark.parametrize("option", ["--api-key", "--served-model-name"])
def test_a_model_after_several_values_is_refused_not_taken_for_one(capsys, option):
    """vLLM's --api-key takes several keys: `--api-key KEY org/model` would serve the default model with the model's
    name as a second valid key (--served-model-name NAME org/model: the default model under both names)."""
    error = user_error(capsys, ["serve", option, "k", "org/model", "--port", "0"])
    assert f"'org/model' is the model, put it before {option}" in error
    dest = option.removeprefix("--").replace("-", "_")
    assert getattr(parse(["serve", "org/model", option, "k1", "k2"]), dest) == ["k1", "k2"]


def test_underscores_are_rewritten_in_option_names_only():
    assert normalize_option_spelling(["serve", "my_model", "--served_model_name", "a_b", "--max_model_len=4_000",
                                      "--", "--x_y"]) == [
        "serve", "my_model", "--served-model-name", "a_b", "--max-model-len=4_000", "--", "--x_y"]


@pytest.mark.parametrize("text, tokens", [("32k", 32_000), ("32K", 32_768), ("1.5k", 1_500), ("1.5K", 1_536),
                                          ("2m", 2_000_000), ("4096", 4096), ("auto", None), ("-1", None)])
def test_token_counts_read_vllms_suffixes(text, tokens):
    assert token_count(text) == tokens


@pytest.mark.parametrize("argv, expected", [
    (["serve", "--max-model-len", "1.0001k"], "not a whole number"),
    (["serve", "--max-model-len", "0k"], "not a whole number"),
    (["serve", "--max-model-len", "lots"], "expected a whole number"),
    (["serve", "--kv-cache-dtype", "fp4"], "argument --kv-cache-dtype: invalid choice: 'fp4'"),
    (["serve", "--tokenizer-mode", "mistral"], "--tokenizer-mode mistral is not supported"),
    (["serve", "--dtype", "half"], "use --dtype bfloat16"),
    (["serve", "--task", "reward"], "--task reward is not supported: reward models' per-token scores are not served"),
    (["serve", "--limit-mm-per-prompt", "image"], "expected JSON such as '{\"image\": 0}' or image=0,video=0"),
    (["serve", "--cpu-offload-gb", "4"], "--cpu-offload-gb=4.0 is not supported: weights stay in device memory"),
    (["serve", "--disable-sliding-window"], "--disable-sliding-window is not supported: jaxserve always attends"),
    (["serve", "--max-logprobs", "-1"], "max_logprobs -1 (vLLM's 'no cap') is not supported: the compiled sampler"),
])
def test_what_cannot_be_honoured_is_refused_in_one_line(capsys, argv, expected):
    assert expected in user_error(capsys, argv)


def test_options_without_effect_are_accepted_with_a_warning_each(capsys, caplog, fake_engine_module):
    caplog.set_level(logging.WARNING, logger="jaxserve.cli.main")
    assert generate("--enforce-eager", "--trust-remote-code", "--swap-space", "4", "--no-enable-chunked-prefill",
                    "--disable-custom-all-reduce", "--max-seq-len-to-capture", "8192", "--kv-cache-dtype", "auto",
                    "--load-format", "safetensors", "--tokenizer-mode", "auto", "--task", "embed", "--runner",
                    "pooling", "--limit-mm-per-prompt", '{"image": 0}', "-O", "3", "--disable-log-stats",
                    "--scheduling-policy", "priority", "--structured-outputs-config", '{"backend": "xgrammar"}',
                    "--tokenizer-pool-size", "0", "--num-scheduler-steps", "8", "--disable-async-output-proc",
                    "--preemption-mode", "swap", "--model-impl", "vllm", "--max-cpu-loras", "4",
                    "--prefix-caching-hash-algo", "sha256", "--enable-sleep-mode", "--cpu-offload-gb", "0",
                    "--max-model-len", "auto") == 0
    warned = [record.getMessage().split(" has no effect")[0] for record in caplog.records]
    assert warned == ["--enforce-eager", "--max-seq-len-to-capture", "--compilation-config", "--swap-space",
                      "--disable-custom-all-reduce",
                      "--trust-remote-code", "--no-enable-chunked-prefill", "--task", "--runner",
                      "--limit-mm-per-prompt", "--scheduling-policy", "--structured-outputs-config",
                      "--tokenizer-pool-size", "--num-scheduler-steps", "--disable-async-output-proc",
                      "--preemption-mode", "--model-impl", "--max-cpu-loras", "--prefix-caching-hash-algo",
                      "--enable-sleep-mode"]  # not --disable-log-stats: generate logs none, as asked; nor a 0 offload
    assert fake_engine_module["max_model_len"] is None  # auto: the model's own, as the cache allows
    assert fake_engine_module["load_format"] == "auto"  # the loader reads whichever format the model has
    assert fake_engine_module["kv_cache_dtype"] == "auto"
    caplog.clear()
    assert generate() == 0
    assert caplog.records == []  # nothing given, nothing warned


def test_both_spellings_of_the_modality_limits_are_read():
    assert modality_limits('{"image": 0}') == {"image": 0}
    assert modality_limits("image=2, video=1") == {"image": 2, "video": 1}  # vLLM's older form


def test_an_fp8_kv_cache_reaches_the_engine(fake_engine_module):
    assert generate("--kv-cache-dtype", "fp8_e5m2") == 0
    assert fake_engine_module["kv_cache_dtype"] == "fp8_e5m2"


def test_async_scheduling_has_both_spellings():
    assert parse(["serve", "--async-scheduling"]).no_async_scheduling is False
    assert parse(["serve", "--no-async-scheduling"]).no_async_scheduling is True


def test_config_file_keys_may_be_any_option_spelling(tmp_path):
    config = tmp_path / "vllm.yaml"
    config.write_text("enable-log-requests: true\nno-enable-prefix-caching: true\nasync-scheduling: false\n"
                      "api-key: [k1, k2]\nlora-modules:\n  - {name: sql, path: /adapters/sql}\n"
                      "  - chat=/adapters/chat\n"
                      "max-model-len: 32k\nnum-gpu-blocks-override: 12\nuvicorn-log-level: debug\n")
    args = parse(["serve", "--config", str(config)])
    assert args.log_prompts is True and args.enable_prefix_caching is False and args.no_async_scheduling is True
    assert args.api_key == ["k1", "k2"] and args.max_model_len == 32_000 and args.num_kv_blocks == 12
    assert args.lora_modules == [("sql", "/adapters/sql"), ("chat", "/adapters/chat")]
    assert args.uvicorn_log_level == "debug"
    config.write_text("enable-prefix-caching: false\nasync-scheduling: true\n")
    args = parse(["serve", "--config", str(config)])
    assert args.enable_prefix_caching is False and args.no_async_scheduling is False
    config.write_text("no-async-scheduling: true\nmodel: org/m\n")
    args = parse(["serve", "--config", str(config)])
    assert args.no_async_scheduling is True and args.model == "org/m"


def test_serve_takes_several_keys_or_vllms_variable(fake_engine_module, monkeypatch):
    import uvicorn

    started = {}
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets: started.update(app=server.config.app))
    for variable in cli_serve.API_KEY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)

    def keys_opening(*flags):
        assert cli.main(["serve", "--port", "0", *flags]) == 0
        app = started["app"]
        app.state.server.engine.shutdown()
        return [key for key in ("k1", "k2", "k3", "from-env") if key_required(app, key)]

    assert keys_opening("--api-key", "k1", "--api-key", "k2", "--vllm-metric-names") == ["k1", "k2"]
    from starlette.testclient import TestClient

    assert "\nvllm:num_requests_waiting{" in TestClient(started["app"]).get("/metrics").text
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert keys_opening() == ["from-env"]
    assert keys_opening("--api-key", "k3") == ["k3"]  # the flag wins
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert keys_opening() == []  # an empty variable is no key: the API is open


def test_float_is_float32_everywhere():
    assert resolve_dtype("float", "gpu") == "float32"


def test_server_options_without_effect_are_warned_about(caplog):
    caplog.set_level(logging.WARNING, logger="jaxserve.cli.main")
    check_vllm_options(parse(["serve", "--disable-fastapi-docs", "--disable-frontend-multiprocessing",
                              "--api-server-count", "4", "--enable-server-load-tracking", "--data-parallel-backend",
                              "ray"]))
    # --disable-fastapi-docs does what vLLM's does (tests/server/test_security.py)
    assert [record.getMessage().split(" has no effect")[0] for record in caplog.records] == [
        "--disable-frontend-multiprocessing", "--api-server-count", "--enable-server-load-tracking",
        "--data-parallel-backend"]
    assert parse(["serve", "--max-log-len", "64"]).max_log_len == 64


def test_hf_token_reaches_hub_downloads(fake_engine_module, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "")  # monkeypatch restores the variable as it was: the command sets it
    monkeypatch.delenv("HF_TOKEN")
    assert generate("--hf-token") == 0  # no value: the stored login, as before
    assert "HF_TOKEN" not in os.environ
    assert generate("--hf-token", "hf_abc") == 0
    assert os.environ["HF_TOKEN"] == "hf_abc"


def test_kv_scales_are_refused_in_one_line(capsys):
    assert "--calculate-kv-scales is not supported" in user_error(
        capsys, ["serve", "--kv-cache-dtype", "fp8", "--calculate-kv-scales"])
