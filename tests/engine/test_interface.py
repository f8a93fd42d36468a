"""The Engine and the test suite's scripted engine both implement StepEngine (jaxserve/engine/interface.py), the
surface AsyncEngine, the server and batch jobs use: same members, same parameter names."""

import inspect

from jaxserve import Engine
from jaxserve.engine.interface import StepEngine
from tests.server.fake_engine import FakeEngine

METHODS = sorted(name for name, member in vars(StepEngine).items()
                 if inspect.isfunction(member) and not name.startswith("_"))


def parameters(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_engine_and_fake_have_the_protocol_methods_with_its_parameters():
    assert "step" in METHODS and "prepare_request" in METHODS
    for implementation in (Engine, FakeEngine):
        for name in METHODS:
            assert parameters(getattr(implementation, name)) == parameters(getattr(StepEngine, name)), \
                f"{implementation.__name__}.{name}"


def test_instances_satisfy_the_protocol(tiny_checkpoint, smol_tokenizer):
    assert isinstance(FakeEngine(smol_tokenizer), StepEngine)
    engine = Engine(str(tiny_checkpoint("llama")), num_kv_blocks=16, max_num_seqs=2, max_num_batched_tokens=16,
                    warmup=False)
    assert isinstance(engine, StepEngine)
    assert not isinstance(object(), StepEngine)
