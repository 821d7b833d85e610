"""`dflash export` (= `dflash-export`): a trained drafter (a `dflash train` run dir, Orbax) -> the Hugging Face
layouts vLLM, SGLang and speculators load, with a model card, optionally pushed to the Hub in one commit.

Layouts (docs/design.md §4.5): `zlab` (`models.zlab`: config.json + model.safetensors, + `dflash.py` when
`modeling_file` is given) and `speculators` (`models.speculators`). Both are written into a hidden
temporary directory beside `out` (`.<name>.tmp-<pid>`), fsynced, and renamed to `out` at the end: an
interrupted export leaves no directory that looks complete (a leftover temporary directory is removed by
the next export to the same place). An existing `out` is refused unless `overwrite`.

`dry_run` builds the export in a temporary directory, lists every file with its size (and the Hub upload it
would make), writes nothing to `out` and sends nothing.

The target an export is made for (`export_target`): the `target:` section of recipe `config` with `overrides`
(`--config NAME|PATH`), or else of the recipe recorded in the run's checkpoint (`target.*` overrides applied).
Its `source` names the target in the card's serving lines and the speculators verifier entry (unless `target`,
a Hub id, is given), and the drafter is checked against its architecture, read without weights
(`models.registry.known_target`: a known target or a Hugging Face directory's config.json).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.configs.recipe import load_recipe
from dflash.configs.schema import ConfigError, apply_overrides, build
from dflash.data.files import fsync_path, fsync_tree
from dflash.export.card import best_results, find_results, read_results, render_card, target_id
from dflash.export.hub import Upload, plan_upload, upload_folder
from dflash.models.config import TargetConfig
from dflash.models.drafter import DrafterArch, check_fits_target, hf_tensor_names, param_count
from dflash.models.drafter_io import RunDrafter, best_or_latest, read_run
from dflash.models.registry import KnownTarget, known_target
from dflash.models.speculators import save_speculators
from dflash.models.zlab import DTYPES, MODELING_FILE, check_exportable_ids, save_zlab

FORMATS = ("zlab", "speculators")


@dataclass(frozen=True)
class ExportLayout:
    """What an export writes: the layout `fmt` (`zlab` or `speculators`), its tensors' `dtype`, and z-lab's
    modelling file shipped as dflash.py beside the z-lab layout (`modeling_file`, zlab only; transformers' remote
    code)."""

    fmt: str
    dtype: str = "float32"
    modeling_file: str | Path | None = None


@dataclass(frozen=True)
class ExportFor:
    """The target an export is made for: the recipe `config` (a name or YAML path) with its `overrides` (default: the
    run's recorded recipe), and `target`, its Hub id for the card and the speculators verifier entry (default:
    derived from that recipe's target.source)."""

    config: str | None = None
    overrides: tuple[str, ...] | list[str] = ()
    target: str | None = None


@dataclass(frozen=True)
class HubPush:
    """Where an export is uploaded: the Hub repo `repo_id` (made `private` when created), at `revision`, on `endpoint`
    (default: huggingface.co), with `token` (default: the Hub client's own, e.g. HF_TOKEN)."""

    repo_id: str
    private: bool = False
    revision: str | None = None
    endpoint: str | None = None
    token: str | None = None


@dataclass(frozen=True)
class ExportResult:
    """What an export did: the files (name, bytes) in order, where they went, and the drafter's step."""

    files: list[tuple[str, int]]
    out: Path | None
    step: int | None
    upload: Upload | None
    commit_url: str | None
    dry_run: bool


def human_size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _check_args(fmt: str, dtype: str, out: Path | None, push_to_hub: str | None, overwrite: bool,
                modeling_file: Path | None) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {list(FORMATS)}; received {fmt!r}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}; received {dtype!r}")
    if out is None and push_to_hub is None:
        raise ValueError("an export needs --out DIR, --push-to-hub REPO, or both; received neither")
    if out is not None and out.exists() and not overwrite:
        raise FileExistsError(f"--out {out} exists; pass --overwrite to replace it (the new export is written "
                              "beside it first and swapped in at the end)")
    if out is not None and out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} exists and is not a directory; choose another --out")
    if modeling_file is not None:
        if fmt != "zlab":
            raise ValueError("--modeling-file ships z-lab's remote code with the z-lab layout; it has no place in "
                             "--format speculators")
        if not modeling_file.is_file():
            raise FileNotFoundError(f"--modeling-file {modeling_file} does not exist (z-lab's dflash/model.py)")


def _staging_dir(out: Path | None) -> Path:
    """A fresh temporary directory beside `out` (same filesystem: the final rename is atomic), or anywhere."""
    if out is None:
        return Path(tempfile.mkdtemp(prefix="dflash-export-"))
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.tmp-*"):  # left by an export that was killed
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    staging = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid != os.getpid()


def _finalize(staging: Path, out: Path) -> None:
    """fsync everything, then swap `staging` in as `out` (an existing `out` is replaced only now)."""
    fsync_tree(staging)
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    staging.rename(out)
    fsync_path(out.parent)
    shutil.rmtree(old, ignore_errors=True)


def recorded_target(meta: dict[str, Any] | None, overrides: list[str] | tuple[str, ...] = ()) -> TargetConfig | None:
    """The `target:` section of the recipe recorded in a run's checkpoint meta, with `overrides` applied (each
    must be `target.*`: an export reads no other section); None when the run records no recipe."""
    others = [o for o in overrides if not o.strip().startswith("target.")]
    if others:
        raise ConfigError(f"overrides without --config apply to the target section the run recorded, so each must "
                          f"start with 'target.'; received {others}: pass --config NAME|PATH to override a recipe")
    recorded = (meta or {}).get("recipe", {}).get("target")
    if recorded is None:
        if overrides:
            raise ConfigError(f"overrides {list(overrides)} need a recipe, and the run records none (no checkpoint "
                              "left); pass --config NAME|PATH with them")
        return None
    return build(TargetConfig, apply_overrides({"target": recorded}, list(overrides))["target"], "target")


def target_architecture(source: str) -> KnownTarget | None:
    """The architecture of target `source` read without its weights (a known target, or a Hugging Face
    directory's config.json), or None when it cannot be read that way here (a GGUF file, an unknown Hub id)."""
    try:
        return known_target(source)
    except (ValueError, OSError):
        return None


def check_target(arch: DrafterArch, source: str | None, known: KnownTarget | None, origin: str,
                 where: str = "the run") -> str:
    """Check that the drafter (read from `where`) fits the export's target `source` (which `origin` chose):
    widths, vocab, layer count, layer ids, family. A line saying what was checked; ValueError naming every
    mismatch."""
    if source is None:
        return "no target recorded in the run or given with --config: the drafter was not checked against one"
    if known is None:
        return (f"target {source} ({origin}): its architecture cannot be read without its weights here (a known "
                "target or a Hugging Face directory's config.json), so the drafter was not checked against it")
    cfg = known.cfg
    try:
        check_fits_target(arch, cfg, where)
        if arch.target_family != cfg.family:
            raise ValueError(f"the drafter in {where} was trained for a {arch.target_family} target, not "
                             f"{cfg.family}")
    except ValueError as err:
        raise ValueError(f"{err}; the export is for target {source} ({origin}): pass --config NAME|PATH (or "
                         "target.source=...) naming the target the drafter was trained for") from err
    return (f"checked against target {source} ({origin}): {cfg.family}, {cfg.num_layers} layers, hidden "
            f"{cfg.hidden_size}, vocab {cfg.vocab_size}")


def write_export(run: RunDrafter, directory: Path, layout: ExportLayout, *, target: str | None, model_ref: str,
                 results_path: Path | None, target_source: str | None = None) -> list[tuple[str, int]]:
    """Write `layout` (the tensors, the card and the modelling file) of `run` into `directory`; (name, size) per file.
    `target` is the target's Hub id, `target_source` its `target.source` (default: the run's recorded one)."""
    fmt, dtype = layout.fmt, layout.dtype
    modeling_file = Path(layout.modeling_file).expanduser() if layout.modeling_file is not None else None
    drafter = run.drafter
    if fmt == "zlab":
        save_zlab(drafter, directory, dtype)
        if modeling_file is not None:
            shutil.copyfile(modeling_file, directory / MODELING_FILE)
    else:
        source = target_source or (run.meta or {}).get("recipe", {}).get("target", {}).get("source")
        save_speculators(drafter, directory, verifier=target or source or "<target model>", dtype=dtype)
    results = read_results(results_path) if results_path is not None else None
    card = render_card(run, fmt=fmt, dtype=dtype, target=target, model_ref=model_ref, results=results,
                       results_source=str(results_path) if results_path else None,
                       param_count=param_count(drafter), has_modeling_file=modeling_file is not None)
    (directory / "README.md").write_text(card)
    return [(p.relative_to(directory).as_posix(), p.stat().st_size) for p in sorted(directory.rglob("*"))
            if p.is_file()]


def export_run(run_dir: str | Path, layout: ExportLayout, *, out: str | Path | None = None,
               step: int | str | None = None, results: str | Path | None = None,
               export_for: ExportFor = ExportFor(), overwrite: bool = False, dry_run: bool = False,
               hub: HubPush | None = None, say: Callable[[str], None] = print) -> ExportResult:
    """Export the drafter of `run_dir` at `step` (default: the latest checkpoint; "best": <run_dir>/best) in
    `layout` to `out` and/or the Hub (`hub`); see the module docstring. `export_for` chooses the target the export is
    made for (`ExportFor`: default the run's recorded recipe)."""
    fmt, dtype = layout.fmt, layout.dtype
    config, overrides, target = export_for.config, export_for.overrides, export_for.target
    push_to_hub = hub.repo_id if hub is not None else None
    out = Path(out).expanduser() if out is not None else None
    modeling_file = Path(layout.modeling_file).expanduser() if layout.modeling_file is not None else None
    _check_args(fmt, dtype, out, push_to_hub, overwrite, modeling_file)
    for_target = load_recipe(config, overrides).target if config is not None else None
    known = target_architecture(for_target.source) if for_target is not None else None
    step, fallback = best_or_latest(run_dir, step)  # --step best of a run without best/: its newest checkpoint
    if fallback:
        say(f"note: {fallback}")
    run = read_run(run_dir, step, target_family=known.cfg.family if known is not None else None)
    check_exportable_ids(run.drafter.arch, f"{run.source}")
    origin = f"--config {config}" if config is not None else "the run's recorded recipe"
    if for_target is None:
        for_target = recorded_target(run.meta, overrides)
        known = target_architecture(for_target.source) if for_target is not None else None
    source = for_target.source if for_target is not None else None
    checked = check_target(run.drafter.arch, source, known,
                           origin + (f" with {' '.join(overrides)}" if overrides else ""), where=str(run.source))
    target = target or target_id(source)
    # the results kept inside best/ for this very drafter (they travel with a copied best/), else the run dir's newest
    kept = best_results(run.source, run.step) if run.source.name == "best" else None
    results_path = Path(results).expanduser() if results is not None else kept or find_results(run.run_dir)
    message = (f"dflash-export: {run.run_dir.name} step {run.step}"
               + (" (best)" if run.source.name == "best" else "") + f", {fmt} layout, {dtype}")
    upload = (plan_upload(hub.repo_id, private=hub.private, revision=hub.revision, commit_message=message,
                          endpoint=hub.endpoint) if hub is not None and hub.repo_id else None)
    model_ref = push_to_hub or str(out)
    staging = Path(tempfile.mkdtemp(prefix="dflash-export-")) if dry_run else _staging_dir(out)
    try:
        files = write_export(run, staging, layout, target=target, model_ref=model_ref, results_path=results_path,
                             target_source=source)
        total = sum(size for _, size in files)
        say(checked)
        say(f"{run.source} (step {run.step}) -> {fmt} layout, {dtype}, {len(hf_tensor_names(run.drafter))} tensors"
            + (f"; model card with the eval of {results_path}" if results_path else "; no eval results for the card"))
        for name, size in files:
            say(f"  {name:<24} {human_size(size):>10}")
        if dry_run:
            if out is not None:
                say(f"dry run: would write {len(files)} files ({human_size(total)}) to {out}")
            if upload is not None:
                say(f"dry run: would upload {len(files)} files ({human_size(total)}) to {upload.endpoint}/"
                    f"{upload.repo_id} (revision {upload.revision}, {'private' if upload.private else 'public'}) in "
                    f"one commit: {message!r}")
            say("dry run: nothing was written or sent")
            return ExportResult(files, None, run.step, upload, None, True)
        commit_url = None
        if out is not None:
            _finalize(staging, out)
            say(f"wrote {out} ({len(files)} files, {human_size(total)})")
        if upload is not None:
            token = hub.token if hub is not None else None
            commit_url = upload_folder(out if out is not None else staging, [n for n, _ in files], upload, token)
            say(f"uploaded to {upload.repo_id} (revision {upload.revision}): {commit_url}")
        return ExportResult(files, out, run.step, upload, commit_url, False)
    finally:
        if staging.exists() and (out is None or staging != out):
            shutil.rmtree(staging, ignore_errors=True)


__all__ = ["FORMATS", "ExportFor", "ExportLayout", "ExportResult", "HubPush", "check_target", "export_run",
           "human_size", "recorded_target", "target_architecture", "write_export"]
