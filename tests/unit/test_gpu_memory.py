"""An NVIDIA node's GPU in NodeInfo (read from nvidia-smi, never through MLX) and
placement by the GPU's memory on a CUDA node instead of its RAM."""

import sys
from pathlib import Path

import pytest

from exo.master.placement import PlacementError, instance_previews, place_instance
from exo.shared.models.model_cards import ModelCard, ModelTask, StorageSize
from exo.shared.types.common import NodeId
from exo.shared.types.instances import EngineKind, Sharding
from exo.shared.types.nodes import GpuInfo, MemoryInfo, NodeInfo, NodeSpeed
from exo.shared.types.state import State
from exo.shared.types.topology import Connection, Topology
from exo.worker import hardware
from exo.worker.hardware import Hardware, nvidia_gpus, parse_gpu_query
from exo.worker.worker import MEMORY_REPORT_THRESHOLD_BYTES, _differs

GiB = 2**30
MiB = 2**20
H100 = "NVIDIA H100 80GB HBM3"
H100_LINE = f"{H100}, 81559, 80994"
A10G_LINE = "NVIDIA A10G, 23028, 22563"
WITH_NVIDIA_GPU = Hardware(system="Linux", machine="x86_64", nvidia_gpu=True, mlx_cuda=True, llama_cpp=False)


# --- nvidia-smi ----------------------------------------------------------------------------


def test_one_gpu_is_read_in_bytes():
    assert parse_gpu_query(H100_LINE + "\n") == [GpuInfo(name=H100, total_bytes=81559 * MiB, free_bytes=80994 * MiB)]


def test_two_gpus_are_read_in_the_drivers_order():
    gpus = parse_gpu_query(f"{H100_LINE}\n{A10G_LINE}\n")
    assert [gpu.name for gpu in gpus] == [H100, "NVIDIA A10G"]
    assert gpus[1].total_bytes == 23028 * MiB and gpus[1].free_bytes == 22563 * MiB


def test_lines_that_do_not_read_as_a_gpu_are_left_out():
    output = "\n".join(
        [
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.",
            "NVIDIA GeForce RTX 4090, [N/A], [N/A]",
            ", 1000, 1000",
            "",
            "Tesla T4, 15360, 14913",
        ]
    )
    assert parse_gpu_query(output) == [GpuInfo(name="Tesla T4", total_bytes=15360 * MiB, free_bytes=14913 * MiB)]
    assert parse_gpu_query("") == []


def fake_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    """nvidia-smi replaced by a real program whose Python `body` answers the query."""
    script = tmp_path / "nvidia-smi.py"
    script.write_text(body)
    monkeypatch.setattr(hardware, "GPU_QUERY", [sys.executable, str(script), *hardware.GPU_QUERY[1:]])


def test_the_gpus_are_asked_of_nvidia_smi_with_the_query(tmp_path, monkeypatch):
    fake_nvidia_smi(
        tmp_path,
        monkeypatch,
        "import sys\n"
        "assert sys.argv[1:] == ['--query-gpu=name,memory.total,memory.free', '--format=csv,noheader,nounits']\n"
        f"print({H100_LINE!r}); print({A10G_LINE!r})\n",
    )
    assert [gpu.name for gpu in nvidia_gpus(WITH_NVIDIA_GPU)] == [H100, "NVIDIA A10G"]


def test_nvidia_smi_that_hangs_is_given_up_on_quickly(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch, "import time; time.sleep(30)\n")
    monkeypatch.setattr(hardware, "GPU_QUERY_TIMEOUT_S", 0.5)
    assert nvidia_gpus(WITH_NVIDIA_GPU) == []


def test_nvidia_smi_that_fails_or_is_missing_gives_no_gpus(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch, f"print({H100_LINE!r}); raise SystemExit(9)\n")
    assert nvidia_gpus(WITH_NVIDIA_GPU) == []
    monkeypatch.setattr(hardware, "GPU_QUERY", [str(tmp_path / "no-such-nvidia-smi")])
    assert nvidia_gpus(WITH_NVIDIA_GPU) == []


def test_nvidia_smi_is_not_asked_where_the_driver_lists_no_gpu(tmp_path, monkeypatch):
    fake_nvidia_smi(tmp_path, monkeypatch, f"print({H100_LINE!r})\n")
    no_gpu = Hardware(system="Linux", machine="x86_64", nvidia_gpu=False, mlx_cuda=False, llama_cpp=False)
    assert nvidia_gpus(no_gpu) == []


# --- NodeInfo --------------------------------------------------------------------------------


def node_info(
    name: str = "a", ram_free_gib: float = 16, gpus: tuple[GpuInfo, ...] = (), backend: str = "cuda"
) -> NodeInfo:
    return NodeInfo(
        node_id=NodeId(name),
        friendly_name=name,
        os="Linux x86_64",
        backend=backend,
        cpu_count=16,
        memory=MemoryInfo(total_bytes=int(max(ram_free_gib, 1) * 2 * GiB), available_bytes=int(ram_free_gib * GiB)),
        gpus=list(gpus),
        disk_available_bytes=500 * GiB,
        api_port=52415,
    )


def gpu(free_gib: float, total_gib: float = 80, name: str = H100) -> GpuInfo:
    return GpuInfo(name=name, total_bytes=int(total_gib * GiB), free_bytes=int(free_gib * GiB))


def test_node_info_carries_its_gpus_on_the_wire_and_older_reports_have_none():
    info = node_info(gpus=(gpu(79),))
    wire = info.model_dump(mode="json")
    assert wire["gpus"] == [{"name": H100, "totalBytes": 80 * GiB, "freeBytes": 79 * GiB}]
    assert NodeInfo.model_validate(wire) == info
    del wire["gpus"]  # a NodeInfo logged before nodes reported GPUs
    assert NodeInfo.model_validate(wire).gpus == []


def test_a_gpus_free_memory_is_reported_again_only_when_it_moved_a_lot():
    known = node_info(gpus=(gpu(79),))
    wobble = node_info(gpus=(gpu(79 - 0.25),))
    loaded = known.model_copy(update={"gpus": [gpu(79 - (MEMORY_REPORT_THRESHOLD_BYTES + MiB) / GiB)]})
    assert not _differs(known, wobble)
    assert _differs(known, loaded)
    assert _differs(known, node_info(gpus=(gpu(79), gpu(22, 24, "NVIDIA A10G"))))


# --- placement -------------------------------------------------------------------------------


def card_of(weights_gib: float) -> ModelCard:
    return ModelCard(
        model_id="test/big",
        n_layers=32,
        hidden_size=4096,
        num_key_value_heads=8,
        tasks=[ModelTask.TextGeneration],
        context_length=4096,
        storage_size=StorageSize(in_bytes=int(weights_gib * GiB)),
    )


def one_node(info: NodeInfo) -> State:
    return State(nodes={info.node_id: info})


def test_a_cuda_node_takes_a_model_larger_than_its_ram_into_its_gpu():
    state = one_node(node_info(ram_free_gib=16, gpus=(gpu(79),)))
    instance = place_instance(state, card_of(40))
    assert list(instance.shard_assignments.node_to_runner) == ["a"]
    [preview] = instance_previews(state, card_of(40), Sharding.Pipeline)
    assert preview.memory_available_bytes == {"a": 79 * GiB}
    assert preview.memory_kind == {"a": "gpu"}


def test_a_cuda_node_whose_gpu_is_too_small_is_refused_naming_gpu_memory():
    state = one_node(node_info(ram_free_gib=256, gpus=(gpu(22, 24, "NVIDIA A10G"),)))
    with pytest.raises(PlacementError, match=r"node a has 22.00 GiB of GPU memory free \(NVIDIA A10G\), needs"):
        place_instance(state, card_of(40))


def test_the_same_machine_on_metal_or_llama_cpp_is_judged_by_its_ram():
    metal = node_info(ram_free_gib=16, backend="metal")
    llama_cpp = node_info(ram_free_gib=16, gpus=(gpu(79),)).model_copy(update={"engine": EngineKind.LlamaCpp})
    for info in (metal, llama_cpp):
        [preview] = instance_previews(one_node(info), card_of(40), Sharding.Pipeline)
        assert preview.memory_kind == {"a": "ram"} and preview.memory_available_bytes == {"a": 16 * GiB}
        assert preview.error is not None and "node a has 16.00 GiB free, needs" in preview.error


def test_a_cuda_node_that_could_not_report_its_gpu_is_judged_by_its_ram():
    [preview] = instance_previews(one_node(node_info(ram_free_gib=16)), card_of(40), Sharding.Pipeline)
    assert preview.memory_kind == {"a": "ram"} and preview.instance is None


def test_a_pipeline_over_two_cuda_nodes_splits_the_layers_by_their_gpus_memory():
    big, small = node_info("a", ram_free_gib=500, gpus=(gpu(60),)), node_info("b", ram_free_gib=500, gpus=(gpu(20),))
    topology = Topology()
    for source, sink, ip in (("a", "b", "10.0.0.2"), ("b", "a", "10.0.0.1")):
        topology = topology.with_connection(Connection(source=NodeId(source), sink=NodeId(sink), sink_ip=ip))
    state = State(nodes={big.node_id: big, small.node_id: small}, topology=topology)
    instance = place_instance(state, card_of(40), min_nodes=2)
    assignments = instance.shard_assignments
    shards = {
        node_id: assignments.runner_to_shard[runner_id].end_layer - assignments.runner_to_shard[runner_id].start_layer
        for node_id, runner_id in assignments.node_to_runner.items()
    }
    assert shards["a"] > 2 * shards["b"], shards  # RAM alike, GPUs 60 and 20 GiB free


# --- mixed clusters ----------------------------------------------------------------------------


def linked(*infos: NodeInfo) -> State:
    topology = Topology()
    for i, source in enumerate(infos):
        for j, sink in enumerate(infos):
            if i != j:
                connection = Connection(source=source.node_id, sink=sink.node_id, sink_ip=f"10.0.0.{j + 1}")
                topology = topology.with_connection(connection)
    return State(nodes={info.node_id: info for info in infos}, topology=topology)


def cpu_node(name: str, ram_free_gib: float, engine: EngineKind = EngineKind.LlamaCpp) -> NodeInfo:
    return node_info(name, ram_free_gib=ram_free_gib, backend="cpu").model_copy(update={"engine": engine})


def test_a_gpu_node_is_preferred_to_a_cpu_node_with_more_memory():
    cuda = node_info("z-cuda", ram_free_gib=16, gpus=(gpu(30),))
    metal = node_info("z-mac", ram_free_gib=24, backend="metal")
    for gpu_node in (cuda, metal):
        state = linked(gpu_node, cpu_node("a-cpu", ram_free_gib=200))
        assert list(place_instance(state, card_of(10)).shard_assignments.node_to_runner) == [gpu_node.node_id]
        preview = instance_previews(state, card_of(10), Sharding.Pipeline)[0]
        assert preview.compute == {gpu_node.node_id: gpu_node.backend}
    # A GPU that llama.cpp (a CPU build) runs on is no GPU to it: memory decides again.
    on_llama_cpp = cuda.model_copy(update={"engine": EngineKind.LlamaCpp})
    state = linked(on_llama_cpp, cpu_node("a-cpu", ram_free_gib=200))
    assert list(place_instance(state, card_of(10)).shard_assignments.node_to_runner) == ["a-cpu"]


def test_a_split_takes_two_gpu_nodes_before_a_gpu_and_a_cpu_node():
    state = linked(node_info("g1", gpus=(gpu(30),)), node_info("g2", gpus=(gpu(30),)), cpu_node("c", ram_free_gib=500))
    instance = place_instance(state, card_of(40), min_nodes=2)
    assert sorted(instance.shard_assignments.node_to_runner) == ["g1", "g2"]


def test_a_split_across_a_cuda_node_and_a_cpu_node_runs_mlx_on_both():
    # Neither holds the 40 GiB model alone; the CPU node runs llama.cpp by default.
    state = linked(node_info("a", ram_free_gib=16, gpus=(gpu(30),)), cpu_node("b", ram_free_gib=30))
    instance = place_instance(state, card_of(40))
    assert sorted(instance.shard_assignments.node_to_runner) == ["a", "b"]
    assert instance.engine == EngineKind.Mlx
    [preview] = [p for p in instance_previews(state, card_of(40), Sharding.Pipeline) if p.instance is not None]
    assert preview.compute == {"a": "cuda", "b": "cpu"} and preview.memory_kind == {"a": "gpu", "b": "ram"}
    assert preview.engine_reason is not None and "the nodes run different engines" in preview.engine_reason


def _measured(info: NodeInfo, gbps: float) -> NodeInfo:
    return info.model_copy(update={"speed": NodeSpeed(matmul_gflops=10 * gbps, matvec_gbps=gbps, device="cpu")})


def test_placement_takes_the_node_measured_fastest_after_the_gpu_nodes():
    # Two CPU nodes with room to spare: the one whose probe read weights faster decodes
    # faster, and is taken though it has less free memory.
    slow, fast = _measured(cpu_node("a", ram_free_gib=200), 10), _measured(cpu_node("b", ram_free_gib=100), 40)
    assert list(place_instance(linked(slow, fast), card_of(40)).shard_assignments.node_to_runner) == ["b"]
    # A node not measured yet counts as the slowest measured one: memory decides.
    unmeasured = cpu_node("b", ram_free_gib=100)
    assert list(place_instance(linked(slow, unmeasured), card_of(40)).shard_assignments.node_to_runner) == ["a"]
    # A GPU node comes first whatever a CPU node measured.
    on_gpu = _measured(node_info("g", gpus=(gpu(60),)), 5)
    assert list(place_instance(linked(fast, on_gpu), card_of(40)).shard_assignments.node_to_runner) == ["g"]
    # A 2-node split: the faster pair's pipeline, both nodes reading at their own pace.
    third = _measured(cpu_node("c", ram_free_gib=30), 40)
    pair = place_instance(linked(_measured(cpu_node("a", ram_free_gib=30), 10), fast, third), card_of(40), min_nodes=2)
    assert sorted(pair.shard_assignments.node_to_runner) == ["b", "c"]
