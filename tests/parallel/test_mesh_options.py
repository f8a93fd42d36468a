"""Choosing the mesh: the ways to say it, the start-up layout log, and one clear sentence for each mistake."""

import logging

import pytest
from jax.sharding import PartitionSpec

from jaxserve import Engine
from jaxserve.cli.args import layer_partition
from jaxserve.config import MeshShape
from jaxserve.parallel.sharding import partition_spec


@pytest.fixture(scope="module")
def tiny_llama(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))  # 3 layers, 4 q / 2 kv heads


def make(path, **kwargs):
    return Engine(path, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=4, warmup=False, **kwargs)


@pytest.mark.parametrize("options, message", [
    (dict(mesh="4x4"), "mesh 4x4 needs 16 devices but only 8 are available; choose a smaller mesh, or make more "
                       "CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count=16 in the environment before"),
    (dict(mesh="1x4"), "pp=4 is more pipeline stages than the model's 3 layers"),
    (dict(mesh="8x"), "mesh '8x' is not of the form TPxPP"),
    (dict(mesh="0x2"), "mesh '0x2' needs tp >= 1 and pp >= 1"),
    (dict(mesh="1x2", pp_layer_partition=[1, 1]), "sums to 2 but the model has 3 layers"),
    (dict(mesh="2x1", tensor_parallel_size=2), "not both"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer, got 0"),
])
def test_bad_mesh_options_raise_one_clear_sentence(tiny_llama, shared_checkpoints, options, message):
    with pytest.raises(ValueError, match=message) as info:
        make(tiny_llama, **options)
    assert "\n" not in str(info.value)


def test_vllm_style_sizes_and_partition_override_and_layout_log(tiny_llama, shared_checkpoints, caplog):
    """tp=3 on 8 devices uses the first 3 x 2; the partition override decides which stage holds which layer."""
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.model_runner"):
        engine = make(tiny_llama, tensor_parallel_size=3, pipeline_parallel_size=2, pp_layer_partition=[1, 2])
    assert engine.mesh_shape == MeshShape(3, 2) and engine.runner.mesh.devices.size == 6
    assert engine.runner.layout.partition == (1, 2)
    assert "stage 0: layers 0-0 on devices tp0=0, tp1=1, tp2=2" in caplog.text
    assert "stage 1: layers 1-2 on devices tp0=3, tp1=4, tp2=5" in caplog.text
    assert engine.config.model.num_heads == 4  # the user-facing config keeps the checkpoint's numbers
    assert engine.runner.cfg.num_heads % 3 == 0


def test_cli_layer_partition_type():
    assert layer_partition("8,8,7,7") == [8, 8, 7, 7]
    with pytest.raises(Exception, match="such as 8,8,7,7"):
        layer_partition("8,,7")


@pytest.mark.parametrize("given, shape", [
    (dict(), MeshShape(1, 1)), (dict(mesh="8x2"), MeshShape(8, 2)), (dict(mesh=" 4 x 1 "), MeshShape(4, 1)),
    (dict(mesh=(2, 3)), MeshShape(2, 3)), (dict(mesh=MeshShape(2, 2)), MeshShape(2, 2)),
    (dict(tensor_parallel_size=4), MeshShape(4, 1)), (dict(pipeline_parallel_size=2), MeshShape(1, 2)),
])
def test_every_spelling_of_a_mesh_is_one_mesh_shape(given, shape):
    mesh = MeshShape.of(**given)
    assert mesh == shape and tuple(mesh) == (shape.tp, shape.pp) and str(mesh) == f"{shape.tp}x{shape.pp}"


def test_an_unknown_logical_axis_name_is_refused_not_replicated():
    assert partition_spec(("layers", None, "q_heads")) == PartitionSpec("pp", None, "tp")
    with pytest.raises(ValueError, match="unknown logical axis name 'q_head'.*knows layers, embed"):
        partition_spec(("embed", "q_head"))


def test_too_large_a_mesh_on_cpu_processes_names_the_devices_each_process_needs(monkeypatch):
    """On several processes (jax.distributed), each makes its own share of the mesh's CPU devices."""
    import jax

    from jaxserve.parallel.sharding import make_mesh

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=r"device_count=8 in the environment before the process starts \(each of "
                                         r"the 2 processes\)$"):
        make_mesh(4, 4, jax.devices()[:4])
