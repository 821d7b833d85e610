"""The `dflash data` stages, one function each: regenerate, capture, inspect (docs/design.md §2).

    dflash data regenerate   prompts (data.prompts mix) -> the target answers every user turn (engine AR
                             mode) -> data.dir/regenerated.jsonl                  (resumable, item by item)
    dflash data capture      data.source conversations -> chat tokens + assistant-only mask ->
                             target features of the drafter's layer ids -> data.dir/shards (resumable,
                             shard by shard); then `dflash train data.features=offline` reads them
    dflash data walk         data.source rows -> greedy DFlash decode of their prompts with a drafter (teacher-
                             forced from the stored answers or a capture's features, or through the engine)
                             -> data.dir/walk/ (the block starts serving visits and the drafts each accepted;
                             resumable, row chunk by chunk)
    dflash data inspect      the manifest, the counts, one decoded sample with its loss mask shown

Each takes the whole recipe and returns what it did; the CLI prints it.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np

from dflash.configs.recipe import Recipe
from dflash.data.capture import CaptureFormat, CaptureReport, CaptureRun, capture, examples_hash
from dflash.data.examples import build_examples
from dflash.data.manifest import PART_NAME, PARTS_DIR, Manifest, Provenance, load_manifest, read_manifest_file
from dflash.data.regen_store import count_lines, errors_path, merge_parts, part_files, parts_dir
from dflash.data.regenerate import RegenStats, make_regen_engine, regenerate
from dflash.data.scaleout import Share, barrier, local_devices, process_tag, replica_backend
from dflash.data.shards import RecordSource, merge_shares, part_state_files
from dflash.data.sources import MixStats, mix, mix_spec, tokenizer_counter
from dflash.data.walk import WalkMode, WalkSummary, run_walk
from dflash.models.placement import log_memory_per_device
from dflash.models.target import Target, load_target

log = logging.getLogger(__name__)

LOSS_OPEN, LOSS_CLOSE = "\u27e6", "\u27e7"  # ⟦ ⟧ around the tokens the loss reads, in `inspect`


def run_regenerate(recipe: Recipe, *, target: Target | None = None, progress: bool = True,
                   share: Share | None = None, merge: bool = True) -> tuple[MixStats, RegenStats, Path]:
    """Mix the prompts of `data.prompts`, then regenerate their answers with the target into
    data.dir/regenerated.jsonl (a rerun continues where the last one stopped).

    Over a slice (`data.scaleout`): each process answers its share of the items (by id; `share`, default this
    process's place in the JAX run), with one engine replica per local device (`data.regen.replicas`) or through
    `data.regen.endpoint`; then, once every process is done, process 0 merges the shares into one file sorted by
    id (`merge`), the same whatever the topology."""
    cfg = recipe.data
    if share is None and merge:
        # meet once at the start, while the processes are in step: on CPU the first collective sets up gloo's
        # connections, which time out after 30 s; set up, the final barrier may wait as long as the shares take
        barrier("dflash-data-regenerate-start")
    spec = mix_spec(cfg)
    counter = None
    if spec.filters_length:
        counter = tokenizer_counter(target.tokenizer if target is not None else recipe_tokenizer(recipe))
    items, mix_stats = mix(spec, count_tokens=counter)
    share = share if share is not None else Share.of_process()
    tag = process_tag() if share.count > 1 else ""
    log.info("%sprompt mix:\n%s", tag, mix_stats.summary())
    out = cfg.regenerated_path
    out.parent.mkdir(parents=True, exist_ok=True)
    mine = [item for item in items if share.owns(str(item["id"]))] if share.count > 1 else items
    if share.count > 1:
        log.info("%sthis process answers %d of the %d items (share %d of %d, by item id)", tag, len(mine),
                 len(items), share.index, share.count)
    kwargs = {"progress": progress, "label": f"{tag}regenerate", "share": share.pair, "merge": False}
    if cfg.regen.endpoint.url:  # an OpenAI-compatible server answers: the tokenizer is all this process needs
        from dflash.data.endpoint import connect

        tokenizer = target.tokenizer if target is not None else recipe_tokenizer(recipe)
        backend: Any = connect(cfg.regen, tokenizer, target_source=recipe.target.source)
    else:
        target = target if target is not None else load_target(recipe.target)
        tokenizer = target.tokenizer
        groups = local_devices(cfg.regen.replicas, cfg.regen.devices_per_replica)
        one_device = len(groups) == 1 and len(groups[0]) == 1
        backend = (make_regen_engine(target, slots=cfg.regen.slots, max_len=cfg.regen.max_len) if one_device
                   else replica_backend(target, cfg.regen, groups))
        log_memory_per_device(f"{tag}regenerate")  # the target and each replica's pages, before the first answer
    stats = regenerate(backend, tokenizer, mine, out, cfg.regen, **kwargs)
    if merge:
        barrier("dflash-data-regenerate")
        if share.index == 0:
            merge_parts(out)
        barrier("dflash-data-regenerate-merged")
    return mix_stats, stats, out


def recipe_tokenizer(recipe: Recipe) -> Any:
    """The target's tokenizer alone (no weights loaded)."""
    from dflash.models.registry import resolve_source
    from dflash.models.tokenizer import load_tokenizer

    return load_tokenizer(resolve_source(recipe.target.source))


def run_capture(recipe: Recipe, *, target: Target | None = None, progress: bool = True,
                share: Share | None = None, merge: bool = True) -> CaptureReport:
    """Store the target features of `data.source`'s rows (the drafter's layer ids, seq_len) in data.dir/shards,
    with the target's next-token labels when `data.labels` is `target`; a rerun resumes at the first unfinished
    shard.

    Over a slice, as regeneration (`data.scaleout`): process p of P captures the shards i with i % P == p (`share`,
    default this process's place in the JAX run) into the one shared directory, each batch on one of this
    process's replicas (`data.capture_replicas` groups of `data.capture_devices_per_replica` local devices); once
    every process is done, process 0 writes the manifest (`merge`). The shards do not depend on the topology."""
    cfg = recipe.data
    share = share if share is not None else Share.of_process()
    if share.count > 1 and merge:
        barrier("dflash-data-capture-start")  # set up the collectives while the processes are in step (regenerate)
    target = target if target is not None else load_target(recipe.target)
    arch = target.drafter_arch(recipe.drafter)
    examples, _ = build_examples(cfg, target.tokenizer)  # the trainer's rows
    groups = local_devices(cfg.capture_replicas, cfg.capture_devices_per_replica,
                           fields=("data.capture_replicas", "data.capture_devices_per_replica"))
    tag = process_tag() if share.count > 1 else ""
    log.info("%scapture: %d replica(s) on %s%s", tag, len(groups),
             "; ".join(", ".join(str(d) for d in group) for group in groups),
             f"; shards i with i % {share.count} == {share.index}" if share.count > 1 else "")
    fmt = CaptureFormat(seq_len=cfg.seq_len, samples_per_shard=cfg.samples_per_shard, compression=cfg.compression,
                        target_labels=cfg.labels != "text", target_topk=cfg.soft_topk if cfg.labels == "soft" else 0)
    run = CaptureRun(batch_size=cfg.capture_batch_size, devices=groups,
                     share=(share.index, share.count), progress=progress, label=f"{tag}capture")
    report = capture(target, target.cfg, Provenance.of_target(target), examples, arch.layer_ids, cfg.shard_dir,
                     fmt=fmt, run=run)
    if share.count == 1 or not merge:
        return report
    barrier("dflash-data-capture")
    if share.index == 0:
        merge_shares(cfg.shard_dir, share.count)
    barrier("dflash-data-capture-merged")
    manifest = load_manifest(cfg.shard_dir)
    return dataclasses.replace(report, manifest=manifest, bytes_per_token=manifest.bytes_per_token)


def run_walk_stage(recipe: Recipe, *, drafter: str = "", step: int | str | None = None, mode: str = "teacher",
                   limit: int = 0, slots: int = 8, target: Target | None = None, progress: bool = True) -> WalkSummary:
    """Walk `data.source`'s training rows (`build_examples`, the trainer's rows) with the drafter at `drafter` (a
    run dir, its `best`, or an export; default: train.run_dir's latest checkpoint) into data.dir/walk/."""
    from dflash.models.drafter_io import load_drafter

    target = target if target is not None else load_target(recipe.target)
    source = drafter or recipe.train.run_dir
    loaded = load_drafter(source, target.cfg, step=step)
    examples, _ = build_examples(recipe.data, target.tokenizer)
    digest = examples_hash(examples)
    stored = None
    if mode == "stored":  # the capture's features (bf16) and, when it holds them, the target's next ids
        manifest = load_manifest(recipe.data.shard_dir)
        if manifest.examples_hash != digest:
            raise ValueError(f"--mode stored reads the capture in {recipe.data.shard_dir}, which holds other rows "
                             f"(examples_hash {manifest.examples_hash[:12]}, these rows {digest[:12]}); capture again")
        source_rows = RecordSource(recipe.data.shard_dir, manifest)

        def stored(i: int) -> tuple[np.ndarray, np.ndarray | None]:
            sample = source_rows.read_one(i)
            return sample.features, sample.next_ids

    return run_walk(examples, loaded, target, recipe.data.dir, examples_hash=digest,
                    mode=WalkMode(mode, slots, stored), drafter_source=str(source), limit=limit, progress=progress)


def inspect_data(recipe: Recipe, sample: int = 0, tokenizer: Any = None) -> str:
    """A report of data.dir: regeneration counts, the capture manifest, and sample `sample` of the capture
    decoded with the loss-masked tokens between ⟦ ⟧."""
    cfg = recipe.data
    lines = [f"data.dir: {cfg.dir}"]
    regen = cfg.regenerated_path
    parts = part_files(regen)
    if regen.is_file() or parts:
        done, kinds = count_lines([regen, errors_path(regen)])
        lines.append(f"regenerated: {done} conversations in {regen.name}; errors: "
                     + (", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) or "none"))
        if parts:
            pending, pending_kinds = count_lines(parts)
            lines.append(f"  and {pending} conversations, {sum(pending_kinds.values())} errors in {len(parts)} "
                         f"unmerged chunk(s) under {parts_dir(regen).name}/ (a run in progress or stopped: a rerun of "
                         "`dflash data regenerate` finishes and merges them)")
    else:
        lines.append(f"regenerated: none ({regen.name} not written yet: dflash data regenerate)")
    shares = [path for path in part_state_files(cfg.shard_dir) if PART_NAME.fullmatch(path.name)]
    if shares:
        finished = {entry.file for path in shares for entry in read_manifest_file(path).shards}
        lines.append(f"capture: {len(finished)} shards finished by {len(shares)} share(s) under "
                     f"{cfg.shard_dir / PARTS_DIR} (a multi-process capture in progress or stopped: a rerun of "
                     "`dflash data capture` finishes and merges them)")
    if not (cfg.shard_dir / "manifest.json").is_file():
        if not shares:
            lines.append(f"capture: none ({cfg.shard_dir} has no manifest.json: dflash data capture)")
        return "\n".join(lines)
    manifest = load_manifest(cfg.shard_dir, allow_incomplete=True)
    lines += _manifest_lines(manifest)
    if not manifest.shards:
        return "\n".join(lines)
    if tokenizer is None:
        tokenizer = recipe_tokenizer(recipe)
    finished = sum(e.samples for e in manifest.shards)
    if not 0 <= sample < finished:
        raise ValueError(f"sample must lie in [0, {finished}) (the captured samples); received {sample}")
    source = RecordSource(cfg.shard_dir, manifest)
    try:
        record = source.read_one(sample)
    finally:
        source.close()
    magnitude = float(np.abs(record.features.astype(np.float32)).mean())
    lines.append(f"sample {sample} ({source.where(sample)}): {len(record.tokens)} tokens, "
                 f"{int(record.loss_mask.sum())} in the loss (between {LOSS_OPEN} {LOSS_CLOSE}), features "
                 f"{record.features.shape[1]} wide, mean |feature| {magnitude:.3f}")
    lines.append(render_masked(tokenizer, record.tokens, record.loss_mask))
    return "\n".join(lines)


def _manifest_lines(m: Manifest) -> list[str]:
    size = sum(e.bytes for e in m.shards)
    return [
        f"capture: {'complete' if m.complete else 'INCOMPLETE'}, {sum(e.samples for e in m.shards)} of "
        f"{m.num_samples} samples in {len(m.shards)} of {m.num_shards} shards, {m.total_tokens} tokens, "
        f"{size / 2**20:.1f} MiB ({m.bytes_per_token:.0f} bytes/token)",
        f"  target {m.target_name} (weights sha256 {m.target_fingerprint[:12]}), tokenizer "
        f"{m.tokenizer_fingerprint[:12]}, chat template {m.chat_template_hash[:12]}",
        f"  layer_ids {list(m.layer_ids)}, hidden {m.hidden_size}, feature_dim {m.feature_dim} ({m.feature_dtype}), "
        f"seq_len {m.seq_len}, pad_id {m.pad_id}, {m.writer_options}",
        f"  examples sha256 {m.examples_hash[:12]}, format v{m.format_version}, labels: "
        + (f"the target's top-{m.target_topk} (data.labels=soft)" if m.target_topk
           else "the target's next ids (data.labels=target)" if m.target_labels else "none (data.labels=text)"),
    ]


def render_masked(tokenizer: Any, tokens: np.ndarray, loss_mask: np.ndarray) -> str:
    """The text of `tokens` with each run of loss-masked tokens between ⟦ ⟧ (special tokens shown)."""
    out, start = [], 0
    mask = np.asarray(loss_mask).astype(bool)
    for i in range(1, len(tokens) + 1):
        if i == len(tokens) or mask[i] != mask[start]:
            text = tokenizer.decode([int(t) for t in tokens[start:i]], skip_special_tokens=False)
            out.append(f"{LOSS_OPEN}{text}{LOSS_CLOSE}" if mask[start] else text)
            start = i
    return "".join(out)


__all__ = ["inspect_data", "render_masked", "run_capture", "run_regenerate", "run_walk_stage"]
