"""The `jaxserve` CLI: options, YAML config files, one-line user errors, and both subcommands end to end
(over the fake engine, so no compilation is needed)."""

import functools
import importlib.metadata
import logging
import subprocess
import sys
import types

import pytest

from jaxserve.cli import engine_options as cli_engine
from jaxserve.cli import main as cli
from jaxserve.cli import serve as cli_serve
from jaxserve.cli.args import parse_with_config
from jaxserve.config import MeshShape
from jaxserve.engine_args import DEFAULT_COMPILATION_CACHE


def parse(argv):
    parser, subparsers = cli.build_parser()
    return parse_with_config(parser, subparsers, argv)


def run_cli(*argv):
    return subprocess.run([sys.executable, "-m", "jaxserve.cli.main", *argv], capture_output=True, text=True,
                          timeout=300)  # a hang guard: a slow CI machine loads and compiles in minutes


def user_error(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxserve: error: ")
    return lines[0]


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_of_each_subcommand(command):
    result = run_cli(command, "--help")
    assert result.returncode == 0
    for option in ("--mesh", "-tp", "--max-model-len", "--dtype", "--config"):
        assert option in result.stdout
    assert ("--api-key" in result.stdout) == (command == "serve")


def test_version_is_the_installed_distribution_s():
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout == f"jaxserve {importlib.metadata.version('jaxserve')}\n"


@pytest.mark.parametrize("level, jax_info_shown", [("info", False), ("debug", True)])
def test_jax_s_own_info_lines_only_when_debugging(monkeypatch, request, level, jax_info_shown):
    jax_logger, root = logging.getLogger("jax._src.xla_bridge"), logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # so basicConfig configures, as in a fresh process
    for logger in (root, logging.getLogger("jax")):  # restored by setLevel, which also clears logging's cache
        request.addfinalizer(functools.partial(logger.setLevel, logger.level))  # of isEnabledFor answers
    cli.configure_logging(level)
    assert logging.getLogger("jaxserve.engine").isEnabledFor(logging.INFO)
    assert jax_logger.isEnabledFor(logging.INFO) == jax_info_shown
    assert jax_logger.isEnabledFor(logging.WARNING)


def test_defaults_and_mesh_forms():
    args = parse(["serve"])
    assert (args.model, args.host, args.port, args.dtype, args.block_size) == (None, "127.0.0.1", 8000, "auto", 16)
    assert cli_engine.mesh_from_args(args) == MeshShape(1, 1)
    assert cli_engine.mesh_from_args(parse(["serve", "m", "--mesh", "8x2"])) == MeshShape(8, 2)
    assert cli_engine.mesh_from_args(parse(["serve", "-tp", "4"])) == MeshShape(4, 1)
    assert cli_engine.mesh_from_args(parse(["serve", "-tp", "2", "-pp", "3"])) == MeshShape(2, 3)


def test_config_file_values_with_command_line_winning(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("model: /models/x.gguf\nport: 9000\nmax-model-len: 1024\nserved_model_name: [a, b]\n"
                      "tensor-parallel-size: 2\n")
    args = parse(["serve", "--config", str(config), "--port", "9100"])
    assert (args.model, args.port, args.max_model_len, args.served_model_name) == ("/models/x.gguf", 9100, 1024,
                                                                                   ["a", "b"])
    assert cli_engine.mesh_from_args(args) == MeshShape(2, 1)
    assert parse(["serve", "other", "--config", str(config)]).model == "other"


@pytest.mark.parametrize("argv, expected", [
    (["serve", "--port", "http"], "--port"),
    (["serve", "--max-model-len", "0"], ">= 1"),
    (["serve", "--mesh", "8"], "TPxPP"),
    (["serve", "--dtype", "float16"], "use --dtype bfloat16"),
    (["serve", "--dtype", "float64"], "invalid choice"),
    (["serve", "--quantization", "int4"], "invalid choice"),
    (["serve", "--load-format", "pt"], "--load-format pt is not supported"),
    (["serve", "--load-format", "npcache"], "invalid choice"),
    (["serve", "--mesh", "2x1", "-pp", "2"], "not both"),
    (["serve", "./missing-model.gguf"], "missing-model.gguf does not exist"),
    (["serve", "--config", "/no/such.yaml"], "does not exist"),
    (["serve", "--gpu-memory-utilization", "1.5"], "fraction in (0, 1]"),
    (["serve", "--attention-impl", "flash"], "invalid choice"),
    (["serve", "--default-chat-template-kwargs", "{nope"], "expected a JSON object"),
    (["serve", "--default-chat-template-kwargs", "[1]"], "expected a JSON object"),
    (["generate", "--prompt", "x", "--chat-template", "missing.jinja"], "neither a readable file"),
    (["generate"], "--prompt"),
    (["serve", "--lora-modules", "sql"], "expected NAME=PATH"),
    (["serve", "--lora-modules", '{"name": "sql"}'], "expected NAME=PATH"),
    (["generate", "--prompt", "x", "--lora-modules", "a=/x", "a=/y"], "names a more than once"),
    # an adapter named as the model is served would take the model's name over (checked before loading)
    (["serve", "--served-model-name", "tiny", "--lora-modules", "tiny=/adapters/x"],
     "the LoRA adapter 'tiny' has the served model's name"),
    (["serve", "--lora-modules", "SmolLM2-135M-Instruct=/adapters/x"], "has the served model's name"),
    (["generate", "--prompt", "x", "--temperature", "-1"], "temperature"),
    (["serve", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 3}'], "method 'eagle'"),
    (["serve", "--speculative-config", '{"method": "ngram"}'], "needs num_speculative_tokens"),
    # an unknown option points at the subcommand's own --help, which lists its options
    (["serve", "--warp-speed"], "unrecognized arguments: --warp-speed; see 'jaxserve serve --help'"),
    (["check", "--mesh", "2x1", "-tp", "2"], "not both"),  # check and convert take vLLM's -tp/-pp too
    (["convert", "m", "out", "--mesh", "2x1", "-pp", "2"], "not both"),
    (["serve", "--kv-cache-memory-bytes", "lots"], "expected a whole number of bytes such as 4000000000 or 4G"),
])
def test_user_errors_are_one_line_and_exit_2(capsys, argv, expected):
    assert expected in user_error(capsys, argv)


@pytest.mark.parametrize("content, expected", [
    ("port: 9000\nwarp_speed: 9\n", "unknown key 'warp_speed'"),
    ("port: [9000\n", "not valid YAML at line 2"),
    ("max_model_len: lots\n", "max_model_len in config file"),
    ("- a list\n", "must be a mapping"),
])
def test_bad_config_files_are_one_line_errors(capsys, tmp_path, content, expected):
    config = tmp_path / "bad.yaml"
    config.write_text(content)
    assert expected in user_error(capsys, ["serve", "--config", str(config)])


def test_busy_port_is_a_user_error(capsys):
    with cli_serve.listen_socket("127.0.0.1", 0) as busy:
        port = busy.getsockname()[1]
        busy.listen()
        assert "cannot listen on 127.0.0.1" in user_error(capsys, ["serve", "--port", str(port)])


@pytest.fixture(scope="module")
def tokenizer(smol_tokenizer):
    return smol_tokenizer


def test_generate_prints_the_completion(capsys, fake_engine_module):
    assert cli.main(["generate", "--prompt", "Count:", "--max-tokens", "3", "--max-model-len", "128",
                     "-tp", "2", "--quantization", "int8", "--load-format", "dummy"]) == 0
    assert capsys.readouterr().out == " one two three\n"
    assert fake_engine_module["max_model_len"] == 128 and fake_engine_module["mesh"] == MeshShape(2, 1)
    assert fake_engine_module["model"] is None and fake_engine_module["quantization"] == "int8"
    assert fake_engine_module["load_format"] == "dummy" and fake_engine_module["async_scheduling"] is True
    assert fake_engine_module["warmup"] is False  # one prompt compiles only the step shapes it meets


def test_generate_starts_from_the_generation_config_under_its_own_flags(capsys, monkeypatch, tokenizer):
    """--override-generation-config (merged into the engine's generation_defaults) reaches `generate`'s request;
    its flags win over it; with neither, the run is greedy and 64 tokens long."""
    from jaxserve.loader.generation_config import generation_defaults
    from tests.server.fake_engine import FakeEngine

    engines = []

    def make_engine(model, **kwargs):
        engine = FakeEngine(tokenizer)
        engine.generation_defaults = generation_defaults({}, overrides=kwargs["override_generation_config"])
        engines.append(engine)
        return engine

    monkeypatch.setattr("jaxserve.engine.Engine", make_engine)
    overrides = '{"max_new_tokens": 100000, "temperature": 0.5, "top_k": 7}'
    assert cli.main(["generate", "--prompt", "Count:", "--override-generation-config", overrides]) == 0
    params = engines[-1].sampling_params["generate-0"]
    # max_new_tokens is a cap, not a length: the engine takes the room left (the fake's context is 256 tokens)
    assert (params.max_tokens, params.temperature, params.top_k) == (None, 0.5, 7)
    assert len(capsys.readouterr().out.split()) == 256 - len(tokenizer.encode("Count:"))
    assert cli.main(["generate", "--prompt", "Count:", "--override-generation-config", overrides,
                     "--max-tokens", "3", "--temperature", "0"]) == 0
    params = engines[-1].sampling_params["generate-0"]
    assert (params.max_tokens, params.temperature, params.top_k) == (3, 0.0, 7)
    assert cli.main(["generate", "--prompt", "Count:"]) == 0
    params = engines[-1].sampling_params["generate-0"]
    assert (params.max_tokens, params.temperature) == (64, 0.0)
    assert cli.main(["generate", "--prompt", "Count:", "--override-generation-config", '{"max_new_tokens": null}']) == 0
    assert engines[-1].sampling_params["generate-0"].max_tokens == 64  # a null cap is no cap


def test_vllm_engine_flags_reach_the_engine(capsys, fake_engine_module):
    assert cli.main(["generate", "--prompt", "Count:", "--max-tokens", "3"]) == 0
    defaults = dict(fake_engine_module)
    assert defaults["kv_cache_memory_fraction"] == 0.9 and defaults["enable_prefix_caching"] is True
    assert defaults["attention_impl"] == "auto" and defaults["chat_template"] is None
    assert defaults["compilation_cache_dir"] == DEFAULT_COMPILATION_CACHE  # the Engine's own default
    assert cli.main(["generate", "--prompt", "Count:", "--max-tokens", "3", "--gpu-memory-utilization", "0.5",
                     "--no-enable-prefix-caching", "--attention-impl", "reference", "--chat-template", "{{ x }}",
                     "--compilation-cache-dir", "", "--download-dir", "/models"]) == 0
    assert fake_engine_module["download_dir"] == "/models"
    assert fake_engine_module["kv_cache_memory_fraction"] == 0.5 and fake_engine_module["enable_prefix_caching"] is False
    assert fake_engine_module["attention_impl"] == "reference" and fake_engine_module["chat_template"] == "{{ x }}"
    assert fake_engine_module["compilation_cache_dir"] is None  # '' turns the cache off


def test_lora_flags_reach_the_engine(capsys, fake_engine_module):
    assert cli.main(["generate", "--prompt", "Count:", "--max-tokens", "3", "--lora-modules", "sql=/adapters/sql",
                     '{"name": "chat", "path": "/adapters/chat"}', "--max-lora-rank", "64"]) == 0
    assert fake_engine_module["lora_modules"] == {"sql": "/adapters/sql", "chat": "/adapters/chat"}
    assert fake_engine_module["max_lora_rank"] == 64 and fake_engine_module["max_loras"] == 1
    assert fake_engine_module["enable_lora"] is False  # the Engine turns LoRA on for named adapters


def test_speculative_config_reaches_the_engine_from_the_flag_or_a_yaml_mapping(tmp_path, fake_engine_module):
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    assert cli.main(["generate", "--prompt", "Count:", "--max-tokens", "3", "--speculative-config",
                     '{"method": "ngram", "num_speculative_tokens": 3}']) == 0
    assert fake_engine_module["speculative_config"] == ngram
    config = tmp_path / "spec.yaml"
    config.write_text("speculative_config:\n  method: ngram\n  num_speculative_tokens: 3\n")
    assert cli.main(["generate", "--prompt", "Count:", "--max-tokens", "3", "--config", str(config)]) == 0
    assert fake_engine_module["speculative_config"] == ngram


def test_serve_logs_model_mesh_kv_capacity_and_url(fake_engine_module, caplog, monkeypatch):
    import uvicorn

    started = {}
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets: started.update(
        app=server.config.app, port=sockets[0].getsockname()[1]))
    caplog.set_level("INFO", logger="jaxserve")
    assert cli.main(["serve", "--port", "0", "--served-model-name", "smol", "--api-key", "k",
                     "--default-chat-template-kwargs", '{"enable_thinking": false}']) == 0
    log = caplog.text
    port = started["port"]
    assert "model fake-model served as smol" in log and "mesh 1x1" in log
    assert "KV cache: 64 blocks x 16 tokens = 1024 tokens" in log
    assert f"http://127.0.0.1:{port}" in log
    state = started["app"].state.server
    assert state.served_model_names == ["smol"] and key_required(started["app"], "k")
    assert state.default_chat_template_kwargs == {"enable_thinking": False}
    state.engine.shutdown()
    assert not state.runtime_lora_updating and fake_engine_module["enable_lora"] is False
    assert cli.main(["serve", "--port", "0", "--enable-runtime-lora-updating"]) == 0
    state = started["app"].state.server
    assert state.runtime_lora_updating and fake_engine_module["enable_lora"] is True  # implied: adapters need slots
    assert "LoRA adapters may be loaded and unloaded over HTTP" in caplog.text
    state.engine.shutdown()


def key_required(app, key: str) -> bool:
    """Whether `app` refuses /v1/models without `key` and answers it with."""
    from starlette.testclient import TestClient

    client = TestClient(app)  # not entered: no lifespan, so the engine is not shut down
    without, with_key = client.get("/v1/models"), client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    return without.status_code == 401 and with_key.status_code == 200


# --- with the real default model (a few seconds each: loading, first compile) -------------------------------
@pytest.mark.xla_optimised  # the real model
def test_generate_with_the_default_model():
    result = run_cli("generate", "--prompt", "What is 2+2?", "--chat", "--max-tokens", "6", "--max-model-len", "256",
                     "--num-kv-blocks", "32", "--log-level", "warning")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_engine_refusal_is_a_one_line_error():
    result = run_cli("serve", "--max-model-len", "10000000", "--port", "0")
    assert result.returncode == 2
    error_lines = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert error_lines == [error_lines[0]] and error_lines[0].startswith("jaxserve: error: max_model_len=10000000")
    assert "Traceback" not in result.stderr


def test_ray_followers_get_the_arguments_main_was_called_with(monkeypatch):
    """Not sys.argv: `main(argv)` called in-process (tests, embedding) must forward its own argv. Ray itself is
    stubbed: the test follows the arguments from `cli.main` through `launch_followers` to each actor's run()."""
    from jaxserve.cli import ray as ray_launcher

    started = []

    class Actor:
        run = types.SimpleNamespace(remote=started.append)

    class ActorClass:
        def options(self, **_):
            return types.SimpleNamespace(remote=Actor)

    fake_ray = types.SimpleNamespace(
        util=types.SimpleNamespace(get_node_ip_address=lambda: "10.0.0.1", scheduling_strategies=types.SimpleNamespace(
            PlacementGroupSchedulingStrategy=lambda **_: None)),
        nodes=lambda: [], remote=lambda cls: ActorClass())
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    monkeypatch.setattr(ray_launcher, "_connect", lambda ray: None)
    monkeypatch.setattr(ray_launcher, "_follower_bundle", lambda ray, host: {})
    monkeypatch.setattr(ray_launcher, "_reserve", lambda *a: (types.SimpleNamespace(bundle_specs=[{}] * 3), 0))

    def fake_start_cluster(args, mesh):
        ray_launcher.launch_followers(args)
        raise cli.UserError("stop here")

    monkeypatch.setattr(cli_engine, "start_cluster", fake_start_cluster)  # where build_engine looks it up
    monkeypatch.setattr(sys, "argv", ["jaxserve", "something", "else"])
    argv = ["generate", "--prompt", "x", "--mesh", "2x2", "--distributed-executor-backend", "ray",
            "--num-processes", "3", "--coordinator", "10.0.0.1:8476"]
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2  # the stub's UserError: the real join (which waits for followers) never ran
    assert [a[: len(argv)] for a in started] == [argv, argv]
    assert [a[a.index("--process-id") + 1] for a in started] == ["1", "2"]
