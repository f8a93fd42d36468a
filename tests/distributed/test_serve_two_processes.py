"""Two processes x 4 fake CPU devices (gloo) serving one 4x2 mesh, process 0 over HTTP: the same greedy text as
one process; each restores only its own shards of a converted checkpoint; SIGTERM anywhere ends both; a killed
process ends the other within a bound, named; pods of a Kubernetes LeaderWorkerSet join from its variables alone."""

import json
import re
import signal
import threading

import httpx

from jaxserve.cli import main as cli
from tests.distributed.procs import (
    PROMPTS,
    SMALL_ENGINE,
    SMALL_STEPS,
    cluster_args,
    complete,
    free_port,
    free_port_pair,
    reference_texts,
)

# Layers outweigh the (tied) embedding, so reading only one stage's layers is visible in the bytes read.
LAYER_HEAVY = {"intermediate_size": 8192, "num_hidden_layers": 4, "tie_word_embeddings": True}
EXIT_BOUND = 30  # seconds: a lost peer is seen at once (EOF); this is the slack for a loaded CI machine


def start_pair(processes, model, http_port, *extra):
    port = free_port_pair()
    for pid in (0, 1):
        processes.start(f"p{pid}", ["serve", model, "--mesh", "4x2", "--port", str(http_port), *SMALL_ENGINE,
                                    *cluster_args(port, 2, pid), *extra])
    return processes.wait_healthy(http_port)


def restore_line(log: str) -> tuple[int, int, int]:
    m = re.search(r"read (\d+) bytes for its own shards' (\d+) bytes, of the checkpoint's (\d+)", log)
    assert m, log[-2000:]
    return tuple(int(g) for g in m.groups())


def test_converted_checkpoint_served_by_two_processes_matches_one_process(processes, tiny_checkpoint, tmp_path):
    model = str(tiny_checkpoint("llama", **LAYER_HEAVY))
    converted = str(tmp_path / "converted")
    assert cli.main(["convert", model, converted, "--mesh", "4x2", "--dtype", "float32"]) == 0
    url = start_pair(processes, converted, free_port())
    expected = reference_texts(model, "4x2")  # one process, the original checkpoint
    served = [complete(url, model, prompt) for prompt in PROMPTS]
    assert served == expected
    # The same tokens with steps overlapped: process 1 launches step N+1 before reading step N back, as process 0.
    assert "steps overlap: async scheduling" in processes.log("p0")
    for name in ("p0", "p1"):  # each process read about its own half of the layers, not the whole checkpoint
        read, _, total = restore_line(processes.log(name))
        assert 0 < read < 0.8 * total, processes.log(name)[-2000:]

    processes.signal("p1", signal.SIGTERM)  # a follower's SIGTERM shuts the whole cluster down, cleanly
    for name in ("p0", "p1"):
        rc, _ = processes.wait(name, EXIT_BOUND)
        assert rc == 0, processes.log(name)[-2000:]
    assert "process 1 (host" in processes.log("p0") and "received a shutdown signal" in processes.log("p0")


def test_leaderworkerset_pods_serve_the_default_model_like_one_process_and_a_killed_follower_ends_the_leader(
        processes, smollm2_gguf_path):
    """Two processes started as a Kubernetes LeaderWorkerSet starts its pods: the same command line, no cluster
    options, only the LWS_* variables (and the coordinator port), serving the built-in default model (SmolLM2) with
    the default KV cache sizing. A 4x2 mesh, four devices each: the same greedy text as one process. Then a
    follower killed mid-stream makes the leader exit, naming it."""
    http_port, coordinator_port = free_port(), free_port_pair()
    for index in (0, 1):
        lws = {"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": str(index),
               "JAX_COORDINATOR_PORT": str(coordinator_port)}
        processes.start(f"p{index}", ["serve", "--mesh", "4x2", "--port", str(http_port), *SMALL_STEPS], env=lws)
    url = processes.wait_healthy(http_port, timeout=240)
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    assert model == "SmolLM2-135M-Instruct"
    assert [complete(url, model, prompt) for prompt in PROMPTS] == reference_texts(smollm2_gguf_path, "4x2")
    assert "process 1 of 2, coordinator 127.0.0.1:" in processes.log("p1")
    assert "(from the LeaderWorkerSet's LWS_* variables)" in processes.log("p1")
    for name in ("p0", "p1"):  # both on this host: each sized its cache from half the host's budget, or less
        assert "than host memory split between this host's 2 processes holds" in processes.log(name)

    generating = threading.Event()
    threading.Thread(target=_long_request, args=(url, model, generating), daemon=True).start()
    assert generating.wait(60), processes.logs_tail()  # mid-serve: tokens are streaming
    processes.signal("p1", signal.SIGKILL)
    rc, _ = processes.wait("p0", EXIT_BOUND)
    log = processes.log("p0")
    assert rc == 1 and re.search(r"process 1 \(host \S+, pid \d+\) was lost", log), log[-2000:]


def test_expert_parallel_moe_served_by_two_processes_then_a_killed_leader_ends_the_follower(processes,
                                                                                         tiny_checkpoint):
    """Each process holds one pipeline stage's 4 tp devices, 2 of the 8 experts on each: the experts' psum runs
    within a process, the stage hand-off between them. The same greedy text as one process; then the leader is
    killed and the follower exits, naming it."""
    model = str(tiny_checkpoint("mixtral", num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2))
    url = start_pair(processes, model, free_port(), "--enable-expert-parallel")
    served = [complete(url, model, prompt) for prompt in PROMPTS]
    assert served == reference_texts(model, "4x2", enable_expert_parallel=True)
    processes.signal("p0", signal.SIGKILL)
    rc, _ = processes.wait("p1", EXIT_BOUND)
    log = processes.log("p1")
    assert rc != 0
    # Whichever notices first: our step channel (EOF) or jax's coordination client (its service is gone).
    assert "process 0 (the leader" in log or "leader task was preempted/died" in log, log[-2000:]


def _long_request(url: str, model: str, generating: threading.Event) -> None:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    generating.set()
    except httpx.HTTPError:
        pass  # the server goes away mid-request: that is the point


def test_lora_adapter_and_speculation_served_by_two_processes_match_one_process(processes, tiny_checkpoint,
                                                                                tmp_path):
    """Every process loads --lora-modules into the same slots at start; an adapter loaded over HTTP is read by
    process 0 alone, whose factors reach the follower before the step that uses them. Adapter requests run the
    same steps on both halves of the mesh; drafted steps (more sampler rows than sequences) travel to the follower
    like any other."""
    from jaxserve import Engine, LoRARequest, SamplingParams
    from tests.helpers import make_lora_adapter
    from tests.server.helpers import metric_value

    model = str(tiny_checkpoint("llama"))
    for name, seed in (("tuned", 3), ("later", 4)):
        make_lora_adapter(model, tmp_path / name, seed=seed)
    ngram = {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1}
    url = start_pair(processes, model, free_port(), "--lora-modules", f"tuned={tmp_path / 'tuned'}",
                     "--speculative-config", json.dumps(ngram), "--enable-runtime-lora-updating", "--max-loras", "2")
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "later", "lora_path": str(tmp_path / "later")})
    assert loaded.status_code == 200, loaded.text
    names = (model, "tuned", "later")
    prompt = PROMPTS[1]  # one request each: a step across the two processes is slow on the CPU (~0.3 s)
    served = {name: complete(url, name, prompt, max_tokens=16) for name in names}
    assert metric_value(url, "jaxserve:spec_decode_num_accepted_tokens_total") > 0
    engine = Engine(model, mesh="4x2", num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=2, warmup=False,
                    dtype="float32", max_loras=2, lora_modules={"tuned": str(tmp_path / "tuned")},
                    speculative_config=ngram)
    params = SamplingParams(max_tokens=16, temperature=0)
    for name in names:
        lora = None if name == model else LoRARequest(name, 2, str(tmp_path / name))
        assert served[name] == engine.generate([prompt], params, use_tqdm=False, lora_request=lora)[0].outputs[0].text
    assert len(set(served.values())) == 3
