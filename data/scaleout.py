"""Regeneration over a whole slice (docs/design.md §6, "data stages scale out, not up"): every process answers a
deterministic share of the prompts, every local device runs an engine replica, each share resumes on its own, and
the shares merge into the one file the loaders read.

    share = Share.of_process()                      # (jax.process_index(), jax.process_count())
    mine = [item for item in items if share.owns(item["id"])]
    backend = replica_backend(target, cfg.regen, local_devices(cfg.regen.replicas, cfg.regen.devices_per_replica))
    regenerate(backend, tokenizer, mine, out, cfg.regen, share=share.pair, merge=False)   # chunks of this share
    barrier(); if process 0: merge_parts(out)       # -> out, sorted by id (data.regen_store)

Why the result does not depend on the topology: a conversation's output depends only on its own requests (the
prompt and the seed `request_seed(seed, item id, turn)`), never on its batch neighbours, its replica or its
process (the engine's batch invariance, tests/test_engine.py); the share of an item is a function of its id; the
merged file is sorted by id. Greedy output on 1 device, 4 devices and 2 processes x 2 devices is identical
(tests/test_data_regenerate.py, tests/test_multiprocess.py), sampled output too, seeded by item id.

Files (`data.regen_store`): process p of P writes its chunks `<out>.parts/part-<p>-of-<P>-<n>.jsonl`, each many
conversations written whole (a bucket takes about one write per second per object). A rerun counts as done every
id in `<out>`, in its errors file and in any chunk of any topology, so a run may resume on another slice. Process 0
merges after all processes finished: every record of `<out>` and the chunks, each id once, sorted by id, written
atomically, then the chunks removed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import queue
import threading
from collections.abc import Hashable, Sequence
from typing import Any

from dflash.data.config import RegenConfig
from dflash.data.regenerate import ItemError, Reply, completion_reply
from dflash.serve.engine import Engine
from dflash.serve.plan import AR, Limits

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Share:
    """Process `index` of `count`: it answers the items whose id hashes to `index` (sha256, stable everywhere)."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"share index must lie in [0, count); received {self.index} of {self.count}")

    @staticmethod
    def of_process() -> Share:
        import jax

        return Share(jax.process_index(), jax.process_count())

    def owns(self, item_id: str) -> bool:
        return share_of(item_id, self.count) == self.index

    @property
    def pair(self) -> tuple[int, int]:
        """(index, count), as `data.regenerate.regenerate` takes a share."""
        return self.index, self.count


def share_of(item_id: str, count: int) -> int:
    """The share (of `count`) an item id belongs to."""
    return int.from_bytes(hashlib.sha256(item_id.encode("utf-8")).digest()[:8], "little") % count


def barrier(name: str) -> None:
    """Wait for every process (no-op for one)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def local_devices(replicas: int, per_replica: int = 1, *,
                  fields: tuple[str, str] = ("data.regen.replicas", "data.regen.devices_per_replica")
                  ) -> list[tuple[Any, ...]]:
    """The device groups this process runs engine replicas on, `per_replica` consecutive local devices each:
    `replicas` groups, or (0) as many as the local devices hold; on CPU (0) one, since its simulated devices share
    the same cores. `fields` name the two settings in errors."""
    import jax

    devices = jax.local_devices()
    groups = [tuple(devices[i:i + per_replica]) for i in range(0, len(devices) - per_replica + 1, per_replica)]
    if not groups:
        raise ValueError(f"{fields[1]} must be at most this process's {len(devices)} local devices; received "
                         f"{per_replica}")
    if replicas == 0:
        return groups[:1] if devices[0].platform == "cpu" else groups
    if replicas > len(groups):
        raise ValueError(f"{fields[0]} must be at most the {len(groups)} groups of {per_replica} device(s) "
                         f"this process's {len(devices)} local devices hold (0: all); received {replicas}")
    return groups[:replicas]


class _Replica(threading.Thread):
    """One engine on one device, stepped by its own thread (JAX releases the GIL while devices run)."""

    def __init__(self, index: int, engine: Engine, devices: tuple[Any, ...], tokenizer: Any, results: queue.Queue):
        super().__init__(name=f"regen-replica-{index}", daemon=True)
        self.index, self.engine, self.device, self.tok, self.results = index, engine, devices[0], tokenizer, results
        self.inbox: queue.Queue = queue.Queue()
        self.stop_ids = tuple(tokenizer.stop_token_ids)
        self.load = 0  # requests submitted and not yet returned (the main thread's count)

    def run(self) -> None:
        import jax

        try:
            with jax.default_device(self.device):
                while True:
                    waiting = not self.engine.busy
                    while True:
                        try:
                            request = self.inbox.get(block=waiting)
                        except queue.Empty:
                            break
                        if request is None:
                            return
                        self.engine.enqueue(request)
                        waiting = False
                    self.engine.step()
                    for rid in list(self.engine.done):
                        completion = self.engine.done.pop(rid)
                        self.results.put(((self.index, rid), completion_reply(completion, self.tok, self.stop_ids)))
        except BaseException as err:  # noqa: BLE001 - handed to the main thread, which stops the run
            self.results.put((None, err))


class ReplicaBackend:
    """Turns over engine replicas, one per device, each on its own thread (a `data.regenerate.Backend`). A turn
    goes to the least loaded replica; where it runs does not change its reply."""

    def __init__(self, engines: Sequence[Engine], devices: Sequence[Any], tokenizer: Any, cfg: RegenConfig):
        self.cfg = cfg
        self.results: queue.Queue = queue.Queue()
        self.replicas = [_Replica(i, e, d, tokenizer, self.results) for i, (e, d) in enumerate(zip(engines, devices,
                                                                                                    strict=True))]
        self.capacity = sum(e.slots for e in engines)
        self.stop_ids = tuple(tokenizer.stop_token_ids)
        for replica in self.replicas:
            replica.start()

    def submit(self, messages: list[dict[str, str]], prompt_ids: list[int], seed: int, turn: int) -> Hashable:
        replica = min(self.replicas, key=lambda r: (r.load, r.index))
        try:
            request = replica.engine.check(prompt_ids, self.cfg.max_new_tokens, self.stop_ids, seed,
                                           sampling=self.cfg.sampling)
        except ValueError as err:
            raise ItemError("too_long", str(err), turn) from err
        replica.load += 1
        replica.inbox.put(request)
        return (replica.index, request.request_id)

    def poll(self) -> list[tuple[Hashable, Reply | ItemError]]:
        out = [self.results.get()]
        while True:
            try:
                out.append(self.results.get_nowait())
            except queue.Empty:
                break
        for handle, result in out:
            if handle is None:
                self.close()
                raise result
            self.replicas[handle[0]].load -= 1
        return out

    def close(self) -> None:
        for replica in self.replicas:
            replica.inbox.put(None)
        for replica in self.replicas:
            replica.join(timeout=60)


def replica_engines(target: Any, cfg: RegenConfig, groups: Sequence[tuple[Any, ...]]) -> list[Engine]:
    """One AR-mode engine per device group, the target's weights read straight onto each (`Target.on_group`: whole
    on a one-device group, split over a group of several devices in tensor parallel, as `Limits.devices` lays them
    out; no device holds more than its group's share)."""
    import jax

    engines = []
    for group in groups:
        with jax.default_device(group[0]):
            params = target.on_group(group)
            limits = Limits(slots=cfg.slots, max_len=cfg.max_len, devices=len(group))
            engines.append(Engine(params, target.cfg, None, AR(), limits, devices=group))
    return engines


def replica_backend(target: Any, cfg: RegenConfig, groups: Sequence[tuple[Any, ...]]) -> ReplicaBackend:
    """A ReplicaBackend over device `groups` (one engine each)."""
    log.info("regeneration: %d engine replica(s) of %d slots on %s", len(groups), cfg.slots,
             "; ".join(", ".join(str(d) for d in group) for group in groups))
    return ReplicaBackend(replica_engines(target, cfg, groups), groups, target.tokenizer, cfg)


def process_tag() -> str:
    """'[process p/P] ' in a multi-process run, else ''."""
    import jax

    return f"[process {jax.process_index()}/{jax.process_count()}] " if jax.process_count() > 1 else ""


__all__ = ["ReplicaBackend", "Share", "barrier", "local_devices", "process_tag", "replica_backend", "replica_engines",
           "share_of"]
