"""Multi-LoRA serving: logits match PEFT's on transformers with the same base weights and adapter, with
several adapters and the base model in one batch, on one device and on a tp x pp mesh; the prefix cache never
shares KV across adapters; a slot is reused once its adapter's requests are done; adapters jaxserve cannot serve
are refused by name."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve import Engine, LoRARequest, SamplingParams
from jaxserve.engine.steps import LogitsLog, StepLog
from tests.helpers import hf_logits, make_lora_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [list(range(300, 341)), list(range(100, 105)), list(range(200, 216))]  # partial, short, one block


@pytest.fixture(scope="module")
def llama_with_adapters(tiny_checkpoint, tmp_path_factory):
    """A tiny Llama, two adapters on it (one on every target with rsLoRA scaling, one on attention only, rank 2),
    and their PEFT references."""
    base = tiny_checkpoint("llama", tie_word_embeddings=False)
    root = tmp_path_factory.mktemp("adapters")
    every = make_lora_adapter(base, root / "every", seed=1, r=4, lora_alpha=8, use_rslora=True)
    attention = make_lora_adapter(base, root / "attention", seed=2, r=2, lora_alpha=16,
                                  targets=("q_proj", "v_proj", "o_proj"))
    adapters = {"every": LoRARequest("every", 1, str(root / "every")),
                "attention": LoRARequest("attention", 2, str(root / "attention"))}
    return base, adapters, {"every": every, "attention": attention}


def _reference(references: dict, name: str | None, tokens: list[int]) -> np.ndarray:
    if name is None:
        with references["every"].disable_adapter():
            return hf_logits(references["every"], tokens)
    return hf_logits(references[name], tokens)


def check_lora_parity(engine: Engine, references: dict, prompts, loras, tol: float = 1e-4):
    """Greedy generation of prompts[i] under loras[i]; every sampled row's logits against its reference."""
    logits = LogitsLog()
    engine.observers.append(logits)
    try:
        outs = engine.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    finally:
        engine.observers.remove(logits)
    log = logits.rows
    finals = [(o.prompt_token_ids + o.outputs[0].token_ids, None if lora is None else lora.lora_name)
              for o, lora in zip(outs, loras)]
    references_by_final = {tuple(f): _reference(references, name, f) for f, name in finals}
    assert len(log) == len(prompts) * GREEDY.max_tokens
    worst = 0.0
    for tokens_so_far, logits in log:
        full = next(f for f, _ in finals if f[: len(tokens_so_far)] == tokens_so_far)
        worst = max(worst, float(np.abs(references_by_final[tuple(full)][len(tokens_so_far) - 1] - logits).max()))
    assert worst <= tol, f"max abs logit difference {worst}"
    return outs


@pytest.mark.parametrize("mesh, layer_loop", [(None, "scan"), ("4x2", "scan"), (None, "unrolled"), ("2x2", "unrolled")])
def test_adapters_and_base_in_one_batch_match_peft(mesh, layer_loop, llama_with_adapters):
    """On 4x2, tp pads the 2 kv heads to 4 (replicated) and pp pads 3 layers to 4 slots: the factors pad alike.
    Unrolled (GPU's default), the adapter slots stay stacked beside the per-layer weights."""
    base, adapters, references = llama_with_adapters
    engine = Engine(str(base), mesh=mesh, enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64,
                    max_num_batched_tokens=64, max_num_seqs=4, warmup=False, layer_loop=layer_loop)
    outs = check_lora_parity(engine, references, PROMPTS, [adapters["every"], adapters["attention"], None])
    base_outs = engine.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    # The adapters do change the text (else the parity above would not show the adapters were applied).
    assert outs[0].outputs[0].token_ids != base_outs[0].outputs[0].token_ids
    assert outs[1].outputs[0].token_ids != base_outs[1].outputs[0].token_ids


def test_prefix_cache_is_never_shared_across_adapters(llama_with_adapters):
    base, adapters, references = llama_with_adapters
    engine = Engine(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64,
                    max_num_batched_tokens=64, max_num_seqs=4, warmup=False)
    prompt = PROMPTS[0]  # 41 tokens: two full blocks a later request could reuse
    first = engine.generate([prompt], GREEDY, use_tqdm=False, lora_request=adapters["every"])[0]
    again = engine.generate([prompt], GREEDY, use_tqdm=False, lora_request=adapters["every"])[0]
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == first.outputs[0].token_ids
    for lora in (adapters["attention"], None):  # same tokens, other weights: nothing cached applies
        out = check_lora_parity(engine, references, [prompt], [lora])[0]
        assert out.num_cached_tokens == 0


def test_one_slot_serves_adapters_in_turn(llama_with_adapters):
    """max_loras=1 and two adapters in one call: the second waits for the slot, which is then reloaded."""
    base, adapters, references = llama_with_adapters
    engine = Engine(str(base), enable_lora=True, max_loras=1, max_lora_rank=8, num_kv_blocks=64,
                    max_num_batched_tokens=64, max_num_seqs=4, warmup=False)
    loras = [adapters["every"], adapters["attention"], adapters["every"]]
    steps_run = StepLog()
    engine.observers.append(steps_run)
    outs = check_lora_parity(engine, references, PROMPTS, loras)
    adapter_of = {out.request_id: lora.lora_name for out, lora in zip(outs, loras)}
    steps = [{adapter_of[rid] for rid, _, _ in record.chunks} for record in steps_run.records]
    assert all(len(names) == 1 for names in steps), "two adapters ran in one step with one slot"
    # The third request passed the second: its adapter was resident, so both of "every" ran before the reload.
    first_attention = steps.index({"attention"})
    assert {"every"} not in steps[first_attention:]
    assert any(rid == outs[2].request_id for record in steps_run.records[:first_attention] for rid, _, _ in record.chunks)
    engine.add_request("a", PROMPTS[0], GREEDY, lora_request=adapters["every"])
    engine.add_request("b", PROMPTS[1], GREEDY, lora_request=adapters["attention"])
    engine.step()  # "every" holds the slot; "attention" waits for it
    assert lora_requests_info(engine) == {"max_lora": "1", "running_lora_adapters": "every",
                                          "waiting_lora_adapters": "attention"}


def test_a_slot_is_not_given_to_another_adapter_while_a_step_of_its_own_is_in_the_pipeline(llama_with_adapters):
    """1x2, stages busy across steps: a request aborted while its prompt's first chunk is in stage 0 gave its only
    slot back at once; the next request's adapter was written into it, and the chunk ran stage 1 with those
    weights, its KV cached under the first adapter. A later request of the first adapter with that prompt read
    it: other tokens. Its KV (and the tokens of that later request) must be the adapter's own."""
    base, adapters, references = llama_with_adapters
    every, attention = adapters["every"], adapters["attention"]
    engine = Engine(str(base), mesh="1x2", enable_lora=True, max_loras=1, max_lora_rank=8, num_kv_blocks=64,
                    max_num_batched_tokens=32, max_num_seqs=4, warmup=False)
    assert engine.stage_ticks
    prompt = list(range(200, 248))  # 3 blocks, prefilled a block a tick (a pp-th of the token budget)
    engine.add_request("aborted", prompt, GREEDY, lora_request=every)
    engine.step()  # its first block enters stage 0 and joins the prefix cache
    engine.abort_request("aborted")
    engine.add_request("other", PROMPTS[1], GREEDY, lora_request=attention)
    while engine.has_unfinished_requests():
        engine.step()
    again = check_lora_parity(engine, references, [prompt], [every])[0]
    assert again.num_cached_tokens == 16  # the aborted request's first block, computed with its own adapter


def test_named_adapters_are_loaded_at_start_and_kept(llama_with_adapters):
    base, adapters, references = llama_with_adapters
    modules = {name: lora.lora_path for name, lora in adapters.items()}
    engine = Engine(str(base), lora_modules=modules, max_lora_rank=8, num_kv_blocks=64, max_num_batched_tokens=64,
                    max_num_seqs=4, warmup=False)  # max_loras rises to 2, one slot each
    assert engine.adapters.slots.resident() == {"every": 0, "attention": 1}
    check_lora_parity(engine, references, PROMPTS[:2], [adapters["attention"], adapters["every"]])
    # an adapter loaded later takes the least recently used slot, as vLLM's: the named ones are not kept for good
    third = LoRARequest("third", 3, adapters["attention"].lora_path)
    check_lora_parity(engine, {"third": references["attention"]}, PROMPTS[:1], [third])
    assert engine.adapters.slots.resident() == {"every": 0, "third": 1}
    check_lora_parity(engine, references, PROMPTS[:2], [adapters["attention"], adapters["every"]])


def test_adapters_are_added_and_removed_while_the_engine_runs(llama_with_adapters):
    """vLLM's add_lora / remove_lora: a removed adapter's running request finishes with it, one prepared before the
    removal is refused, and its slot and host copy are freed; the name loaded again with other files is another
    adapter (its own logits, none of the first's KV blocks)."""
    base, adapters, references = llama_with_adapters
    engine = Engine(str(base), enable_lora=True, max_loras=1, max_lora_rank=8, num_kv_blocks=64,
                    max_num_batched_tokens=64, max_num_seqs=4, warmup=False)
    every = adapters["every"]
    registered = LoRARequest("every", 5, every.lora_path)
    assert engine.add_lora(registered) is registered and engine.list_loras() == [registered]
    first = check_lora_parity(engine, references, PROMPTS[:1], [every])[0]  # id 1 given: runs as the engine's id 5
    engine.add_request("running", PROMPTS[0], GREEDY, lora_request=every)
    late = engine.prepare_request("late", PROMPTS[1], GREEDY, lora_request=every)
    outputs = engine.step()
    assert lora_requests_info(engine) == {"max_lora": "1", "running_lora_adapters": "every",
                                          "waiting_lora_adapters": ""}
    assert engine.remove_lora(5) and not engine.remove_lora("every") and engine.list_loras() == []
    with pytest.raises(ValueError, match="'every' was unloaded"):
        engine.add_prepared_request(late)
    while engine.has_unfinished_requests():
        outputs += engine.step()
    running = [o for o in outputs if o.request_id == "running" and o.finished][0]
    assert running.outputs[0].token_ids == first.outputs[0].token_ids
    assert engine.adapters.has_removed  # purged at the next step: nothing runs now
    other_files = LoRARequest("every", 6, adapters["attention"].lora_path)
    again = check_lora_parity(engine, {"every": references["attention"]}, PROMPTS[:1], [other_files])[0]
    assert again.num_cached_tokens == 0 and not engine.adapters.has_removed
    assert engine.adapters.slots.resident() == {"every": 0} and engine.list_loras() == [other_files]


def test_load_inplace_serves_the_name_with_new_files(llama_with_adapters, tmp_path):
    """A named (--lora-modules) adapter replaced in place: a running request finishes with the old files, requests
    after it run with the new ones and reuse none of the old KV, and its slot goes to the replacement
    (max_loras=1). Files it cannot serve leave the old adapter serving."""
    base, adapters, references = llama_with_adapters
    every, attention = adapters["every"], adapters["attention"]
    engine = Engine(str(base), lora_modules={"tuned": every.lora_path}, max_lora_rank=8, num_kv_blocks=64,
                    max_num_batched_tokens=64, max_num_seqs=4, warmup=False)
    old = engine.list_loras()[0]
    first = check_lora_parity(engine, {"tuned": references["every"]}, PROMPTS[:1], [old])[0]
    engine.add_request("running", PROMPTS[0], GREEDY, lora_request=old)
    outputs = engine.step()
    with pytest.raises(ValueError, match="needs a new id"):
        engine.add_lora(LoRARequest("tuned", old.lora_int_id, attention.lora_path), load_inplace=True)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        engine.add_lora(LoRARequest("tuned", 7, str(tmp_path)), load_inplace=True)
    assert engine.list_loras() == [old]
    new = LoRARequest("tuned", 7, attention.lora_path)
    assert engine.add_lora(new, load_inplace=True) is new and engine.list_loras() == [new]
    while engine.has_unfinished_requests():
        outputs += engine.step()
    running = [o for o in outputs if o.request_id == "running" and o.finished][0]
    assert running.outputs[0].token_ids == first.outputs[0].token_ids
    named_again = LoRARequest("tuned", 1, attention.lora_path)  # a request names it; it runs as id 7
    again = check_lora_parity(engine, {"tuned": references["attention"]}, PROMPTS[:1], [named_again])[0]
    assert again.num_cached_tokens == 0 and engine.adapters.slots.resident() == {"tuned": 0}


def lora_requests_info(engine: Engine) -> dict:
    """The labels of the vllm:lora_requests_info gauge /metrics would show for this engine now."""
    from types import SimpleNamespace

    from jaxserve.server.metrics import EngineStatsCollector

    collector = EngineStatsCollector(SimpleNamespace(stats=engine.stats, is_healthy=True), "base")
    (family,) = [f for f in collector.collect() if f.name == "jaxserve:lora_requests_info"]
    return family.samples[0].labels


def _broken_copy(src: str, dst, config_changes: dict | None = None, extra_tensors: dict | None = None) -> str:
    dst.mkdir()
    config = json.loads(Path(src, "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps(config | (config_changes or {})))
    tensors = load_file(f"{src}/adapter_model.safetensors") | (extra_tensors or {})
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return str(dst)


def _corrupt_tensors(adapter: str) -> str:
    Path(adapter, "adapter_model.safetensors").write_bytes(b"not safetensors" * 4)
    return adapter


def test_adapters_it_cannot_serve_are_refused_by_name(llama_with_adapters, tmp_path):
    base, adapters, _ = llama_with_adapters
    src = adapters["every"].lora_path
    engine = Engine(str(base), enable_lora=True, max_lora_rank=8, num_kv_blocks=16, max_num_batched_tokens=32,
                    max_num_seqs=2, warmup=False)
    cases = {
        "rank 16, above max_lora_rank=8": _broken_copy(src, tmp_path / "r16", {"r": 16}),
        "no adapter_config.json": str(tmp_path),
        "DoRA": _broken_copy(src, tmp_path / "dora", {"use_dora": True}),
        "modifies the base model's weights .* path_initial_model_for_weight_conversion": _broken_copy(
            src, tmp_path / "pissa", {"init_lora_weights": "pissa_niter_4"}),
        r"activated LoRA .*alora_invocation_tokens=\[500, 501\]": _broken_copy(
            src, tmp_path / "alora", {"alora_invocation_tokens": [500, 501]}),
        "r=0 in adapter_config.json; a LoRA rank is a positive integer": _broken_copy(src, tmp_path / "r0", {"r": 0}),
        "lora_alpha=None in adapter_config.json": _broken_copy(src, tmp_path / "alpha", {"lora_alpha": None}),
        "not a readable safetensors file": _corrupt_tensors(_broken_copy(src, tmp_path / "corrupt")),
        "embed_tokens.lora_embedding_A.weight": _broken_copy(
            src, tmp_path / "embed", extra_tensors={"base_model.model.model.embed_tokens.lora_embedding_A.weight":
                                                    np.zeros((4, 8), np.float32)}),
        "for layer 7, but the model has 3 layers": _broken_copy(
            src, tmp_path / "deep", extra_tensors={
                f"base_model.model.model.layers.7.self_attn.q_proj.lora_{x}.weight": np.zeros((4, 64), np.float32)
                for x in "AB"}),
    }
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "adapter_config.json").write_text("[1, 2]")
    cases["holds a JSON list, not PEFT's adapter config object"] = str(listed)
    for i, (message, path) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=message):
            engine.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest(f"bad{i}", i + 1, path))
    assert not engine.has_unfinished_requests()
    plain = Engine(str(base), num_kv_blocks=16, max_num_batched_tokens=32, max_num_seqs=2, warmup=False)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=adapters["every"])
    engine.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=adapters["every"])
    with pytest.raises(ValueError, match="already in use"):
        engine.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("every", 9, str(tmp_path / "r16")))


def test_batch_job_bodies_name_adapters(llama_with_adapters, tmp_path):
    """`engine.lora_modules` in a job file (paths relative to it); a body's `model` picks the adapter, as over HTTP."""
    from jaxserve.batch.job import run_job
    from tests.batch.helpers import completion_line, results_by_custom_id, write_job

    base, adapters, _ = llama_with_adapters
    (tmp_path / "adapters").symlink_to(os.path.dirname(adapters["every"].lora_path))
    lines = [completion_line(name, PROMPTS[0], model=name, max_tokens=6, temperature=0, ignore_eos=True)
             for name in ("every", "attention", "tiny")]
    job = write_job(tmp_path, lines, model=str(base), served_model_name=["tiny"],
                    engine={"lora_modules": {"every": "adapters/every", "attention": "adapters/attention"},
                            "max_lora_rank": 8, "num_kv_blocks": 64, "max_num_seqs": 4, "warmup": False})
    summary = run_job(job, show_progress=False)
    assert summary.totals.succeeded == 3
    results = results_by_custom_id(tmp_path / "out.jsonl")
    engine = Engine(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64, max_num_seqs=4,
                    warmup=False)
    for name in ("every", "attention", "tiny"):
        [expected] = engine.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=adapters.get(name))
        status, body = results[name]
        assert body["model"] == name and body["choices"][0]["text"] == expected.outputs[0].text


def test_fields_an_adapter_config_leaves_out_mean_peft_defaults(tmp_path):
    """A config without lora_alpha (or r) means PEFT's default, not alpha = r: scaling alpha / r."""
    from peft import LoraConfig

    from jaxserve.loader.lora import PEFT_DEFAULT_ALPHA, PEFT_DEFAULT_RANK, _rank_and_scale

    assert (LoraConfig().r, LoraConfig().lora_alpha) == (PEFT_DEFAULT_RANK, PEFT_DEFAULT_ALPHA)
    assert _rank_and_scale({"r": 4}, tmp_path, max_rank=8) == (4, PEFT_DEFAULT_ALPHA / 4)
    assert _rank_and_scale({}, tmp_path, max_rank=8) == (8, 1.0)
    assert _rank_and_scale({"r": 4, "lora_alpha": 16, "use_rslora": True}, tmp_path, max_rank=8) == (4, 8.0)


@pytest.mark.parametrize("mesh", [None, "2x1"])
def test_phi3_fused_projections_are_adapted_as_peft_adapts_them(tiny_checkpoint, tmp_path, mesh):
    """Phi-3 fuses q/k/v and gate/up: PEFT adapts qkv_proj and gate_up_proj whole, whose B rows split into the
    parts this engine keeps apart (they were refused: 'cannot adapt')."""
    base = tiny_checkpoint("phi3", pad_token_id=0)  # Phi-3's default pad id is past a tiny vocabulary
    reference = make_lora_adapter(base, tmp_path / "fused", seed=3, r=4, lora_alpha=8,
                                  targets=("qkv_proj", "gate_up_proj", "o_proj", "down_proj"))
    engine = Engine(str(base), mesh=mesh, enable_lora=True, max_lora_rank=8, num_kv_blocks=32,
                    max_num_batched_tokens=64, max_num_seqs=2, warmup=False)
    fused = LoRARequest("fused", 1, str(tmp_path / "fused"))
    check_lora_parity(engine, {"fused": reference}, PROMPTS[:2], [fused, fused])
