"""Cloud TPU slice types by their xpk / GKE names (`v5p-128`, `v5litepod-16`, `v6e-256`, `v4-64`): chips, hosts,
physical topology, HBM and peak bf16 FLOP/s per chip. What `dflash launch xpk` checks a stage against and what
`dflash launch compile` compiles for.

Names follow Cloud TPU: for v4 and v5p the number counts TensorCores (2 per chip, `v5p-128` = 64 chips), for v5e
and v6e it counts chips. A slice's chips form a torus whose sides double from the smallest in order (v5p: 2x2x1,
2x2x2, 2x2x4, 2x4x4, 4x4x4, ...), 4 chips per host VM (a single-host v5e / v6e slice has up to 8).
"""

from __future__ import annotations

import dataclasses

from dflash.launch.config import TPU_CORES_PER_CHIP, split_tpu_type

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Generation:
    """One TPU generation: its name in xpk / GKE / jax topologies, cores per chip in the slice name, the torus
    rank, chips per host VM, HBM bytes per chip and peak dense bf16 FLOP/s per chip. HBM is what XLA's TPU compiler
    (libtpu 0.0.50) reports as available in its out-of-memory errors (v5p 95.73G, v5e 15.75G, v6e 31.24G, v4 30.75G,
    in GiB); the FLOP/s are Cloud TPU's published peaks."""

    xpk: str
    gke: str
    jax: str
    cores_per_chip: int
    dims: int
    chips_per_host: int
    max_single_host_chips: int
    hbm_bytes: int
    peak_flops: float


_C = TPU_CORES_PER_CHIP  # the slice-name rule's table (launch/config.py), so names and generations agree
GENERATIONS: dict[str, Generation] = {
    "v4": Generation("v4", "tpu-v4-podslice", "v4", _C["v4"], 3, 4, 4, round(30.75 * GIB), 275e12),
    "v5p": Generation("v5p", "tpu-v5p-slice", "v5p", _C["v5p"], 3, 4, 4, round(95.73 * GIB), 459e12),
    "v5litepod": Generation("v5litepod", "tpu-v5-lite-podslice", "v5e", _C["v5litepod"], 2, 4, 8,
                            round(15.75 * GIB), 197e12),
    "v6e": Generation("v6e", "tpu-v6e-slice", "v6e", _C["v6e"], 2, 4, 8, round(31.24 * GIB), 918e12),
}


@dataclasses.dataclass(frozen=True)
class TpuType:
    """A TPU slice type, e.g. `v5p-128`: 64 chips on 16 hosts in a 4x4x4 torus."""

    name: str
    gen: Generation
    chips: int
    shape: tuple[int, ...]

    @property
    def hosts(self) -> int:
        """Host VMs (= xpk pods) per slice."""
        if self.chips <= self.gen.max_single_host_chips:
            return 1
        return self.chips // self.gen.chips_per_host

    @property
    def topology(self) -> str:
        """The physical torus, e.g. `4x4x4` (GKE's `gke-tpu-topology`)."""
        return "x".join(str(d) for d in self.shape)

    @property
    def jax_topology(self) -> str:
        """The name `jax.experimental.topologies.get_topology_desc` takes, e.g. `v5p:4x4x4`."""
        return f"{self.gen.jax}:{self.topology}"

    @property
    def hbm_bytes(self) -> int:
        return self.gen.hbm_bytes

    @property
    def peak_flops(self) -> float:
        return self.gen.peak_flops


def torus(chips: int, dims: int) -> tuple[int, ...]:
    """The torus of `chips` chips: from 2x2 (x1), double the rightmost smallest side until it holds them all."""
    if dims == 3 and chips <= 4:
        return {1: (1, 1, 1), 2: (1, 2, 1), 4: (2, 2, 1)}[chips]
    if dims == 2 and chips <= 4:
        return {1: (1, 1), 2: (1, 2), 4: (2, 2)}[chips]
    shape = [2, 2] + [1] * (dims - 2)
    while shape[0] * shape[1] * (shape[2] if dims == 3 else 1) < chips:
        smallest = min(shape)
        i = max(j for j, s in enumerate(shape) if s == smallest)
        shape[i] *= 2
    return tuple(shape)


def parse_tpu_type(name: str, field: str = "--tpu-type") -> TpuType:
    """`v5p-128` -> TpuType; ConfigError naming `field`, the known generations and the rule otherwise
    (`launch.config.split_tpu_type`, which a recipe's `launch.tpu_type` is checked by)."""
    gen_name, size, chips = split_tpu_type(name, field)
    gen = GENERATIONS[gen_name]
    return TpuType(name=f"{gen.xpk}-{size}", gen=gen, chips=chips, shape=torus(chips, gen.dims))


__all__ = ["GENERATIONS", "Generation", "TpuType", "parse_tpu_type", "torus"]
