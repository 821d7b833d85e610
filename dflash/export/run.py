"""`dflash-export`: a trained drafter (a `dflash train` run dir, Orbax) -> the Hugging Face layouts vLLM,
SGLang and speculators load, with a model card, optionally pushed to the Hub in one commit.

Layouts (DESIGN §4.5): `zlab` (`models.zlab`: config.json + model.safetensors, + `dflash.py` when
`modeling_file` is given) and `speculators` (`models.speculators`). Both are written into a hidden
temporary directory beside `out` (`.<name>.tmp-<pid>`), fsynced, and renamed to `out` at the end: an
interrupted export leaves no directory that looks complete (a leftover temporary directory is removed by
the next export to the same place). An existing `out` is refused unless `overwrite`.

`dry_run` builds the export in a temporary directory, lists every file with its size (and the Hub upload it
would make), writes nothing to `out` and sends nothing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash.export.card import find_results, read_results, render_card, target_id
from dflash.export.hub import Upload, plan_upload, upload_folder
from dflash.files import fsync_path, fsync_tree
from dflash.models.drafter import hf_tensor_names, param_count
from dflash.models.drafter_io import RunDrafter, read_run
from dflash.models.speculators import save_speculators
from dflash.models.zlab import DTYPES, MODELING_FILE, check_exportable_ids, save_zlab

FORMATS = ("zlab", "speculators")


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
        raise ValueError("dflash-export needs --out DIR, --push-to-hub REPO, or both")
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


def write_export(run: RunDrafter, directory: Path, *, fmt: str, dtype: str, target: str | None, model_ref: str,
                 results_path: Path | None, modeling_file: Path | None) -> list[tuple[str, int]]:
    """Write the layout, the card (and the modelling file) of `run` into `directory`; (name, size) per file."""
    drafter, arch = run.drafter, run.drafter.arch
    if fmt == "zlab":
        save_zlab(drafter, directory, dtype)
        if modeling_file is not None:
            shutil.copyfile(modeling_file, directory / MODELING_FILE)
    else:
        source = (run.meta or {}).get("recipe", {}).get("target", {}).get("source")
        save_speculators(drafter, directory, verifier=target or source or "<target model>", dtype=dtype)
    results = read_results(results_path) if results_path is not None else None
    card = render_card(arch, fmt=fmt, dtype=dtype, step=run.step, best=run.source.name == "best", meta=run.meta,
                       target=target, model_ref=model_ref, results=results,
                       results_source=str(results_path) if results_path else None,
                       param_count=param_count(drafter), has_modeling_file=modeling_file is not None)
    (directory / "README.md").write_text(card)
    return [(p.relative_to(directory).as_posix(), p.stat().st_size) for p in sorted(directory.rglob("*"))
            if p.is_file()]


def export_run(run_dir: str | Path, *, fmt: str, out: str | Path | None = None, step: int | str | None = None,
               dtype: str = "float32", results: str | Path | None = None, target: str | None = None,
               modeling_file: str | Path | None = None, overwrite: bool = False, dry_run: bool = False,
               push_to_hub: str | None = None, private: bool = False, revision: str | None = None,
               endpoint: str | None = None, token: str | None = None,
               say: Callable[[str], None] = print) -> ExportResult:
    """Export the drafter of `run_dir` at `step` (default: the latest checkpoint; "best": <run_dir>/best) in
    layout `fmt`; see the module docstring. `target` is the target's Hub id for the card and the speculators
    verifier entry (default: derived from the recipe's target.source)."""
    out = Path(out).expanduser() if out is not None else None
    modeling_file = Path(modeling_file).expanduser() if modeling_file is not None else None
    _check_args(fmt, dtype, out, push_to_hub, overwrite, modeling_file)
    run = read_run(run_dir, step)
    check_exportable_ids(run.drafter.arch, f"{run.source}")
    source = (run.meta or {}).get("recipe", {}).get("target", {}).get("source")
    target = target or target_id(source)
    results_path = Path(results).expanduser() if results is not None else find_results(run.run_dir)
    message = (f"dflash-export: {run.run_dir.name} step {run.step}"
               + (" (best)" if run.source.name == "best" else "") + f", {fmt} layout, {dtype}")
    upload = (plan_upload(push_to_hub, private=private, revision=revision, commit_message=message, endpoint=endpoint)
              if push_to_hub else None)
    model_ref = push_to_hub or str(out)
    staging = Path(tempfile.mkdtemp(prefix="dflash-export-")) if dry_run else _staging_dir(out)
    try:
        files = write_export(run, staging, fmt=fmt, dtype=dtype, target=target, model_ref=model_ref,
                             results_path=results_path, modeling_file=modeling_file)
        total = sum(size for _, size in files)
        say(f"{run.source} (step {run.step}) -> {fmt} layout, {dtype}, {len(hf_tensor_names(run.drafter))} tensors"
            + (f"; model card with the eval of {results_path}" if results_path else "; no eval results for the card"))
        for name, size in files:
            say(f"  {name:<24} {human_size(size):>10}")
        if dry_run:
            if out is not None:
                say(f"dry run: would write {len(files)} files ({human_size(total)}) to {out}")
            if upload is not None:
                say(f"dry run: would upload {len(files)} files ({human_size(total)}) to {upload.endpoint}/"
                    f"{upload.repo_id} (revision {upload.revision}, {'private' if private else 'public'}) in one "
                    f"commit: {message!r}")
            say("dry run: nothing was written or sent")
            return ExportResult(files, None, run.step, upload, None, True)
        commit_url = None
        if out is not None:
            _finalize(staging, out)
            say(f"wrote {out} ({len(files)} files, {human_size(total)})")
        if upload is not None:
            commit_url = upload_folder(out if out is not None else staging, [n for n, _ in files], upload, token)
            say(f"uploaded to {upload.repo_id} (revision {upload.revision}): {commit_url}")
        return ExportResult(files, out, run.step, upload, commit_url, False)
    finally:
        if staging.exists() and (out is None or staging != out):
            shutil.rmtree(staging, ignore_errors=True)


__all__ = ["FORMATS", "ExportResult", "export_run", "human_size", "write_export"]
