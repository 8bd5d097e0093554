"""A node's place in a multi-node job: the command line beats the environment (Slurm, torchrun-style
variables, an accelerate config file), which beats the recipe; each source is said."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from launcher.recipe.cluster_env import expand_nodelist, from_environment
from launcher.recipe.load import RecipeError, load


@pytest.mark.parametrize("text, hosts", [
    ("n1", ["n1"]),
    ("gpu[001-004,007]", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu007"]),
    ("a[8-11],login1", ["a8", "a9", "a10", "a11", "login1"]),
    ("rack1-[2-3]-gpu", ["rack1-2-gpu", "rack1-3-gpu"]),
])
def test_slurm_compressed_host_lists_expand_in_order(text, hosts):
    assert expand_nodelist(text) == hosts


SLURM = {"SLURM_NNODES": "3", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[001-003]",
         "MASTER_PORT": "29400"}


def test_slurm_fills_the_node_keys_and_spare_nodes_come_off_the_count():
    extra, said = from_environment(["checkpointless.spare_nodes=1"], SLURM)
    assert extra == ["distributed.num_nodes=2", "distributed.node_rank=2",
                     "distributed.master_addr=gpu001", "distributed.master_port=29400"]
    assert any("SLURM_NODEID" in s for s in said)
    cfg = load("tiny-llama", extra + ["checkpointless.spare_nodes=1"])
    assert (cfg.distributed.num_nodes, cfg.distributed.node_rank) == (2, 2)  # the spare node


def test_the_command_line_beats_the_environment_which_beats_the_recipe():
    env = {"MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500", "NNODES": "2", "NODE_RANK": "1"}
    extra, said = from_environment(["distributed.node_rank=0"], env)
    assert "distributed.node_rank: from the command line" in said
    assert "distributed.master_addr=10.0.0.7" in extra and "distributed.num_nodes=2" in extra
    cfg = load("tiny-llama", extra + ["distributed.node_rank=0"])
    assert cfg.distributed.node_rank == 0 and cfg.distributed.master_port == 29500
    assert cfg.trainer.max_steps == load("tiny-llama").trainer.max_steps  # the rest: the recipe's
    assert from_environment([], {}) == ([], [])


def test_an_accelerate_config_file_is_read_with_accelerates_loader(tmp_path):
    f = tmp_path / "acc.yaml"
    f.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\n"
                 "num_machines: 2\nmachine_rank: 1\nmain_process_ip: 10.1.2.3\n"
                 "main_process_port: 29600\nnum_processes: 4\nmixed_precision: 'no'\n")
    extra, said = from_environment([f"distributed.accelerate_config={f}",
                                    "trainer.precision=bf16"], {})
    assert set(extra) == {"distributed.num_nodes=2", "distributed.node_rank=1",
                          "distributed.master_addr=10.1.2.3", "distributed.master_port=29600",
                          "distributed.num_processes=4", "distributed.strategy=ddp"}
    assert "trainer.precision: from the command line" in said  # the file's 'no' overridden
    assert all("accelerate config" in s for s in said if "command line" not in s)


@pytest.mark.parametrize("body, says", [
    ("distributed_type: DEEPSPEED\ndeepspeed_config: {zero_stage: 3}\n", "DEEPSPEED"),
    ("distributed_type: MULTI_GPU\nmixed_precision: fp8\n", "mixed_precision=fp8"),
    ("distributed_type: FSDP\nfsdp_config: {fsdp_sharding_strategy: SHARD_GRAD_OP}\n",
     "SHARD_GRAD_OP"),
])
def test_an_accelerate_config_asking_for_what_cannot_be_honoured_is_refused(tmp_path, body,
                                                                           says):
    f = tmp_path / "acc.yaml"
    f.write_text("compute_environment: LOCAL_MACHINE\nnum_machines: 1\nnum_processes: 2\n" + body)
    with pytest.raises(RecipeError, match=says):
        from_environment([f"distributed.accelerate_config={f}"], {})


def test_an_accelerate_fsdp_config_becomes_fsdp_with_checkpointing(tmp_path):
    f = tmp_path / "acc.yaml"
    f.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nnum_machines: 1\n"
                 "num_processes: 2\nmixed_precision: bf16\nfsdp_config:\n"
                 "  fsdp_sharding_strategy: FULL_SHARD\n  fsdp_activation_checkpointing: true\n")
    extra, _ = from_environment([f"distributed.accelerate_config={f}"], {})
    cfg = load("tiny-llama", extra)
    assert cfg.distributed.strategy == "fsdp" and cfg.trainer.precision == "bf16"
    assert cfg.model.gradient_checkpointing and cfg.distributed.num_processes == 2


def test_a_world_size_that_disagrees_with_nodes_is_refused_before_anything_starts():
    with pytest.raises(RecipeError, match="num_nodes x distributed.nproc_per_node = 2 x 2"):
        load("tiny-llama", ["distributed.num_nodes=2", "distributed.nproc_per_node=2",
                            "distributed.num_processes=3", "distributed.master_port=29400"])
    with pytest.raises(RecipeError, match="distributed.master_port"):
        load("tiny-llama", ["distributed.num_nodes=2"])
    cfg = load("tiny-llama", ["distributed.num_nodes=3", "distributed.nproc_per_node=2",
                              "distributed.master_port=29400"])
    assert cfg.distributed.num_processes == 6  # left out: nodes x per node


def test_across_nodes_replicas_go_a_node_apart_and_a_factor_that_cannot_survive_is_refused():
    from launcher.run.supervise import supervisor_config
    nodes = ["distributed.num_nodes=2", "distributed.master_port=29400",
             "distributed.strategy=fsdp"]
    assert supervisor_config(load("tiny-llama")).replication["offset"] == 1  # ring, one node
    assert supervisor_config(load("tiny-llama", nodes)).replication["offset"] == 2  # next node
    with pytest.raises(RecipeError, match="cannot survive the loss of a node"):
        supervisor_config(load("tiny-llama", nodes + ["checkpointless.replication.factor=3"]))
    with pytest.raises(RecipeError, match="this run has one node"):
        supervisor_config(load("tiny-llama", ["checkpointless.replication.placement=nodes"]))
