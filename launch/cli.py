"""`dflash` — one entry point, a subcommand per stage. Each subcommand parses its config, logs the
devices and process index, and calls one library function."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from dflash.configs.schema import ConfigError
from dflash.export.cli import DESCRIPTION as EXPORT_DESCRIPTION
from dflash.export.cli import add_export_args as add_export_cli_args

log = logging.getLogger("dflash")


def _add_config_args(p: argparse.ArgumentParser, default: str = "default") -> None:
    p.add_argument("--config", default=default,
                   help=f"recipe name in configs/ or a YAML path (default: {default})")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="dotted overrides, e.g. target.dtype=bfloat16")


def _serve_overrides(args: argparse.Namespace) -> list[str]:
    """`dflash serve` / `dflash eval`'s --block-size, --tree-nodes, --tree-ngram and --draft-rule as overrides of the
    recipe's `serve` section (checked there, `serve.config.ServeConfig`)."""
    flags = {"block_size": getattr(args, "block_size", None), "tree_nodes": getattr(args, "tree_nodes", None),
             "tree_ngram": "true" if getattr(args, "tree_ngram", False) else None,
             "draft_rule": getattr(args, "draft_rule", None)}
    return [f"serve.{name}={value}" for name, value in flags.items() if value is not None]


def _overrides(args: argparse.Namespace) -> list[str]:
    return [*args.overrides, *_serve_overrides(args)]


def _recipe(args: argparse.Namespace, *, unreachable_ok: bool = False):
    """The recipe of `--config` and the overrides, checked whole before anything heavy is imported or loaded: its
    sections and their cross-section rules (`configs.recipe`), then the target's architecture from its config.json
    alone and the drafter section against it (`models.registry.check_recipe_target`: an unsupported family is
    refused here, before any weights move). `unreachable_ok`: a Hub target whose config.json cannot be fetched from
    this machine is only a warning (`dflash config`, `dflash launch`: the pod checks it again)."""
    from dflash.configs.recipe import load_recipe
    from dflash.models.registry import check_recipe_target

    recipe = load_recipe(args.config, _overrides(args))
    check_recipe_target(recipe.target, recipe.drafter, unreachable_ok=unreachable_ok)
    return recipe


def _init_distributed() -> None:
    """Join a multi-process JAX run when JAX_COORDINATOR_ADDRESS (host:port of process 0's coordinator)
    is set, with JAX_NUM_PROCESSES and JAX_PROCESS_ID: every process runs the same command with its own id.
    CPU processes exchange collectives through gloo (jax's default `jax_cpu_collectives_implementation`).

    With DFLASH_DISTRIBUTED=auto instead (what `dflash launch xpk` sets on TPU pods), `jax.distributed.initialize()`
    finds the coordinator, the process count and this process's id itself: on GKE from the variables the TPU
    webhook and JobSet set (TPU_WORKER_HOSTNAMES, TPU_WORKER_ID, MEGASCALE_* across slices)."""
    address = os.environ.get("JAX_COORDINATOR_ADDRESS", "")
    count, index = os.environ.get("JAX_NUM_PROCESSES", ""), os.environ.get("JAX_PROCESS_ID", "")
    mode = os.environ.get("DFLASH_DISTRIBUTED", "")
    if mode not in ("", "auto", "off"):
        raise ConfigError(f"DFLASH_DISTRIBUTED must be 'auto' (jax.distributed.initialize() finds the cluster) or "
                          f"'off'; received {mode!r}")
    if mode == "auto" and not address:
        import jax

        jax.distributed.initialize()
        return
    if not address:
        if count or index:
            raise ConfigError(f"JAX_COORDINATOR_ADDRESS must be host:port of process 0 when JAX_NUM_PROCESSES "
                              f"or JAX_PROCESS_ID is set; received JAX_NUM_PROCESSES={count!r}, "
                              f"JAX_PROCESS_ID={index!r} and no address: set it or unset them")
        return
    if not (count.isdigit() and index.isdigit() and int(index) < int(count)):
        raise ConfigError(f"JAX_NUM_PROCESSES must be an integer >= 1 and JAX_PROCESS_ID one in [0, JAX_NUM_PROCESSES) "
                          f"when JAX_COORDINATOR_ADDRESS is set; received {count!r} and {index!r}")
    import jax

    jax.distributed.initialize(coordinator_address=address, num_processes=int(count), process_id=int(index))


def _log_devices() -> None:
    import jax

    log.info("jax %s: process %d/%d, devices %s", jax.__version__, jax.process_index(), jax.process_count(),
             [str(d) for d in jax.devices()])


def cmd_config(args: argparse.Namespace) -> int:
    from dflash.configs.recipe import dump_recipe

    sys.stdout.write(dump_recipe(_recipe(args, unreachable_ok=True)))
    return 0


def add_config_args(sub: argparse._SubParsersAction) -> None:
    """The arguments of `dflash config`."""
    p = sub.add_parser("config", help="print the resolved recipe (after overrides) as YAML")
    _add_config_args(p)
    p.set_defaults(func=cmd_config)


def cmd_chat(args: argparse.Namespace) -> int:
    recipe = _recipe(args)
    from dflash.models.target import load_target
    from dflash.serve.chat import chat

    _log_devices()
    prompts = args.prompt or [line.strip() for line in sys.stdin if line.strip()]
    if not prompts:
        raise ConfigError("chat needs --prompt TEXT (repeatable) or prompts on standard input; received none")
    chat(load_target(recipe.target), recipe.sampling, recipe.target.max_seq_len, prompts, system=args.system)
    return 0


def add_chat_args(sub: argparse._SubParsersAction) -> None:
    """The arguments of `dflash chat`."""
    p = sub.add_parser("chat", help="chat with the target (AR decoding), printing tokens/s")
    _add_config_args(p)
    p.add_argument("--prompt", action="append", help="a user prompt (repeatable); else one per stdin line")
    p.add_argument("--system", default=None, help="system prompt (default: the chat template's own)")
    p.set_defaults(func=cmd_chat)


def cmd_demo(args: argparse.Namespace) -> int:
    recipe = _recipe(args)
    from dflash.launch.demo import DEMO_PROMPTS, run_demo
    from dflash.train.preemption import PREEMPTED_EXIT_CODE, Preempted

    _log_devices()
    try:
        run_demo(recipe, prompts=args.prompt or DEMO_PROMPTS, train=not args.skip_train,
                 progress=not args.no_progress)
    except _run_errors() as err:
        print(f"dflash demo: error: {err}", file=sys.stderr)
        return 1
    except Preempted as stopped:
        print(f"dflash demo: {stopped}", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    return 0


def add_demo_args(sub: argparse._SubParsersAction) -> None:
    """The arguments of `dflash demo`."""
    p = sub.add_parser("demo", help="the main job on the embedded default target: train a drafter briefly, chat")
    _add_config_args(p, default="demo")
    p.add_argument("--prompt", action="append", help="prompt(s) to use instead of the built-in ones")
    p.add_argument("--skip-train", action="store_true", help="only chat (no drafter training)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_demo)


def _run_errors() -> tuple[type[Exception], ...]:
    """Errors of a run (not of its input) that end a training stage with exit status 1 and their message."""
    from dflash.train.checkpoint import CheckpointError
    from dflash.train.metrics import NonFiniteMetricError

    return CheckpointError, NonFiniteMetricError


def cmd_train(args: argparse.Namespace) -> int:
    recipe = _recipe(args)
    from dflash.train.loop import run_training
    from dflash.train.preemption import PREEMPTED_EXIT_CODE, Preempted

    _log_devices()
    try:
        from dflash.data.offline import ReadOptions

        read = ReadOptions(args.loader_workers, args.skip_bad_records, args.verify_shards)
        result = run_training(recipe, progress=not args.no_progress, read=read)
    except _run_errors() as err:
        print(f"dflash train: error: {err}", file=sys.stderr)
        return 1
    except Preempted as stopped:  # SIGTERM: the step in flight is checkpointed; the launchers restart on this code
        print(f"dflash train: {stopped}", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    last, ev = result.last, result.eval
    print(f"trained {result.final_step - result.start_step} steps (to step {result.final_step}) in "
          f"{result.seconds:.0f} s; checkpoints in {result.run_dir / 'checkpoints'}")
    if last:
        print(f"last step: loss {last['loss']:.3f}, teacher-forced acceptance length {last['acceptance_length']:.2f}")
    if ev:
        per_pos = " ".join(f"{a:.2f}" for a in ev["accuracy_per_position"][1:])
        print(f"held-out (GSM8K test): loss {ev['loss']:.3f}, teacher-forced acceptance length "
              f"{ev['acceptance_length']:.2f} (block {result.arch.block_size}); accuracy by position: {per_pos}")
    return 0


def add_train_args(sub: argparse._SubParsersAction) -> None:
    """The arguments of `dflash train`."""
    p = sub.add_parser("train", help="distill a DFlash drafter (online or stored target features); resumes from "
                                     "train.run_dir")
    _add_config_args(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--loader-workers", type=int, default=0, metavar="N",
                   help="data.features=offline: Grain worker processes reading the shards (0: in this process)")
    p.add_argument("--skip-bad-records", action="store_true",
                   help="data.features=offline: a record that fails to read becomes a padding row, counted, instead "
                        "of stopping the run")
    p.add_argument("--verify-shards", action="store_true",
                   help="data.features=offline: check every shard's sha256 before the first step (slow on large "
                        "captures; sizes are always checked)")
    p.set_defaults(func=cmd_train)


def cmd_data(args: argparse.Namespace) -> int:
    recipe = _recipe(args)
    if args.stage == "inspect":
        from dflash.data.stages import inspect_data

        print(inspect_data(recipe, sample=args.sample))
        return 0
    _log_devices()
    progress = not args.no_progress
    if args.stage == "regenerate":
        from dflash.data.regenerate import RegenerationStopped
        from dflash.data.stages import run_regenerate
        from dflash.train.preemption import PREEMPTED_EXIT_CODE

        try:
            _, stats, out = run_regenerate(recipe, progress=progress)  # the mix's table is logged before the run
        except RegenerationStopped as stopped:  # SIGTERM: what finished is written; the launchers restart on 42
            print(f"dflash data regenerate: {stopped}; exit {PREEMPTED_EXIT_CODE}", file=sys.stderr)
            return PREEMPTED_EXIT_CODE
        print(f"{stats.summary()}\nwritten to {out}")
        return 0 if stats.succeeded + stats.skipped > 0 or not (stats.errors + stats.dropped) else 1
    if args.stage == "walk":
        from dflash.data.stages import run_walk_stage

        summary = run_walk_stage(recipe, drafter=args.drafter or "", step=_step(args.step), mode=args.mode,
                                 limit=args.limit, slots=args.slots, progress=progress)
        print(summary.summary())
        return 0
    from dflash.data.stages import run_capture

    report = run_capture(recipe, progress=progress)
    m = report.manifest
    print(f"captured {report.shards_written} shards ({report.shards_kept} kept from an earlier run) to "
          f"{recipe.data.shard_dir}: {m.num_samples} samples, {m.total_tokens} tokens, layer_ids {list(m.layer_ids)}; "
          f"{report.tokens_per_s:.0f} tokens/s this run, {m.bytes_per_token:.0f} bytes/token on disk")
    return 0


def add_data_args(sub: argparse._SubParsersAction) -> None:
    """The arguments of `dflash data regenerate|capture|walk|inspect`."""
    p = sub.add_parser("data", help="training data: regenerate answers with the target, capture features, inspect")
    stages = p.add_subparsers(dest="stage", required=True)
    for stage, text in [("regenerate", "data.prompts -> the target's answers -> data.dir/regenerated.jsonl (resumes)"),
                        ("capture", "data.source -> target features -> data.dir/shards, read by "
                                    "`dflash train data.features=offline` (resumes)"),
                        ("walk", "data.source rows -> the blocks greedy DFlash serving visits and the drafts each "
                                 "accepted -> data.dir/walk/ (resumes; read by data.walk, train.walk_anchors)"),
                        ("inspect", "the counts, the capture manifest and one decoded sample with its loss mask")]:
        q = stages.add_parser(stage, help=text, description=text)
        _add_config_args(q)
        if stage == "inspect":
            q.add_argument("--sample", type=int, default=0, help="which captured sample to decode (default 0)")
        else:
            q.add_argument("--no-progress", action="store_true", help="no progress bar")
        if stage == "walk":
            q.add_argument("--drafter", help="a `dflash train` run dir or an exported drafter dir (default: "
                           "train.run_dir)")
            q.add_argument("--step", default=None, help="checkpoint step of a run dir, or 'best' (default: the latest)")
            q.add_argument("--mode", choices=("teacher", "engine", "stored"), default="teacher",
                           help="teacher: one target + one drafter forward per row over the stored answer (default; "
                           "tested equal to the engine's walk); engine: decode the prompts through the engine; "
                           "stored: the drafter alone over the features `dflash data capture` stored (bf16)")
            q.add_argument("--limit", type=int, default=0, help="walk only the first N rows (a measurement)")
            q.add_argument("--slots", type=int, default=8, help="engine slots (--mode engine)")
        q.set_defaults(func=cmd_data)


def _slots_arg(text: str) -> int | str:
    """--slots: an integer >= 1, or `auto` (sized to the devices' free memory; `launch.serving.auto_slots`)."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or 'auto'; received {text!r}")
    return int(text)


def _step(text: str | None) -> int | str | None:
    """--step: a checkpoint step, `best` (the best real-τ drafter of a run), or None (the latest)."""
    if text is None or text == "best":
        return text
    if not text.isdigit():
        raise ConfigError(f"--step must be a checkpoint step or 'best'; received {text!r}")
    return int(text)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as err:
        raise ConfigError(f"--concurrency must be comma-separated integers like 1,4,16; received {text!r}") from err
    return values


def cmd_eval(args: argparse.Namespace) -> int:
    recipe = _recipe(args)  # the recipe, its overrides and its target must be valid before servers start with them
    from dflash.eval.client import ServerError
    from dflash.eval.report import headline_line
    from dflash.eval.run import EvalSettings, ServeArgs, run_eval, template_variables

    try:
        given = None if args.chat_template_kwargs is None else json.loads(args.chat_template_kwargs)
    except json.JSONDecodeError as err:
        print(f"dflash eval: error: --chat-template-kwargs must be a JSON object, e.g. "
              f"'{{\"reasoning_effort\": \"low\"}}'; received {args.chat_template_kwargs!r} ({err})", file=sys.stderr)
        return 2
    template_kwargs, origin = template_variables(given, recipe.data.regen.template_kwargs)
    print(f"dflash eval: chat template variables {json.dumps(template_kwargs)} ({origin})")
    try:
        settings = EvalSettings(sets=tuple(s for s in args.sets.split(",") if s), limit=args.limit,
                                max_new_tokens=args.max_new_tokens, concurrency=_int_list(args.concurrency),
                                temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                chat_template_kwargs=template_kwargs, speedbench=args.speedbench)
    except ValueError as err:
        print(f"dflash eval: error: {err}", file=sys.stderr)
        return 2
    try:
        results, paths = run_eval(settings, args.out, url=args.url, ar_url=args.ar_url, drafter=args.drafter,
                                  step=args.step, serve=ServeArgs(args.config, tuple(_overrides(args)), args.devices),
                                  api_key=args.api_key, progress=not args.no_progress, engine=args.engine)
    except (ServerError, ValueError) as err:
        print(f"dflash eval: error: {err}", file=sys.stderr)
        return 2
    mismatches = results["headline"]["mismatches"]
    compiled = {mode: n for mode, n in results.get("compiles", {}).items() if n}
    unavailable = results["engine"]["unavailable"] if results["headline"]["tau"] is None else None
    ours = results["engine"]["dflash"] == "dflash"  # another engine in bf16 need not match AR token for token
    print(f"report: {paths['report.md']}\n{headline_line(results)}"
          + (f"\nnote: {unavailable} (speed still measured)" if unavailable else "")
          + (f"\nERROR: {mismatches} greedy replies differ from AR (see results.json)" if mismatches and ours else
             f"\nnote: {mismatches} greedy replies differ from AR ({results['engine']['dflash']} need not match AR "
             "token for token outside fp32)" if mismatches else "")
          + ("\nnote: sampled replies are not compared with AR's; losslessness rests on the engine's sampled-decoding "
             "tests" if mismatches is None else "")
          + (f"\n{'ERROR' if args.strict else 'note'}: the servers compiled inside the timed requests ({compiled}; "
             "results.json `compiles`, marked in report.md): those timings include compiles"
             + ("" if args.strict else " (--strict makes this an error)") if compiled else ""))
    return 1 if (mismatches and ours) or (compiled and args.strict) else 0


def add_eval_args(sub: argparse._SubParsersAction) -> None:
    """The arguments of `dflash eval`."""
    p = sub.add_parser("eval", help="evaluate a drafter against the served engine: tau, acceptance, DFlash vs AR "
                                    "speed, output equality; writes results.json, report.md and plots")
    _add_config_args(p)
    p.add_argument("--url", help="a running speculative server to evaluate (dflash serve, vLLM, SGLang), e.g. "
                                 "http://127.0.0.1:8000")
    p.add_argument("--engine", choices=("auto", "dflash", "vllm", "sglang"), default="auto",
                   help="the engine serving --url, whose own counters give tau (default auto: told from the server)")
    p.add_argument("--drafter", help="a run dir or an exported drafter: its server is started here")
    p.add_argument("--step", default=None, help="with --drafter: a checkpoint step or 'best' (default: latest)")
    p.add_argument("--ar-url", help="a running AR server of the same target: the --ar-port of the DFlash server, "
                   "`dflash serve --ar`, or vLLM or SGLang without speculation (default: started here, beside the "
                   "DFlash server)")
    p.add_argument("--sets", default="gsm8k,mtbench",
                   help="comma-separated: gsm8k, math500, humaneval, mbpp, mtbench, speedbench[:SPLIT][:CATEGORY] "
                   "(SPEED-Bench, from --speedbench), a .json/.jsonl file, hf:ID")
    p.add_argument("--speedbench", default="hf:nvidia/SPEED-Bench", metavar="hf:ID|DIR",
                   help="where speedbench sets are read: the Hub dataset or a directory of prepared splits "
                   "(<split>.jsonl, <split>.parquet or <split>/*.parquet; default hf:nvidia/SPEED-Bench)")
    p.add_argument("--limit", type=int, default=8, help="conversations per set (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="new tokens per turn (default 256)")
    p.add_argument("--concurrency", default="1", help="client concurrencies, e.g. 1,4,16 (default 1)")
    _add_plan_args(p)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (default 0: greedy; the equality check against AR is greedy only)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling with --temperature (default 1: off)")
    p.add_argument("--seed", type=int, default=0, help="base of each sampled request's seed (default 0)")
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help='the chat template\'s variables, sent with every request to both servers, e.g. '
                   '\'{"reasoning_effort": "low"}\' (gpt-oss) or \'{"enable_thinking": false}\' (Qwen3); default: '
                   'the recipe\'s data.regen.template_kwargs (what its training answers were made with)')
    p.add_argument("--out", default="runs/eval", help="output directory; a rerun resumes it (default runs/eval)")
    p.add_argument("--api-key", default=None, help="the servers' API key, if they need one")
    p.add_argument("--devices", type=int, default=1,
                   help="each server started here splits the target over this many of the host's devices (tensor "
                   "parallel); 0: all of them (default 1)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when a server compiled a program inside the timed requests (default: reported per "
                   "mode and marked in the report, exit 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_eval)


def cmd_serve(args: argparse.Namespace) -> int:
    recipe = _recipe(args)
    from dflash.launch.serving import ServeOptions, serve_recipe

    _log_devices()
    options = ServeOptions(drafter=args.drafter, step=None if args.ar else _step(args.step), ar=args.ar,
                           slots=args.slots, prefill_chunk=args.prefill_chunk,
                           steps_per_dispatch=args.steps_per_dispatch, devices=args.devices, host=args.host,
                           port=args.port,
                           model_name=args.model_name,
                           api_key=args.api_key or os.environ.get("DFLASH_API_KEY") or None,
                           max_body_bytes=int(args.max_body_mb * (1 << 20)), read_timeout=args.read_timeout or None,
                           unknown_fields="reject" if args.strict_fields else "ignore",
                           precompile=not args.no_precompile, ar_port=args.ar_port)
    serve_recipe(recipe, options)
    return 0


def add_serve_args(sub: argparse._SubParsersAction) -> None:
    """The arguments of `dflash serve`."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server: target + DFlash drafter (or AR)")
    _add_config_args(p)
    p.add_argument("--drafter", help="a `dflash train` run dir or a z-lab HF drafter dir (default: train.run_dir)")
    p.add_argument("--step", default=None, help="checkpoint step of a run dir, or 'best' (default: the latest)")
    p.add_argument("--ar", action="store_true", help="serve the target alone (no drafter)")
    p.add_argument("--ar-port", type=int, default=None,
                   help="also serve the target alone (AR) on this port, in this process over the same weights "
                   "(one chip holds both: the baseline of a paired dflash eval on a TPU host)")
    _add_plan_args(p)
    p.add_argument("--slots", type=_slots_arg, default="auto",
                   help="concurrent sequences (continuous batching); a step computes only the running ones. auto "
                   "(default): the most that fit half the devices' free memory after the weights, up to 64 (8 on "
                   "CPU); each slot holds its K/V pages of target.max_seq_len tokens")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="prefill a longer prompt one chunk of this many tokens (a power of two >= 16) per engine "
                   "step, between the running requests' steps (0: every prompt in one call; default 512)")
    p.add_argument("--steps-per-dispatch", type=int, default=4,
                   help="decode steps run on the device per host round trip (one jitted loop; back early when a "
                   "request finishes); 1: one propose and one verify call per step (default 4)")
    p.add_argument("--devices", type=int, default=1,
                   help="split the target's weights and paged K/V over this many of the host's devices (tensor "
                   "parallel; the drafter replicated); 0: all of them (default 1)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default=None, help="the model id clients send (default: target.source)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: env DFLASH_API_KEY; unset: open)")
    p.add_argument("--max-body-mb", type=float, default=4.0, help="larger request bodies get a 413 (default 4)")
    p.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a connection may stay silent before it is cut (0: never; default 30)")
    p.add_argument("--strict-fields", action="store_true",
                   help="refuse unknown request fields with a 400 (default: ignore them, one warning per name)")
    p.add_argument("--no-precompile", action="store_true",
                   help="skip compiling every shape at start-up (quick tries; requests then compile as they come)")
    p.set_defaults(func=cmd_serve)


def cmd_export(args: argparse.Namespace) -> int:
    from dflash.export.cli import run_export

    return run_export(args, prog="dflash export")


def add_export_args(sub: argparse._SubParsersAction) -> None:
    """`dflash export`: the arguments of `dflash-export` (`export.cli.add_export_args`)."""
    p = sub.add_parser("export", help="a trained drafter -> the Hugging Face layout vLLM and SGLang (zlab) or "
                                      "speculators load, with a model card; optionally pushed to the Hub "
                                      "(= dflash-export)", description=EXPORT_DESCRIPTION)
    add_export_cli_args(p)
    p.set_defaults(func=cmd_export)


def cmd_launch_pod(args: argparse.Namespace) -> int:
    """`dflash launch xpk|gcluster STAGE`: the recipe checked whole (its target from config.json alone), then against
    the slice and the credentials its pods need, before the launcher is asked for anything."""
    recipe = _recipe(args, unreachable_ok=True)  # the recipe, its overrides and its target, before any pod starts
    import shlex

    from dflash.launch.pod import check_credentials, check_on_slice, parse_env, parse_secrets, target_bucket
    from dflash.launch.tpus import parse_tpu_type

    endpoint = args.stage == "regenerate" and bool(recipe.data.regen.endpoint.url)
    if endpoint and args.tpu_type:
        raise ConfigError(f"--tpu-type must not be given for `regenerate` through data.regen.endpoint.url "
                          f"({recipe.data.regen.endpoint.url}): the stage only sends HTTP requests to that server, "
                          f"so it runs on one CPU node (--cpu-type, default {args.cpu_type}) and holds no TPU; "
                          f"received {args.tpu_type}")
    if not endpoint and not args.tpu_type:
        raise ConfigError(f"--tpu-type must name the TPU slice of `{args.stage}` (e.g. v5p-128 for train, v5p-8 for "
                          "one host); received none")
    tpu = None if endpoint else parse_tpu_type(args.tpu_type)
    check_on_slice(recipe, args.stage, tpu, args.num_slices)
    image = args.image or os.environ.get("DFLASH_IMAGE") or ("dflash-tpu:latest" if args.dry_run else None)
    if image is None:
        raise ConfigError("--image (or DFLASH_IMAGE) must name the image built from docker/Dockerfile and pushed to "
                          "a registry the cluster pulls from; received none")
    common = dict(stage=args.stage, recipe=args.config, cluster=args.cluster, tpu=tpu, run_dir=args.run_dir,
                  image=image, num_slices=args.num_slices, data_dir=args.data_dir, overrides=tuple(args.overrides),
                  stage_args=tuple(shlex.split(args.args)), env=parse_env(args.env or []),
                  secrets=parse_secrets(args.secret or []), max_restarts=args.max_restarts,
                  grace_period=args.grace_period, project=args.project, priority=args.priority,
                  cpu_type=args.cpu_type if endpoint else "",
                  model_buckets=tuple(b for b in [target_bucket(recipe.target.source)] if b),
                  chat_template_kwargs=json.dumps(dict(recipe.data.regen.template_kwargs), sort_keys=True)
                  if args.stage == "eval" else "")
    if args.target == "xpk":
        from dflash.launch import xpk

        plan = xpk.XpkLaunch(**common, workload=args.workload, zone=args.zone, spot=args.spot)
        notes = check_credentials(recipe, plan)
        return xpk.launch(plan, dry_run=args.dry_run, xpk=args.xpk, manifest=args.manifest, notes=notes)
    from dflash.launch import gcluster

    plan = gcluster.GclusterLaunch(**common, name=args.name, location=args.zone, service_account=args.service_account)
    notes = check_credentials(recipe, plan)
    return gcluster.launch(plan, dry_run=args.dry_run, gcluster=args.gcluster, manifest=args.manifest, notes=notes)


def cmd_launch_compile(args: argparse.Namespace) -> int:
    import json

    if args.config is None:
        raise ConfigError("--config must name the recipe to compile (a name in configs/ or a YAML path); "
                          "received none")
    recipe = _recipe(args, unreachable_ok=True)  # a bad recipe, override or target stops here, not in the subprocess
    from dflash.launch.compile import run_compile

    topology = args.topology or recipe.launch.tpu_type
    if topology is None:
        raise ConfigError(f"--topology must name a TPU slice (e.g. v5p-128): recipe {args.config!r} sets no "
                          "launch.tpu_type; received none")
    from dflash.launch.tpus import parse_tpu_type

    parse_tpu_type(topology, "--topology" if args.topology else "launch.tpu_type")  # its own name in the error
    report = run_compile(args.config, args.overrides, topology, args.num_slices, backend=args.backend,
                         libtpu=args.libtpu, engine=not args.no_engine)
    print(report.format(args.mfu))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=1)
    refusals = report.refusals()
    for reason in refusals:
        print(f"does not fit: {reason}", file=sys.stderr)
    return 3 if refusals else 0


def add_launch_args(sub: argparse._SubParsersAction) -> None:
    """The arguments of `dflash launch xpk|gcluster|compile`."""
    p = sub.add_parser("launch", help="run a stage on a TPU pod with xpk or Cluster Toolkit (gcluster), or compile it "
                                      "ahead of time for one")
    targets = p.add_subparsers(dest="target", required=True)
    for launcher, text in [
        ("xpk", "create an xpk workload running a stage on a TPU slice (see docs/pods.md)"),
        ("gcluster", "submit a Cluster Toolkit job (gcluster job submit) running a stage on a TPU slice "
                     "(see docs/pods.md)"),
    ]:
        q = targets.add_parser(launcher, help=text,
                               description=f"{text[0].upper()}{text[1:]}; --dry-run prints the {launcher} command and "
                               "the workload and runs nothing.")
        _add_pod_args(q, launcher)
        q.set_defaults(func=cmd_launch_pod)
    q = targets.add_parser("compile", help="compile every stage's programs for a TPU topology and report memory "
                           "per chip", description="Compile a recipe's train step (and the engine's propose and "
                           "verify, regeneration's step and capture's forward) ahead of time for a TPU slice from this "
                           "machine; print memory per chip of each program and of each stage (what it holds plus its "
                           "programs' working memory) and whether it fits HBM (exit 3 naming what does not), and the "
                           "run's cost from the step's FLOPs.")
    q.add_argument("--config", "--recipe", dest="config", default=None,
                   help="the recipe to compile: a name in configs/ or a YAML path (--recipe: the older name)")
    q.add_argument("overrides", nargs="*", metavar="section.key=value", help="dotted overrides")
    q.add_argument("--topology", default=None, help="TPU slice type, e.g. v5p-128 (default: the recipe's "
                   "launch.tpu_type)")
    q.add_argument("--num-slices", type=int, default=1)
    q.add_argument("--backend", default="auto", choices=("auto", "tpu", "cpu"),
                   help="tpu: XLA's TPU compiler through libtpu (tools/setup_libtpu.sh); cpu: a simulated CPU mesh of "
                   "the same shape; auto (default): tpu when libtpu is found, else cpu")
    q.add_argument("--libtpu", default=None, help="path of libtpu.so (default: $TPU_LIBRARY_PATH or the cache of "
                   "tools/setup_libtpu.sh)")
    q.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation for the time estimate (0.4)")
    q.add_argument("--no-engine", action="store_true", help="the train step only")
    q.add_argument("--json", default=None, help="also write the report as JSON to this file")
    q.set_defaults(func=cmd_launch_compile)


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    """--block-size, --tree-nodes, --tree-ngram and --draft-rule (`serve` and `eval`): overrides of the recipe's
    `serve` section, the decode plan (`serve.plan`)."""
    p.add_argument("--block-size", default=None,
                   help="K at inference: a number >= 2, 0 (the drafter's training K) or 'auto' (the K <= the training "
                   "K with the most expected tokens per second, from measured acceptance and step cost); default the "
                   "recipe's serve.block_size")
    p.add_argument("--tree-nodes", default=None,
                   help="verify a best-first tree of N nodes per step built from the block's distributions (0: the "
                   "chain of K; 'auto': the N with the most tokens per second, measured at start-up); default "
                   "the recipe's serve.tree_nodes")
    p.add_argument("--tree-ngram", action="store_true",
                   help="merge a prompt-lookup path (n-gram match in the prompt + output) into the tree")
    from dflash.serve.config import DRAFT_RULES

    p.add_argument("--draft-rule", choices=DRAFT_RULES, default=None,
                   help="how sampled requests draft: argmax (one-hot drafts) or sample (drawn from the drafter's "
                   "distribution, speculative sampling; a tree's children drawn without replacement, D84); both "
                   "lossless, on the chain and on a tree; default the recipe's serve.draft_rule")


def _add_pod_args(q: argparse.ArgumentParser, launcher: str) -> None:
    """The arguments of `dflash launch xpk` and `dflash launch gcluster` (docs/pods.md maps them to each tool's)."""
    q.add_argument("stage", choices=("regenerate", "capture", "train", "eval"))
    _add_config_args(q)
    q.add_argument("--cluster", required=True, help="the GKE cluster (made with `xpk cluster create` or a Cluster "
                   "Toolkit blueprint)")
    q.add_argument("--tpu-type", default=None, help="the slice type, e.g. v5p-128 (train) or v5p-8 (other stages), "
                   "named as xpk and Cloud TPU do (v5p: TensorCores, 2 per chip); not for regeneration through "
                   "data.regen.endpoint, which runs on a CPU node")
    q.add_argument("--cpu-type", default="n2-standard-32", help="the CPU machine type of regeneration through "
                   "data.regen.endpoint (a node pool of it in the cluster; default n2-standard-32)")
    q.add_argument("--num-slices", type=int, default=1, help="slices (multislice over DCN; train only; xpk only)")
    q.add_argument("--run-dir", required=True, help="gs://BUCKET/PATH: checkpoints, metrics, exports, eval")
    q.add_argument("--data-dir", default="", help="gs://BUCKET/PATH of data.dir (default: RUN_DIR/data)")
    q.add_argument("--image", default=None, help="the Docker image (docker/Dockerfile), e.g. "
                   "us-docker.pkg.dev/PROJECT/REPO/dflash-tpu:TAG (env DFLASH_IMAGE)")
    q.add_argument("--env", action="append", metavar="KEY[=VALUE]",
                   help="an environment variable of every pod (repeatable); KEY alone takes its value from this "
                   "environment at launch, e.g. --env HF_TOKEN --env WANDB_API_KEY (the value is then in the "
                   "workload's manifest: prefer --secret)")
    q.add_argument("--secret", action="append", metavar="NAME=projects/P/secrets/S[/versions/V]",
                   help="a Secret Manager secret read in every pod at start into variable NAME (repeatable); only the "
                   "reference travels, e.g. --secret HF_TOKEN=projects/my-project/secrets/hf-token")
    q.add_argument("--project", default="", help="GCP project (default: gcloud's)")
    q.add_argument("--zone", "--location", dest="zone", default="",
                   help="GCP zone (xpk --zone) or the cluster's location (gcluster --location); default: gcloud's")
    q.add_argument("--max-restarts", type=int, default=10,
                   help="restarts after preemption (exit 42) or a death by signal (default 10)")
    q.add_argument("--grace-period", type=int, default=0,
                   help="seconds from SIGTERM to SIGKILL (default: 300 for train, time for a step and a checkpoint; "
                   "30 for the other stages)")
    q.add_argument("--priority", default="medium", help="very-low, low, medium (default), high, very-high")
    q.add_argument("--args", default="", help="extra arguments of the stage's command, e.g. '--sets gsm8k --limit 80'")
    q.add_argument("--dry-run", action="store_true", help=f"print the {launcher} command and the workload; run nothing")
    if launcher == "xpk":
        q.add_argument("--workload", default="", help="workload name (default: RECIPE-STAGE-RUNNAME-HASH, 40 "
                       "characters)")
        q.add_argument("--spot", action="store_true", help="spot capacity")
        q.add_argument("--xpk", default=None, help="the xpk executable (default: .venv-xpk/bin/xpk from "
                       "tools/setup_xpk.sh, $XPK, or xpk on PATH)")
        q.add_argument("--manifest", default=None, help="also write the JobSet that xpk would apply to this file "
                       "(runs xpk's own dry run; needs --project and --zone)")
    else:
        q.add_argument("--name", default="", help="job name (default: RECIPE-STAGE-RUNNAME-HASH, at most 28 "
                       "characters)")
        q.add_argument("--service-account", default="", help="the Kubernetes service account of the pods (default: "
                       "the namespace's `default`); Workload Identity for --secret and the buckets, docs/pods.md")
        q.add_argument("--gcluster", default=None, help="the gcluster executable (default: $GCLUSTER or gcluster on "
                       "PATH)")
        q.add_argument("--manifest", default=None, help="write the JobSet gcluster would apply to this file instead "
                       "of submitting (gcluster's --dry-run-out; needs gcluster and the cluster)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description="DFlash drafter pipeline for JAX.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    # each command's arguments are defined beside its `cmd_*`, in the order `dflash --help` lists them
    add_demo_args(sub)
    add_chat_args(sub)
    add_train_args(sub)
    add_data_args(sub)
    add_serve_args(sub)
    add_eval_args(sub)
    add_launch_args(sub)
    add_export_args(sub)
    add_config_args(sub)
    return parser


# The stages that compile the engine, whose programs persist on disk between runs (serve/compile_cache.py, D78).
CACHED = ("serve", "chat", "demo", "eval", "data")


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. Multi-process (one process per host): set JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES and JAX_PROCESS_ID in each process's environment (see `_init_distributed`)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may also come after options (`dflash train --no-progress train.steps=5`), which argparse
    # leaves over once the positional list has been filled.
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if not args.verbose:
        logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax logs every save step at INFO
        logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU/proxy backend" notes
    try:
        if any(k.startswith("DFLASH_SECRET_") for k in os.environ):  # --secret references of a pod launch
            from dflash.launch.secrets import resolve_secrets

            log.info("secrets from Secret Manager: %s", ", ".join(resolve_secrets()))
        if args.command not in ("config", "launch", "export"):  # these never join a distributed run
            _init_distributed()
        if args.command in CACHED:
            from dflash.serve.compile_cache import enable_compile_cache

            enable_compile_cache()
        return args.func(args)
    except Exception as err:
        if not isinstance(err, _expected_errors()):
            raise  # a bug: its traceback is what to report
        print(f"dflash {args.command}: error: {err}", file=sys.stderr)
        return 2


def _expected_errors() -> tuple[type[Exception], ...]:
    """The errors of a wrong input (a value, a file, a URL, a model name), each naming the field, the value and the
    rule: they end a subcommand with its one-line message and exit status 2, never a traceback. ValueError covers
    ConfigError, ShardError, ManifestMismatchError, RequestRejected and a bad JSON file; OSError a missing or
    unreadable file and an unreachable host; the others are the stages' own errors about a server or the Hub, taken
    from their modules only when loaded (an error of a module never imported was not raised; importing
    data.endpoint would import JAX)."""
    own = [getattr(sys.modules[module], name) for module, name in _STAGE_ERRORS if module in sys.modules]
    return (ValueError, OSError, *own)


_STAGE_ERRORS = (("dflash.data.endpoint", "EndpointError"), ("dflash.eval.client", "ServerError"),
                 ("dflash.export.hub", "HubError"))

if __name__ == "__main__":
    sys.exit(main())
