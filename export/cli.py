"""`dflash export` and `dflash-export` (the same command): RUN_DIR --format zlab|speculators --out DIR
[--push-to-hub REPO] [--config NAME|PATH] [target.key=value ...]. One argument list (`add_export_args`) and one
implementation (`run_export`) serve both: parse, log the devices, call `export.run.export_run`. Errors print
one line naming the problem and exit 2."""

from __future__ import annotations

import argparse
import logging
import sys

from dflash.configs.schema import ConfigError

log = logging.getLogger("dflash")

DESCRIPTION = ("Export a trained DFlash drafter (a `dflash train` run dir) to the Hugging Face layout vLLM, SGLang "
               "(zlab) or speculators load, with a model card; optionally push it to the Hub.")
CONFIG_HELP = ("the recipe (a name in configs/ or a YAML path) whose target the drafter is exported for: "
               "its target.source names the target in the card's serving lines and the speculators verifier "
               "(unless --target), and the drafter is checked against that target's architecture, read without "
               "weights (a known target or a Hugging Face directory's config.json). Default: the recipe recorded "
               "in the run's checkpoint, where only target.* overrides apply")


def add_export_args(p: argparse.ArgumentParser) -> None:
    """The arguments of the export command, defined once for `dflash export` and `dflash-export`."""
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run dir of `dflash train` (train.run_dir)")
    p.add_argument("--step", default=None, help="checkpoint step, or 'best' (<run_dir>/best); default: the latest")
    p.add_argument("--format", dest="fmt", required=True, choices=["zlab", "speculators"], help="layout to write")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="tensor dtype (default float32: the trained weights exactly)")
    p.add_argument("--out", default=None, help="directory to write (refused if it exists, unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out (swapped in at the end)")
    p.add_argument("--results", default=None,
                   help="a `dflash eval` results.json for the card (default: the newest <run_dir>/eval*/results.json)")
    p.add_argument("--target", default=None,
                   help="the target's Hub id for the card and the speculators verifier (default: from the recipe)")
    p.add_argument("--modeling-file", default=None,
                   help="z-lab's dflash/model.py, shipped as dflash.py for transformers remote code (zlab only)")
    p.add_argument("--push-to-hub", default=None, metavar="REPO", help="upload to this Hub repo (user/name)")
    p.add_argument("--private", action="store_true", help="create the Hub repo private")
    p.add_argument("--revision", default=None, help="Hub branch to commit to (created if missing; default main)")
    p.add_argument("--dry-run", action="store_true", help="list the files and the upload; write and send nothing")
    p.add_argument("--config", default=None, metavar="NAME|PATH", help=CONFIG_HELP)
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="dotted overrides of that recipe, e.g. target.source=/models/Qwen3-8B")


def run_export(args: argparse.Namespace, prog: str = "dflash-export") -> int:
    """Run one export from parsed arguments (`add_export_args`); 0, or 2 after printing the error."""
    from dflash.export.hub import HubError
    from dflash.export.run import ExportFor, ExportLayout, HubPush, export_run
    from dflash.models.drafter_io import CheckpointError

    try:
        import jax

        log.info("jax %s: process %d/%d, devices %s", jax.__version__, jax.process_index(), jax.process_count(),
                 [str(d) for d in jax.devices()])
        hub = (HubPush(args.push_to_hub, private=args.private, revision=args.revision)
               if args.push_to_hub is not None else None)
        export_run(args.run_dir, ExportLayout(args.fmt, args.dtype, args.modeling_file), out=args.out, step=args.step,
                   results=args.results, export_for=ExportFor(args.config, args.overrides, args.target),
                   overwrite=args.overwrite, dry_run=args.dry_run, hub=hub)
    except (ConfigError, FileNotFoundError, FileExistsError, ValueError, CheckpointError, HubError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-export", description=DESCRIPTION)
    add_export_args(p)
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may also come after options (`dflash-export RUN --format zlab target.source=X`), which argparse
    # leaves over once the positional list has been filled (as in `dflash`).
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    args.overrides = [*args.overrides, *extra]
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if not args.verbose:
        logging.getLogger("absl").setLevel(logging.WARNING)
        logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    return run_export(args)


if __name__ == "__main__":
    sys.exit(main())
