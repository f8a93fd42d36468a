"""vLLM's `tokenizer`, `revision` and `tokenizer_revision`: serving with a tokenizer from another directory or hub
id, and hub versions; each refused by name where it cannot apply."""

import subprocess
import sys

import huggingface_hub
import pytest
import transformers

from jaxserve import Engine, SamplingParams
from jaxserve.batch.job_config import EngineOptions
from jaxserve.loader.tokenizer import TokenizerChoice

TEMPLATE = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"
SMALL = dict(load_format="dummy", dtype="float32", num_kv_blocks=16, max_num_seqs=2, max_num_batched_tokens=32,
             warmup=False)


@pytest.fixture(scope="module")
def templated_tokenizer_dir(tiny_tokenizer_source, tmp_path_factory):
    """The tiny checkpoints' tokenizer saved elsewhere with a chat template of its own, so that using it shows."""
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_tokenizer_source)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def test_a_tokenizer_directory_replaces_the_models_own(tiny_checkpoint, templated_tokenizer_dir):
    model = str(tiny_checkpoint("llama"))
    own, other = Engine(model, **SMALL), Engine(model, tokenizer=str(templated_tokenizer_dir), **SMALL)
    messages = [{"role": "user", "content": "Hi"}]
    assert other.encode_chat(messages) == other.tokenizer.encode("<<Hi>>", add_special_tokens=False)
    assert own.encode_chat(messages) != other.encode_chat(messages)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # Same vocabulary, so a text prompt is the same tokens and the same greedy continuation.
    mine, theirs = (engine.generate(["The capital of France"], greedy, use_tqdm=False)[0] for engine in (own, other))
    assert mine.prompt_token_ids == theirs.prompt_token_ids and mine.outputs[0].text == theirs.outputs[0].text


def test_a_weights_only_repository_serves_with_the_tokenizer_given(tiny_checkpoint, templated_tokenizer_dir,
                                                                    tmp_path):
    """No tokenizer files beside the weights (vLLM's main use of --tokenizer): the model's own is never read."""
    for file in tiny_checkpoint("llama").iterdir():
        if file.name in ("config.json", "generation_config.json") or file.suffix == ".safetensors":
            (tmp_path / file.name).symlink_to(file)
    with pytest.raises(ValueError, match="if the model ships its weights alone, give its tokenizer with --tokenizer"):
        Engine(str(tmp_path), **SMALL)
    engine = Engine(str(tmp_path), tokenizer=str(templated_tokenizer_dir), **SMALL)
    assert engine.tokenizer.chat_template == TEMPLATE


def test_a_tokenizer_with_more_tokens_than_the_model_is_refused(smol_tokenizer, tmp_path):
    bigger = type(smol_tokenizer).from_pretrained(_saved(smol_tokenizer, tmp_path))
    bigger.add_tokens(["<extra-a>", "<extra-b>"])
    with pytest.raises(ValueError, match=f"has {len(smol_tokenizer) + 2} tokens and the model only "
                                         f"{len(smol_tokenizer)}"):
        TokenizerChoice(bigger).resolve(lambda: smol_tokenizer, vocab_size=len(smol_tokenizer))


def test_unloadable_tokenizers_are_refused_and_local_revisions_ignored(tiny_checkpoint, tmp_path, caplog):
    model = str(tiny_checkpoint("llama"))
    with pytest.raises(ValueError, match="cannot load tokenizer '.*nowhere'"):
        Engine(model, tokenizer=str(tmp_path / "nowhere"), **SMALL)
    # As in vLLM (transformers ignores a revision for a directory): a warning, not a failure.
    assert Engine(model, revision="main", tokenizer_revision="main", **SMALL).tokenizer.vocab_size > 0
    assert "revision 'main' ignored" in caplog.text
    with pytest.raises(ValueError, match="tokenizer_revision applies to a tokenizer loaded from the hub"):
        Engine(None, tokenizer_revision="main", **SMALL)


def test_a_hub_revision_and_download_dir_reach_the_downloads(monkeypatch, tiny_checkpoint, tmp_path):
    asked, tokenizer_asked = {}, {}

    def offline(repo_id, **kwargs):
        asked.update(kwargs, repo_id=repo_id)
        raise ConnectionError("no network here")

    def offline_tokenizer(name, **kwargs):
        tokenizer_asked.update(kwargs, name=name)
        raise OSError("no network here")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match="could not fetch 'org/model' at revision 'v2'"):
        Engine("org/model", revision="v2", download_dir=str(tmp_path), **SMALL)
    assert asked["repo_id"] == "org/model" and asked["revision"] == "v2" and asked["cache_dir"] == str(tmp_path)
    model = str(tiny_checkpoint("llama"))  # made (with a tokenizer) before loading tokenizers fails
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline_tokenizer)
    with pytest.raises(ValueError, match="cannot load tokenizer 'org/tokenizer'"):
        Engine(model, tokenizer="org/tokenizer", download_dir=str(tmp_path), **SMALL)
    assert tokenizer_asked["name"] == "org/tokenizer" and tokenizer_asked["cache_dir"] == str(tmp_path)


def test_the_cli_and_batch_jobs_pass_the_tokenizer(tiny_checkpoint, tmp_path):
    run = subprocess.run([sys.executable, "-m", "jaxserve.cli.main", "generate", str(tiny_checkpoint("llama")),
                          "--load-format", "dummy", "--no-warmup", "--prompt", "x",
                          "--tokenizer", str(tmp_path / "missing")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stderr.startswith("jaxserve: error: cannot load tokenizer")
    (tmp_path / "tok").mkdir()
    beside = EngineOptions.model_validate({"tokenizer": "tok"}, context={"base_dir": str(tmp_path)})
    hub = EngineOptions.model_validate({"tokenizer": "org/tokenizer", "tokenizer_revision": "v1",
                                        "download_dir": "/models"}, context={"base_dir": str(tmp_path)})
    assert beside.engine_kwargs()["tokenizer"] == str(tmp_path / "tok")
    assert hub.engine_kwargs() == {"tokenizer": "org/tokenizer", "tokenizer_revision": "v1", "download_dir": "/models"}


def _saved(tokenizer, path):
    tokenizer.save_pretrained(path)
    return path
