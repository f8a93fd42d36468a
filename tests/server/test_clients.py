"""The client libraries people put in front of an OpenAI-compatible server, each used as its own documentation
shows, against the real `jaxserve serve` of the default model: LangChain, instructor, the OpenAI Agents SDK and
lm-evaluation-harness (whose `local-completions` / `local-chat-completions` must give what its `hf` model gives on
transformers' float32 reading of the same weights)."""

import json

import openai
import pytest
from pydantic import BaseModel

from tests.server.helpers import API_KEY, REAL_MODEL

MAX_TOKENS = 48


class City(BaseModel):
    name: str
    country: str


@pytest.fixture
def chat_model(real_server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=REAL_MODEL, base_url=f"{real_server.url}/v1", api_key=API_KEY, temperature=0,
                      max_tokens=MAX_TOKENS, max_retries=0, timeout=120)


def weather_tool():
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, unit: str) -> str:
        """The weather in a city. Also give the country, the date and anything else you know."""  # invites extras
        return "sunny"

    return get_weather


def test_langchain_invoke_and_stream_give_the_servers_text(chat_model, openai_client):
    question = "What is the capital of France?"
    reply = chat_model.invoke(question)
    direct = openai_client.chat.completions.create(model=REAL_MODEL, temperature=0, max_tokens=MAX_TOKENS,
                                                   messages=[{"role": "user", "content": question}])
    assert reply.content == direct.choices[0].message.content and "Paris" in reply.content
    assert "".join(chunk.content for chunk in chat_model.stream(question)) == reply.content


@pytest.mark.parametrize("tool_choice", ["get_weather", "any"])  # LangChain's "any" is the API's "required"
def test_langchain_forced_tool_calls_hold_exactly_the_declared_arguments(chat_model, tool_choice):
    """The tool's description invites more keys than its schema lists: the call still holds exactly those."""
    reply = chat_model.bind_tools([weather_tool()], tool_choice=tool_choice).invoke("What is the weather in Paris?")
    assert [call["name"] for call in reply.tool_calls] == ["get_weather"]
    assert set(reply.tool_calls[0]["args"]) == {"city", "unit"} and reply.tool_calls[0]["args"]["city"] == "Paris"
    assert not reply.invalid_tool_calls


def test_langchain_auto_tool_choice_answers_with_text_or_a_valid_call(chat_model):
    reply = chat_model.bind_tools([weather_tool()], tool_choice="auto").invoke("What is the weather in Paris?")
    assert not reply.invalid_tool_calls
    assert reply.content or reply.tool_calls
    assert all(call["name"] == "get_weather" for call in reply.tool_calls)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(chat_model, method):
    city = chat_model.with_structured_output(City, method=method).invoke("Name a city in France.")
    assert isinstance(city, City) and city.country == "France" and city.name


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor_response_models(real_server, mode):
    import instructor

    client = instructor.from_openai(openai.OpenAI(base_url=f"{real_server.url}/v1", api_key=API_KEY, max_retries=0),
                                    mode=getattr(instructor.Mode, mode))
    city = client.chat.completions.create(model=REAL_MODEL, response_model=City, max_retries=0, temperature=0,
                                          max_tokens=MAX_TOKENS,
                                          messages=[{"role": "user", "content": "Name a city in France."}])
    assert isinstance(city, City) and city.country == "France" and city.name


def test_openai_agents_sdk_calls_a_function_tool_then_answers_in_text(real_server):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)  # no trace upload to OpenAI
    asked = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"It is sunny and 21 degrees in {city}."

    client = openai.AsyncOpenAI(base_url=f"{real_server.url}/v1", api_key=API_KEY, max_retries=0)
    # The SDK resets a required tool choice to "auto" once a tool has run (its default), so the second turn answers.
    agent = Agent(name="Assistant", instructions="You answer questions about the weather.", tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model=REAL_MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=MAX_TOKENS))
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert asked == ["Paris"]
    assert [type(item) for item in result.new_items] == [ToolCallItem, ToolCallOutputItem, MessageOutputItem]
    assert isinstance(result.final_output, str) and "sunny" in result.final_output


# --- lm-evaluation-harness -----------------------------------------------------------------------------------

CAPITALS = [dict(country="France", choices=["Paris", "London", "Rome"], answer=0),
            dict(country="Italy", choices=["Madrid", "Rome", "Berlin"], answer=1),
            dict(country="Japan", choices=["Tokyo", "Seoul"], answer=0)]
QUESTIONS = [dict(question="What is the capital of France?", answer="Paris"),
             dict(question="What color is the sky on a clear day?", answer="blue")]


def task_yaml(name: str, data, **fields) -> str:
    return "\n".join([f"task: {name}", "dataset_path: json", "dataset_kwargs:", "  data_files:",
                      f"    test: {data}", "test_split: test", *(f"{k}: {json.dumps(v)}" for k, v in fields.items())])


@pytest.fixture
def lm_eval_tasks(tmp_path, monkeypatch):
    """Two local tasks: a multiple choice (loglikelihoods) and a generation stopped at a newline."""
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for name, rows in (("capitals", CAPITALS), ("questions", QUESTIONS)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "capitals.yaml").write_text(task_yaml(
        "jaxserve_capitals", tmp_path / "capitals.jsonl", output_type="multiple_choice",
        doc_to_text="The capital of {{country}} is", doc_to_choice="{{choices}}", doc_to_target="answer",
        metric_list=[{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]))
    (tmp_path / "questions.yaml").write_text(task_yaml(
        "jaxserve_questions", tmp_path / "questions.jsonl", output_type="generate_until",
        doc_to_text="Question: {{question}}\nAnswer:", doc_to_target="answer",
        generation_kwargs={"until": ["\n"], "max_gen_toks": 16, "do_sample": False, "temperature": 0},
        metric_list=[{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]))
    # Only these two: indexing lm_eval's own thousands of task files as well takes ~6 s.
    return TaskManager(include_path=str(tmp_path), include_defaults=False)


def evaluate(model, tasks, task_manager, **options) -> dict[str, list]:
    """Each task's responses, in document order."""
    import lm_eval

    results = lm_eval.simple_evaluate(model=model, tasks=tasks, task_manager=task_manager, log_samples=True,
                                      **options)
    return {task: [s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]
            for task, samples in results["samples"].items()}


def test_lm_eval_harness_through_the_api_equals_its_hf_model(real_server, hf_smollm2, tokenizer_dir, lm_eval_tasks,
                                                              monkeypatch):
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    served = f"model={REAL_MODEL},num_concurrent=1,max_retries=1,base_url={real_server.url}/v1"
    api = evaluate("local-completions", ["jaxserve_capitals", "jaxserve_questions"], lm_eval_tasks,
                   model_args=f"{served}/completions,tokenizer_backend=huggingface,tokenizer={tokenizer_dir}")
    api_chat = evaluate("local-chat-completions", ["jaxserve_questions"], lm_eval_tasks, apply_chat_template=True,
                        model_args=f"{served}/chat/completions,tokenizer_backend=none")
    hf = HFLM(pretrained=hf_smollm2, tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir), batch_size=1)
    reference = evaluate(hf, ["jaxserve_capitals", "jaxserve_questions"], lm_eval_tasks)
    reference_chat = evaluate(hf, ["jaxserve_questions"], lm_eval_tasks, apply_chat_template=True)

    # Loglikelihoods of every choice within 1e-3, and the same greedy verdicts.
    (ours, theirs) = (api["jaxserve_capitals"], reference["jaxserve_capitals"])
    assert [len(doc) for doc in ours] == [len(row["choices"]) for row in CAPITALS]
    for doc_ours, doc_theirs in zip(ours, theirs):
        for [(logprob, greedy)], [(ref_logprob, ref_greedy)] in zip(doc_ours, doc_theirs):
            assert logprob == pytest.approx(ref_logprob, abs=1e-3) and greedy == ref_greedy
    # Generations identical, through the completions and the chat API alike.
    assert api["jaxserve_questions"] == reference["jaxserve_questions"]
    assert api_chat["jaxserve_questions"] == reference_chat["jaxserve_questions"]
    assert any(text.strip() for [[text]] in api_chat["jaxserve_questions"])  # the chat answers are not empty
