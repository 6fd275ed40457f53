"""Pure parts of the tensor-parallel Serve layer: which GPU a rank uses when every GPU of the node stays
visible, rank actor options, and the placement bundles a TP replica gets on CPU."""

from __future__ import annotations

import pytest

from deployments import config as cfg
from deployments.tp_group import NOSET_CUDA_VISIBLE_DEVICES, cuda_index, rank_actor_options


@pytest.mark.parametrize("ids, visible, index", [([3], "0,1,2,3", 3), ([3], "4,3", 1), (["2"], None, 2), ([0], "", 0)])
def test_cuda_index_is_the_position_of_rays_gpu_id(ids, visible, index):
    assert cuda_index(ids, visible) == index


def test_cuda_index_wants_one_gpu_per_rank():
    with pytest.raises(AssertionError, match="exactly one GPU"):
        cuda_index([0, 1], None)


def test_gpu_ranks_keep_every_gpu_visible_cpu_ranks_are_plain():
    gpu = rank_actor_options(cfg.Resources(num_gpus=1, num_cpus=2, accelerator_type="H100"))
    assert gpu["runtime_env"] == {"env_vars": {NOSET_CUDA_VISIBLE_DEVICES: "1"}}
    assert gpu["num_gpus"] == 1 and "accelerator_type" not in gpu  # the bundle claims the accelerator type
    cpu = rank_actor_options(cfg.Resources(num_cpus=0.01))
    assert "runtime_env" not in cpu and cpu["num_cpus"] == 0.01


def test_cpu_tensor_parallel_replica_gets_packed_bundles_or_a_clear_error():
    c = cfg.AppConfig(redis_url="redis://r:6379/0", target={"tensor_parallel_size": 2, "resources": {"num_cpus": 0.01}})
    o = cfg.deployment_options(c)[cfg.TARGET]
    assert o["placement_group_bundles"] == [{"CPU": 0.01}] * 2 and o["placement_group_strategy"] == "STRICT_PACK"
    with pytest.raises(ValueError, match="needs num_cpus > 0 per worker"):
        cfg.deployment_options(cfg.AppConfig(redis_url="redis://r:6379/0", target={"tensor_parallel_size": 2}))


def test_tp_allreduce_is_a_setting_of_tensor_parallel_cuda_targets():
    gpu = {"tensor_parallel_size": 2, "device": "cuda", "dtype": "bfloat16", "resources": {"num_gpus": 1}}
    assert cfg.AppConfig(target=gpu).target.tp_allreduce == "auto"
    assert cfg.AppConfig(target={**gpu, "tp_allreduce": "fused"}).target.tp_allreduce == "fused"
    with pytest.raises(ValueError, match="tp_allreduce='symm' applies to tensor-parallel CUDA targets"):
        cfg.AppConfig(target={**gpu, "device": "cpu", "tp_allreduce": "symm"})
    with pytest.raises(ValueError, match=r"tensor_parallel_size=1, device='cuda'"):
        cfg.AppConfig(target={**gpu, "tensor_parallel_size": 1, "tp_allreduce": "fused"})
    with pytest.raises(ValueError, match="tp_allreduce"):
        cfg.AppConfig(target={**gpu, "tp_allreduce": "ring"})


def test_enabling_symmetric_memory_says_nothing_where_torch_no_longer_needs_it(tmp_path):
    """torch >= 2.8 deprecates `enable_symm_mem_for_group` with a FutureWarning on every call (every rank, every
    setup); `enable_symmetric_memory` still calls it (older torch needs it) without the warning."""
    import warnings

    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from pipeline.models.tp_allreduce import enable_symmetric_memory

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    try:
        name = dist.group.WORLD.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # the negative control: the plain call warns here
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                symm_mem.enable_symm_mem_for_group(name)
            if not any(issubclass(w.category, FutureWarning) for w in seen):
                pytest.skip("this torch does not deprecate enable_symm_mem_for_group")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            enable_symmetric_memory(name)
    finally:
        dist.destroy_process_group()
