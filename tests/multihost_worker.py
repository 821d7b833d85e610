"""One process of the multi-host checks in tests/test_multihost.py (not a test module): run as
`python tests/multihost_worker.py ACTION[:DIR] ...` (the actions in order, in one JAX run) with
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID set for a `jax.distributed` run on localhost, or
without them for one process; CPU devices from XLA_FLAGS.

Actions (each prints `OK <action> process i/n` at the end; any failed check raises):
- `data`: every process reads its Grain shard of the online batches (`data.online.make_batches` with
  shard_index = process index), the global batch is assembled with `jax.make_array_from_process_local_data`
  (`train.sharding.shard_batch`) and gathered back: it must equal the one-process global batch, and the hosts'
  rows must be disjoint.
- `write`: a TrainState of the tiny recipe's drafter, created sharded over all processes' devices (fsdp), moved
  off its init by a deterministic update, saved with the trainer's Checkpointer (every process writes its shards).
- `read`: the same state restored onto this run's mesh (whatever process and device count wrote it); every
  addressable shard must equal the state this run computes itself.
- `place`: a target read straight onto the mesh of every process's devices (fsdp): each process reads from the
  safetensors only the values its devices' shards hold (the sharded leaves' half on 2 processes, nothing of the
  other's), each local device holds at most 1/N of the target plus its largest unsharded leaf plus PLACE_SLACK, and
  the gathered arrays equal the whole load; the default target (a GGUF) placed the same way holds the same bound.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

STEP = 3
PLACE_SLACK = 64 << 10  # bytes a device may hold beyond its share of a placed target
GLOBAL_BATCH = 4
STEPS = 5  # batches compared (past an epoch boundary of the 12 toy examples)
META = {"arch": {"recipe": "tiny", "seed": 5}}


def _init() -> None:
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], int(os.environ["JAX_NUM_PROCESSES"]),
                                   int(os.environ["JAX_PROCESS_ID"]))


def _mesh():
    from dflash.train.config import MeshConfig
    from dflash.train.sharding import make_mesh

    return make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1))  # every device of every process on fsdp


def _arch_and_optimizer():
    from dflash.configs.recipe import load_recipe
    from dflash.models.drafter import resolve_drafter
    from dflash.models.registry import known_target
    from dflash.train.loop import make_train_optimizer

    recipe = load_recipe("tiny")
    known = known_target(recipe.target.source)
    return resolve_drafter(recipe.drafter, known.cfg, known.mask_token_id), make_train_optimizer(recipe.train)


def _expected_state(mesh):
    """The tiny drafter's fresh state (seed 5), created sharded on `mesh`, then params * 1.5 + 0.25 and step 3:
    the same values whatever the mesh (jax's partitionable threefry)."""
    from dflash.train.loop import create_state

    arch, optimizer = _arch_and_optimizer()
    state, shardings = create_state(5, arch, optimizer, mesh)
    moved = jax.jit(lambda s: dataclasses.replace(s, params=jax.tree.map(lambda p: p * 1.5 + 0.25, s.params),
                                                  step=s.step + STEP), out_shardings=shardings)(state)
    return moved, shardings, arch, optimizer


def write(directory: Path) -> None:
    from dflash.train.checkpoint import Checkpointer

    state, _, _, _ = _expected_state(_mesh())
    ckpt = Checkpointer(directory, META, keep=2)
    ckpt.save(STEP, state, {"iterator": {"next_index": 7}, "data_fingerprint": "multihost"})
    ckpt.close()


def read(directory: Path) -> None:
    from dflash.train.checkpoint import Checkpointer
    from dflash.train.loop import state_layout

    mesh = _mesh()
    want, _, arch, optimizer = _expected_state(mesh)
    abstract, shardings = state_layout(5, arch, optimizer, mesh)
    ckpt = Checkpointer(directory, META, keep=2)
    try:
        assert ckpt.latest_step() == STEP, ckpt.all_steps()
        got, data_state = ckpt.restore(STEP, abstract, shardings)
    finally:
        ckpt.close()
    assert data_state == {"iterator": {"next_index": 7}, "data_fingerprint": "multihost"}, data_state
    flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
    flat_want = jax.tree_util.tree_flatten_with_path(want)[0]
    assert [p for p, _ in flat_got] == [p for p, _ in flat_want]
    checked = 0
    for (path, g), (_, w) in zip(flat_got, flat_want, strict=True):
        assert g.sharding == w.sharding, (jax.tree_util.keystr(path), g.sharding, w.sharding)
        for gs, ws in zip(g.addressable_shards, w.addressable_shards, strict=True):
            assert gs.index == ws.index
            np.testing.assert_array_equal(np.asarray(gs.data), np.asarray(ws.data), err_msg=jax.tree_util.keystr(path))
            checked += 1
    assert int(jax.device_get(got.step)) == STEP
    sharded = [g for _, g in flat_got if len(g.sharding.device_set) > 1 and not g.sharding.is_fully_replicated]
    assert not jax.process_count() > 1 or sharded, "nothing was sharded across processes"
    print(f"checked {checked} shards of {len(flat_got)} arrays", flush=True)


def data() -> None:
    from jax.experimental import multihost_utils

    from dflash.data.online import make_batches
    from dflash.train.sharding import shard_batch

    examples = [(np.full(6, i, np.int32), np.ones(6, np.float32)) for i in range(12)]
    hosts, me = jax.process_count(), jax.process_index()
    mesh = _mesh()
    mine = make_batches(examples, GLOBAL_BATCH // hosts, seed=3, shard_index=me, shard_count=hosts)
    whole = make_batches(examples, GLOBAL_BATCH, seed=3)
    for _ in range(STEPS):
        local = next(mine)
        ids = multihost_utils.process_allgather(jnp.asarray(local.tokens[:, 0]), tiled=False)  # [hosts, B/hosts]
        flat = np.asarray(ids).reshape(-1).tolist()
        assert len(set(flat)) == len(flat), f"hosts' rows overlap: {np.asarray(ids).tolist()}"
        batch = shard_batch(local, mesh)  # the global arrays the train step reads
        tokens = np.asarray(multihost_utils.process_allgather(batch.tokens, tiled=True))
        expected = next(whole)
        np.testing.assert_array_equal(tokens, expected.tokens)
        assert tokens.shape == (GLOBAL_BATCH, 6)


def place() -> None:
    import math

    from jax.experimental import multihost_utils

    from dflash.models.config import TargetConfig
    from dflash.models.loading import load_hf_dir, open_hf_dir
    from dflash.models.placement import put, resident_bytes
    from dflash.models.regions import Lazy, SafetensorsFile
    from dflash.models.sharding import TARGET_RULES, path_str, spec_for, tree_shardings
    from dflash.models.target import load_target

    golden = Path(__file__).resolve().parent / "golden" / "tiny" / "qwen3_untied"
    mesh = _mesh()
    n = mesh.devices.size
    local = jax.local_devices()
    read_values = []
    original = SafetensorsFile.read

    def counting(self, name, index, raw=False):
        out = original(self, name, index, raw)
        read_values.append(out.size)
        return out

    SafetensorsFile.read = counting

    def bound(weights):
        flat = jax.tree_util.tree_flatten_with_path(weights, is_leaf=lambda x: isinstance(x, Lazy))[0]
        total = sum(math.prod(x.shape) for _, x in flat) * 4
        whole = [math.prod(x.shape) * 4 for p, x in flat if not any(spec_for(path_str(p), tuple(x.shape),
                                                                               TARGET_RULES, mesh))]
        return total // n + max(whole, default=0) + PLACE_SLACK, total

    _, whole = load_hf_dir(golden)
    _, weights = open_hf_dir(golden)
    read_values.clear()  # the whole load above read everything; count the placement's reads alone
    limit, total = bound(weights)
    before = resident_bytes(local)
    placed = put(weights, tree_shardings(whole, TARGET_RULES, mesh), [np.float32])
    after = resident_bytes(local)
    held = {d.id: after[d] - before[d] for d in local}
    assert max(held.values()) <= limit, (held, limit)
    mine = sum(math.prod(s.data.shape) for x in jax.tree.leaves(placed) for s in x.addressable_shards
               if s.replica_id == 0 or x.sharding.is_fully_replicated and s.device == local[0])
    assert sum(read_values) <= mine, (sum(read_values), mine)
    assert sum(read_values) < 0.6 * total // 4, (sum(read_values), total // 4)  # about half the values, never all
    for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(np.asarray(multihost_utils.process_allgather(got, tiled=True)), want)
    SafetensorsFile.read = original

    target = load_target(TargetConfig(source="smollm2", dtype="float32", max_seq_len=256))
    limit, _ = bound(target.weights)
    before = resident_bytes(local)
    smol = target.on(mesh)
    after = resident_bytes(local)
    held = {d.id: after[d] - before[d] for d in local}
    assert max(held.values()) <= limit, (held, limit)
    assert "params" not in target.__dict__
    print(f"placed: read {sum(read_values)} of {total // 4} values; smollm2 per device {held} (bound {limit})",
          flush=True)
    del smol


def main() -> None:
    _init()
    for arg in sys.argv[1:]:
        action, _, directory = arg.partition(":")
        if action == "data":
            data()
        elif action == "place":
            place()
        else:
            {"write": write, "read": read}[action](Path(directory))
        print(f"OK {action} process {jax.process_index()}/{jax.process_count()} devices {jax.device_count()}",
              flush=True)


if __name__ == "__main__":
    main()
