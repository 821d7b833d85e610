"""What a stage on a TPU pod is, whichever launcher starts it (`launch.xpk`: xpk workloads; `launch.gcluster`:
Cluster Toolkit jobs): the checks of a recipe against the slice it is launched on, made before any pod starts.

`check_on_slice(recipe, stage, tpu, num_slices)` holds the rules that otherwise fail only on the pod, once every host
has started: the train mesh must fit the slice's chips, the global batch must split over the mesh's batch axes and
over the hosts (`train.step`, `train.loop.build_run`).
"""

from __future__ import annotations

from typing import Any

from dflash.configs.schema import require
from dflash.launch.tpus import TpuType
from dflash.train.config import mesh_shape

STAGES = ("regenerate", "capture", "train", "eval")
MULTI_HOST_STAGES = ("train",)


def check_on_slice(recipe: Any, stage: str, tpu: TpuType, num_slices: int) -> None:
    """Refuse (ConfigError naming the field, the value and the rule) a recipe whose `stage` cannot run on
    `num_slices` x `tpu`: for `train`, `train.mesh` must multiply to the slices' chips (one JAX device each) and
    `train.batch_size` must be a multiple of mesh data x fsdp and of the host count."""
    if stage != "train":
        return
    chips, hosts = tpu.chips * num_slices, tpu.hosts * num_slices
    where = f"{num_slices} x {tpu.name}" if num_slices > 1 else tpu.name
    try:
        data, fsdp, _ = mesh_shape(recipe.train.mesh, chips)
    except ValueError as err:
        raise type(err)(f"{err} (on {where}: {chips} chips)") from None
    batch = recipe.train.batch_size
    require(batch % (data * fsdp) == 0, "train.batch_size", batch,
            f"be a multiple of mesh data x fsdp = {data * fsdp} on {where} ({chips} chips)")
    require(batch % hosts == 0, "train.batch_size", batch,
            f"be a multiple of the host count {hosts} of {where} (each host reads its rows of every batch)")


__all__ = ["MULTI_HOST_STAGES", "STAGES", "check_on_slice"]
