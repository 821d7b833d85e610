"""`dflash serve` as one library call: a recipe's target and drafter behind the OpenAI-compatible server.

    serve_recipe(load_recipe("smollm2"), ServeOptions(port=8000))     # until SIGINT / SIGTERM

`build_servers` does everything but serving: load the target and the drafter, make the decode plan of the recipe's
`serve` section (`serve.plan.plan_from`; `auto` values measured here by `serve.acceptance.Measured` on held-out
prompts), build the engine and a bound server. `dflash serve`'s --block-size, --tree-nodes, --tree-ngram and
--draft-rule are overrides of that section. With `ar_port`, a second server answers on that port with the target
alone (AR), over the same weights in this process: both modes on one chip, as a paired `dflash eval` needs on a
TPU host, where a second process could not open the chip. `dflash demo`'s evaluation serves the same way
(`build_servers` over the target it already holds, then `running`): one way to serve a recipe.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from dflash.configs.recipe import Recipe
from dflash.data.eval_sets import EvalPrompt, eval_prompts
from dflash.launch.resident import slot_bytes
from dflash.models.drafter_io import load_drafter, read_best
from dflash.models.placement import GIB, free_bytes, log_memory_per_device
from dflash.models.sharding import tensor_mesh
from dflash.models.target import load_target
from dflash.models.tokenizer import ChatTokenizer
from dflash.serve.acceptance import Measured
from dflash.serve.compile_cache import converted_dir
from dflash.serve.engine import Engine
from dflash.serve.http import DFlashServer, HttpLimits, make_server, running
from dflash.serve.plan import AR, Limits, plan_from

AUTO_SETS = ("gsm8k", "mtbench", "humaneval")  # the held-out prompts `auto` measures on: 2 of each
# `--slots auto`: the most slots (a power of two) whose caches fit SLOT_MEMORY_SHARE of what the devices have free
# once the weights are placed (the rest: the steps' working memory and the compiled programs), at most
# MAX_AUTO_SLOTS on an accelerator and CPU_AUTO_SLOTS on CPU devices, where the cores, not memory, bound what more
# concurrent requests add (docs/serving.md "What a slot costs"; D99).
SLOT_MEMORY_SHARE = 0.5
MAX_AUTO_SLOTS = 64
CPU_AUTO_SLOTS = 8

AUTO_PER_SET = 2


def auto_prompts(recipe: Recipe, tokenizer: ChatTokenizer, say: Callable[[str], None]) -> list[EvalPrompt]:
    """The held-out prompts a `serve.block_size` / `serve.tree_nodes` of `auto` is measured on (`serve.acceptance.
    Measured`): AUTO_PER_SET of each of AUTO_SETS, rendered with the recipe's `data.regen.template_kwargs`, the
    variables its drafter's answers were made with (a Qwen3 drafter trained on non-thinking answers is measured on
    non-thinking replies; D93); says which it used."""
    kwargs = dict(recipe.data.regen.template_kwargs)
    say(f"auto: measured on {AUTO_PER_SET} prompts of each of {', '.join(AUTO_SETS)}, chat-template variables "
        f"{json.dumps(kwargs, sort_keys=True)} (data.regen.template_kwargs)")
    return eval_prompts(tokenizer, AUTO_SETS, AUTO_PER_SET, template_kwargs=kwargs)


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """How to serve a recipe (`dflash serve`'s flags; what it drafts and verifies is the recipe's `serve` section).

    drafter: a `dflash train` run dir or an exported drafter dir (None: the recipe's train.run_dir); step: a
    checkpoint step of a run dir, "best", or None (the latest); ar: serve the target alone; slots ("auto": sized to
    the devices' free memory once the weights are placed, `auto_slots`), prefill_chunk
    (0: off), steps_per_dispatch and devices (the host's devices the target is split over, tensor parallel; 0:
    all of them): the engine's `Limits` (checked when the server is built, before anything loads); model_name:
    the model id clients send (None: target.source); precompile: compile every shape the engine can use before
    serving (`Engine.precompile`; False: requests compile as they come); ar_port: also serve the target alone (AR)
    on this port (0: any free port), sharing the loaded weights, each mode with its own engine thread and paged
    cache; precompile_logprobs: precompile the log-probability variants too (False: a server whose only client
    never asks for them, as `dflash demo`'s evaluation; such a request would compile); the rest as `make_server`'s
    arguments."""

    drafter: str | Path | None = None
    step: int | str | None = None
    ar: bool = False
    slots: int | str = "auto"
    prefill_chunk: int = 512
    steps_per_dispatch: int = 4
    devices: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    read_timeout: float | None = 30.0
    unknown_fields: str = "ignore"
    precompile: bool = True
    precompile_logprobs: bool = True
    ar_port: int | None = None

    def drafter_dir(self, recipe: Recipe) -> Path:
        return Path(self.drafter or recipe.train.run_dir).expanduser()

    def limits(self, max_len: int, slots: int | None = None) -> Limits:
        """The engine's limits (`slots` resolves "auto"; until then it is checked at one slot)."""
        if slots is None and self.slots != "auto":
            if not isinstance(self.slots, int) or isinstance(self.slots, bool):
                raise ValueError(f"slots must be an integer >= 1 or 'auto'; received {self.slots!r}")
            slots = self.slots
        devices = self.devices or len(jax.local_devices())
        return Limits(slots=1 if slots is None else slots, max_len=max_len, prefill_chunk=self.prefill_chunk or None,
                      steps_per_dispatch=self.steps_per_dispatch, devices=devices)


def auto_slots(per_slot: int, free: int, cpu: bool) -> tuple[int, str]:
    """`--slots auto`: the largest power of two n <= the cap (CPU_AUTO_SLOTS on CPU devices, else MAX_AUTO_SLOTS)
    whose n x `per_slot` bytes fit SLOT_MEMORY_SHARE of `free` bytes (at least 1), and the line that says why."""
    cap = CPU_AUTO_SLOTS if cpu else MAX_AUTO_SLOTS
    budget = int(free * SLOT_MEMORY_SHARE)
    n = 1
    while n * 2 <= cap and n * 2 * per_slot <= budget:
        n *= 2
    bound = (f"the cap on {'CPU devices' if cpu else 'accelerators'}" if n == cap
             else f"{SLOT_MEMORY_SHARE:.0%} of the free memory")
    return n, (f"slots: auto -> {n} (a slot holds {per_slot / GIB:.3f} GiB per device; {free / GIB:.1f} GiB free "
               f"per device after the weights; bound by {bound}; --slots N sets it)")


MAP_WARN_SHARE = 0.8  # the share of vm.max_map_count past which `dflash serve` warns (XLA CPU's programs map memory)


def map_limit_note(maps: str | Path = "/proc/self/maps",
                   limit: str | Path = "/proc/sys/vm/max_map_count") -> str | None:
    """A warning when this process's memory maps pass MAP_WARN_SHARE of Linux's per-process limit, else None (and
    None where either file is unreadable: not Linux). XLA's CPU backend maps memory for every compiled program
    (~310 maps each, measured on SmolLM2's engine); at the limit (65530 by default) the next compile ends the process
    with `LLVM ERROR: Unable to allocate section memory` (a 16-slot CPU server's DFlash and AR engines hold ~150
    programs; docs/serving.md)."""
    try:
        used = sum(1 for _ in Path(maps).open())
        cap = int(Path(limit).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if used < MAP_WARN_SHARE * cap:
        return None
    return (f"warning: this process holds {used} memory maps of the {cap} Linux allows one process "
            "(vm.max_map_count); XLA's CPU programs map memory and a compile past the limit ends the process with "
            "'LLVM ERROR: Unable to allocate section memory'. Serve fewer slots or one engine per process, or raise "
            "the limit: sysctl -w vm.max_map_count=262144")


def _print(text: str) -> None:
    print(text, flush=True)


def build_servers(recipe: Recipe, options: ServeOptions, target: Any = None,
                  say: Callable[[str], None] = _print) -> list[DFlashServer]:
    """Load the recipe's target (unless given one already loaded: `target`) and (unless `options.ar`) the drafter,
    make the decode plan, build the engine (the recipe's sampling as the requests' default) and return a bound
    server with its engine thread started; with `options.ar_port`, a second one serving the target alone over the
    same weights (AR). Checks the options before anything loads; what it measures and sizes goes to `say`."""
    max_len = recipe.target.max_seq_len
    limits = options.limits(max_len)  # checked before anything loads ("auto": at one slot, resolved below)
    for flag, port in (("--port", options.port), ("--ar-port", options.ar_port)):
        if port is not None and not 0 <= port <= 65535:
            raise ValueError(f"{flag} must be a TCP port in [0, 65535] (0: any free one); received {port}")
    if options.ar_port is not None and (options.ar or options.ar_port == options.port != 0):
        raise ValueError(f"--ar-port must be another port than --port of a DFlash server; received "
                         f"ar_port={options.ar_port}, port={options.port}, ar={options.ar}")
    source = None if options.ar else options.drafter_dir(recipe)
    given = target is not None
    if target is None:
        target = load_target(recipe.target, converted_dir())  # a GGUF dequantised once, then read back (D78)
    drafter = None if source is None else load_drafter(source, target.cfg, step=options.step)
    chooser = None
    if drafter is not None and "auto" in (recipe.serve.block_size, recipe.serve.tree_nodes):
        best = read_best(source) if source.is_dir() else None
        accept = (best["accept_per_position"], f"{source}/best/best.json (step {best.get('step')})") \
            if best and "accept_per_position" in best else None
        chooser = Measured(target, auto_prompts(recipe, target.tokenizer, say), max_len=max_len, accept=accept,
                           say=say)
    plans = [(plan_from(recipe.serve, drafter, chooser), options.port)]
    if options.ar_port is not None:
        plans.append((AR(), options.ar_port))
    # one device: the target whole on it; several: read straight onto the engine's mesh, each device its share (the
    # engine places what it is given by the same table, so these arrays are its own: no second copy)
    local = jax.local_devices()[:limits.devices]
    if limits.devices > 1 and not given:
        vars(target).pop("params", None)  # `auto`'s measurement ran on one device: that whole copy is not kept
    params = target.params if limits.devices == 1 else target.on(tensor_mesh(local))
    if options.slots == "auto":
        per_slot = slot_bytes(target.cfg, None if drafter is None else drafter.arch, max_len, params["embed"].dtype,
                              limits.devices, engines=len(plans))
        slots, why = auto_slots(per_slot, free_bytes(local), cpu=local[0].platform == "cpu")
        say(why)
        limits = options.limits(max_len, slots)
    servers = []
    for plan, port in plans:
        engine = Engine(params, target.cfg, None if plan.ar else drafter, plan, limits, sampling=recipe.sampling)
        params = engine.models.target_params  # placed once: the AR engine holds the same arrays, no second copy
        if options.precompile:
            count, seconds = engine.precompile(logprobs=options.precompile_logprobs)
            say(f"precompiled {count} programs for {plan.describe()} in {seconds:.1f} s, {engine.loaded} of them "
                f"loaded from the compilation cache (every prompt length and attention span up to {max_len} tokens; "
                "--no-precompile skips this)")
        servers.append(make_server(engine, target.tokenizer, options.model_name or recipe.target.source,
                                   options.host, port, limits=HttpLimits(options.max_body_bytes, options.read_timeout),
                                   api_key=options.api_key, unknown_fields=options.unknown_fields))
    log_memory_per_device("serve")  # weights, pages and slots of every engine, before the first request
    if local[0].platform == "cpu" and (note := map_limit_note()):
        say(note)
    return servers



def build_server(recipe: Recipe, options: ServeOptions) -> DFlashServer:
    """`build_servers` without a companion AR server."""
    return build_servers(recipe, dataclasses.replace(options, ar_port=None))[0]


def serve_recipe(recipe: Recipe, options: ServeOptions) -> None:
    """`build_server`, then serve until SIGINT or SIGTERM (which finish the requests in flight); call from the
    main thread (signal handlers are installed)."""
    servers = build_servers(recipe, options)
    for i, server in enumerate(servers):
        plan = server.worker.engine.plan
        mode = plan.describe() + ("" if options.ar or i else f" (drafter {options.drafter_dir(recipe)})")
        devices = server.worker.engine.limits.devices
        print(f"serving {server.model_name} on http://{options.host}:{server.server_address[1]}/v1 - {mode}, "
              f"{server.worker.engine.slots} slots" + (f", {devices} devices" if devices > 1 else "")
              + "; Ctrl-C stops",
              flush=True)
    main, *others = servers
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in others]
    for thread in threads:
        thread.start()

    def stop(*_: object) -> None:
        for server in servers:
            threading.Thread(target=server.close, daemon=True).start()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    main.serve_forever()
    for server in servers:
        server.worker.shutdown()
    for thread in threads:
        thread.join(timeout=30)


__all__ = ["ServeOptions", "build_server", "build_servers", "running", "serve_recipe"]
