"""`dflash eval`: drive a DFlash server and an AR server with the same prompts, record every reply, resume.

    records = collect({"dflash": dflash_client, "ar": ar_client}, settings, out_dir, items)  # records.jsonl
    results = summarize(records, ...); write_outputs(results, out_dir)   # eval.report

At concurrency 1 with both servers up (`evaluate`: the demo's in-process servers, `dflash eval --url --ar-url`),
each conversation runs on DFlash and on AR back to back, alternating which goes first, so that a drift of the
machine lands on both modes of a pair alike; the report's speedup is the median of the per-request ratios, with
its spread. `run_eval` (what `dflash eval --drafter` runs) starts the servers it needs ONE AT A TIME: the DFlash
server serves all its requests and stops, then the AR server starts; on an accelerator host both would claim the
same chips.

A warm-up request per set (not recorded) lets each server compile first (a `dflash serve` precompiles every
shape at start-up anyway); the engine's compile count (`dflash_compiles_total` at /metrics) is read before and
after each timed segment, and results.json records the difference per mode (`compiles`; it must be 0). Each
conversation's turns go one after another (MT-Bench's second turn follows the model's own first answer);
conversations run `concurrency` at a time. With `temperature` > 0 every request is sampled (top_p; turn t of
item i seeded from `seed`, the item id and t, the same seed for DFlash and AR); sampled replies are not compared
with AR's (lossless speculative sampling gives the target's distribution, not its draws: that rests on the
engine's sampled-decoding tests). Every reply is one fsynced JSONL line keyed by (mode, concurrency,
item id, turn), so a rerun into the same directory sends only what is missing. Each mode's records start with
the setup they were made with (the server's model, K, drafter fingerprint, the token budget and the sampling
settings): a rerun against another drafter, with another budget or another sampling rule, drops that mode's old
records instead of reporting them as its own.

The speculative server may be `dflash serve`, vLLM or SGLang (`eval.engines`: told from the server or named): τ and
acceptance by position come from that engine's own counts (our replies' `dflash` object, vLLM's Prometheus counters,
SGLang's per-request meta_info), recorded per reply (`accepted` from ours, `spec` from the others) or, for an engine
with only counters at concurrency above 1, pooled over the segment (a `spec` record).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dflash.data.eval_sets import SPEEDBENCH_HUB, EvalItem, load_eval_set
from dflash.data.progress import Progress
from dflash.eval.client import Client, ServerError
from dflash.eval.engines import Counts, DFlashEngine, Engine, Meter, engine_for

MODES = ("dflash", "ar")
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """What to send: prompt sets, items per set, new tokens per turn, client concurrencies, the sampling rule
    (temperature 0: greedy; top_p with temperature > 0; seed: the base of each request's seed), and the chat
    template's variables every request carries (`chat_template_kwargs`, e.g. gpt-oss's `{"reasoning_effort":
    "low"}` or Qwen3's `{"enable_thinking": false}`; empty: the template's defaults)."""

    sets: tuple[str, ...] = ("gsm8k", "mtbench")
    limit: int = 8
    max_new_tokens: int = 256
    concurrency: tuple[int, ...] = (1,)
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    speedbench: str = SPEEDBENCH_HUB  # where `speedbench[:...]` sets are read: hf:<id> or a directory of splits

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def sampling(self) -> dict[str, Any]:
        """The sampling settings a mode's records are made with (part of its setup)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed} if not self.greedy \
            else {"temperature": 0.0}

    def request_seed(self, item_id: str, turn: int) -> int | None:
        """The seed of turn `turn` of item `item_id` (None when greedy): stable across runs and modes."""
        return None if self.greedy else (self.seed + zlib.crc32(f"{item_id}#{turn}".encode())) % (1 << 31)

    def __post_init__(self) -> None:
        if not self.sets:
            raise ValueError("sets must name at least one prompt set")
        if self.limit < 1 or self.max_new_tokens < 1:
            raise ValueError(f"limit and max_new_tokens must be >= 1; received {self.limit}, {self.max_new_tokens}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency must list integers >= 1; received {self.concurrency}")
        if not (self.temperature >= 0 and self.temperature < float("inf")):
            raise ValueError(f"temperature must be >= 0 (0 = greedy); received {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1]; received {self.top_p}")
        if not isinstance(self.chat_template_kwargs, dict) or not all(
                isinstance(k, str) for k in self.chat_template_kwargs):
            raise ValueError("chat_template_kwargs must be an object of template variables, e.g. "
                             f'{{"reasoning_effort": "low"}}; received {self.chat_template_kwargs!r}')


class RecordStore:
    """The replies collected so far (`records.jsonl`), appended one fsynced line at a time."""

    def __init__(self, path: Path):
        self.path = path
        self.records: dict[tuple, dict[str, Any]] = {}
        self._lock = threading.Lock()
        if path.is_file():
            data = path.read_bytes()
            end = data.rfind(b"\n") + 1
            if end < len(data):  # a partial last line from an interrupted run
                with open(path, "r+b") as f:
                    f.truncate(end)
            for line in data[:end].decode("utf-8").splitlines():
                if line.strip():
                    record = json.loads(line)
                    self.records[self.key(record)] = record

    @staticmethod
    def key(record: dict[str, Any]) -> tuple:
        return record["kind"], record["mode"], record["concurrency"], record.get("id"), record.get("turn")

    def begin(self, mode: str, setup: dict[str, Any]) -> None:
        """Keep `mode`'s records only if they were made with `setup`; otherwise drop them (logged) and record
        `setup`, so that replies of another drafter or budget are never reported as this run's."""
        record = {"kind": "setup", "mode": mode, "concurrency": None, "setup": setup}
        previous = self.records.get(self.key(record), {}).get("setup", "unrecorded")
        if previous == setup:
            return
        stale = [key for key in self.records if key[1] == mode]
        if any(key[0] == "reply" for key in stale):
            log.warning("%s: the %s replies recorded there were made with another setup (%s, now %s); measuring "
                        "them again", self.path, mode, previous, setup)
        with self._lock:
            for key in stale:
                del self.records[key]
            self.records[self.key(record)] = record
            tmp = self.path.with_name(self.path.name + ".tmp")
            with open(tmp, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in self.records.values())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)

    def select(self, settings: EvalSettings, items: Sequence[EvalItem]) -> list[dict[str, Any]]:
        """The records of `settings`' concurrencies: the segments' (wall, compiles, spec) and `items`' replies."""
        wanted = {item.id for item in items}
        return [r for r in self.records.values() if r["concurrency"] in settings.concurrency
                and (r["kind"] in ("wall", "compiles", "spec") or r["id"] in wanted)]

    def has_conversation(self, mode: str, concurrency: int, item: EvalItem) -> bool:
        return all(("reply", mode, concurrency, item.id, t) in self.records for t in range(len(item.turns)))

    def add(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.records[self.key(record)] = record
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())


def _conversation(client: Client, model: str, item: EvalItem, mode: str, concurrency: int, settings: EvalSettings,
                  store: RecordStore, bar: Progress, meter: Meter | None = None) -> float:
    """One conversation's turns; each reply recorded with its speculative counts (`accepted` from our engine,
    `spec` from another engine's counts: `eval.engines`) and how it was timed (`timing`). Returns the seconds its
    requests took (not the counter reads around them, nor the bookkeeping)."""
    messages: list[dict[str, str]] = []
    busy = 0.0
    for turn, text in enumerate(item.turns):
        messages.append({"role": "user", "content": text})
        before = meter.before(concurrency) if meter else None
        t0 = time.perf_counter()
        reply = client.chat(model, messages, settings.max_new_tokens, settings.temperature, settings.top_p,
                            settings.request_seed(item.id, turn), settings.chat_template_kwargs)
        busy += time.perf_counter() - t0
        counts = meter.after(reply, before, concurrency) if meter else None
        messages.append({"role": "assistant", "content": reply.text})
        ours = meter is None or isinstance(meter.engine, DFlashEngine)
        store.add({"kind": "reply", "mode": mode, "concurrency": concurrency, "id": item.id, "set": item.set,
                   **({"category": item.category} if item.category else {}), "turn": turn, "text": reply.text,
                   "tokens": reply.tokens, "finish": reply.finish_reason,
                   "latency_s": reply.latency_s, "ttft_s": reply.ttft_s, "tpot_s": reply.tpot_s,
                   "accepted": reply.accepted,
                   **({} if ours else {"spec": counts.to_json() if counts else None,
                                       "timing": getattr(reply, "timing", "stream")})})
        bar.update(1, tokens=reply.tokens)
    return busy


def _record_segment(store: RecordStore, mode: str, concurrency: int, items: Sequence[EvalItem], seconds: float,
                    compiles_before: int | None, compiles_after: int | None) -> None:
    """A finished timed segment of `mode`: its wall time and tokens (added to earlier segments') and the programs its
    server compiled inside it (`compiles`, which must stay 0)."""
    tokens = sum(store.records["reply", mode, concurrency, item.id, t]["tokens"]
                 for item in items for t in range(len(item.turns)))
    previous = store.records.get(("wall", mode, concurrency, None, None), {"seconds": 0.0, "tokens": 0})
    store.add({"kind": "wall", "mode": mode, "concurrency": concurrency,
               "seconds": previous["seconds"] + seconds, "tokens": previous["tokens"] + tokens})
    grown = None if compiles_before is None or compiles_after is None else compiles_after - compiles_before
    earlier = store.records.get(("compiles", mode, concurrency, None, None), {"count": 0})["count"]
    store.add({"kind": "compiles", "mode": mode, "concurrency": concurrency,
               "count": None if grown is None or earlier is None else earlier + grown})
    if grown:
        log.warning("%s server compiled %d program(s) inside the timed requests (concurrency %d)", mode, grown,
                    concurrency)


def _run_paired(clients: dict[str, Client], items: Sequence[EvalItem], settings: EvalSettings, store: RecordStore,
                progress: bool, meters: dict[str, Meter] | None = None) -> None:
    """Concurrency 1 with both servers up: each conversation runs on DFlash and on AR back to back, the order
    alternating from one conversation to the next, so a drift of the machine lands on both modes of a pair alike
    (the report's speedup is the median of the per-request ratios)."""
    todo = [item for item in items if any(not store.has_conversation(m, 1, item) for m in clients)]
    if not todo:
        return
    models = {mode: client.model() for mode, client in clients.items()}
    before = {mode: client.compiles() for mode, client in clients.items()}
    seconds = dict.fromkeys(clients, 0.0)
    ran: dict[str, list[EvalItem]] = {mode: [] for mode in clients}
    bar = Progress(sum(len(i.turns) for i in todo for m in clients if not store.has_conversation(m, 1, i)),
                   desc="eval paired c=1", unit="reply", enabled=progress)
    for i, item in enumerate(todo):
        for mode in (list(clients) if i % 2 == 0 else list(reversed(clients))):
            if store.has_conversation(mode, 1, item):
                continue
            seconds[mode] += _conversation(clients[mode], models[mode], item, mode, 1, settings, store, bar,
                                           (meters or {}).get(mode))
            ran[mode].append(item)
    bar.close()
    for mode, client in clients.items():
        if ran[mode]:
            _record_segment(store, mode, 1, ran[mode], seconds[mode], before[mode], client.compiles())


def _run_mode(client: Client, mode: str, concurrency: int, items: Sequence[EvalItem], settings: EvalSettings,
              store: RecordStore, progress: bool, meter: Meter | None = None) -> None:
    todo = [item for item in items if not store.has_conversation(mode, concurrency, item)]
    if not todo:
        return
    model = client.model()
    compiles_before = client.compiles()
    pooled = meter.pooled_before(concurrency) if meter else None
    bar = Progress(sum(len(i.turns) for i in todo), desc=f"eval {mode} c={concurrency}", unit="reply",
                   enabled=progress)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        busy = sum(future.result() for future in [
            pool.submit(_conversation, client, model, item, mode, concurrency, settings, store, bar, meter)
            for item in todo])
    bar.close()
    # Throughput counts the replies of finished segments only: an interrupted segment left no wall time. One request
    # at a time, the segment's time is its requests' (a counter engine's reads between them left out).
    seconds = busy if concurrency == 1 else time.perf_counter() - t0
    _record_segment(store, mode, concurrency, todo, seconds, compiles_before, client.compiles())
    if pooled is not None and meter is not None and (counts := meter.pooled_after(pooled)) is not None:
        # An engine with only counters, requests in flight together: its counts pooled over the segment.
        previous = store.records.get(("spec", mode, concurrency, None, None))
        total = counts if previous is None else counts + Counts.from_json(previous["counts"])
        store.add({"kind": "spec", "mode": mode, "concurrency": concurrency, "counts": total.to_json()})


def warm_up(client: Client, items: Sequence[EvalItem], settings: EvalSettings) -> None:
    """First turns of each set's first item, not recorded, under the run's sampling rule: the server compiles
    its common shapes here, not inside the timed requests."""
    model = client.model()
    for item in {item.set: item for item in reversed(items)}.values():
        client.chat(model, [{"role": "user", "content": item.turns[0]}], settings.max_new_tokens,
                    settings.temperature, settings.top_p, settings.request_seed(item.id, 0),
                    settings.chat_template_kwargs)


def collect(clients: dict[str, Client], settings: EvalSettings, out_dir: Path, items: Sequence[EvalItem],
            progress: bool = True, engines: dict[str, Engine] | None = None,
            speculative: Sequence[str] = ("dflash",)) -> list[dict[str, Any]]:
    """Send `items` (the sets' conversations) to the servers of `clients` (mode -> client: "dflash", "ar" or
    both) at every concurrency; the records of both modes, old and new. `engines`: mode -> the engine serving it
    (`eval.engines.engine_for`, which also set how its client sends requests; default: ours); the speculative modes'
    counts (`speculative`: "dflash"; benchmarks/vs_vllm.py names one per engine, all paired) are read the engine's
    way."""
    out_dir.mkdir(parents=True, exist_ok=True)
    store = RecordStore(out_dir / "records.jsonl")
    engines = {mode: (engines or {}).get(mode) or DFlashEngine() for mode in clients}
    meters = {mode: Meter(engines[mode], client, measure=mode in speculative) for mode, client in clients.items()}
    for mode, client in clients.items():
        served = engines[mode].describe(client)
        store.begin(mode, {"model": served["id"], "block_size": served["block_size"], "drafter": served["drafter"],
                           "max_new_tokens": settings.max_new_tokens,
                           **({} if settings.greedy else {"sampling": settings.sampling}),
                           **({"chat_template_kwargs": settings.chat_template_kwargs}
                              if settings.chat_template_kwargs else {}),
                           **({} if isinstance(engines[mode], DFlashEngine) else {"engine": engines[mode].name})})
        if any(not store.has_conversation(mode, c, i) for c in settings.concurrency for i in items):
            warm_up(client, items, settings)
    for concurrency in settings.concurrency:
        if concurrency == 1 and len(clients) > 1:
            _run_paired(clients, items, settings, store, progress, meters)
            continue
        for mode, client in clients.items():
            _run_mode(client, mode, concurrency, items, settings, store, progress, meters[mode])
    return store.select(settings, items)


def environment() -> dict[str, Any]:
    import datetime
    import platform

    return {"python": platform.python_version(), "machine": f"{platform.machine()} {os.cpu_count()} cores",
            "date": datetime.date.today().isoformat()}


def evaluate(dflash_url: str, ar_url: str, settings: EvalSettings, out_dir: str | Path, *,
             drafter: dict[str, Any] | None = None, api_key: str | None = None, progress: bool = True,
             engine: str = "auto", items: Sequence[EvalItem] | None = None) -> tuple[dict[str, Any], dict[str, Path]]:
    """Evaluate the speculative server at `dflash_url` (served by `engine`: dflash, vllm, sglang, or auto: told from
    the server) against the AR server at `ar_url` (same target, same prompts; its engine told from the server),
    paired at concurrency 1; writes results.json, report.md and the plots into `out_dir`; returns (results, paths).
    `items`: the sets' conversations when the caller loaded them already (default: `eval_items(settings)`)."""

    out_dir = Path(out_dir).expanduser()
    items = eval_items(settings) if items is None else list(items)
    clients = {"dflash": Client(dflash_url, api_key), "ar": Client(ar_url, api_key)}
    engines = {"dflash": engine_for(clients["dflash"], engine), "ar": engine_for(clients["ar"], fallback=True)}
    served = engines["dflash"].describe(clients["dflash"])
    _check_same_target(clients["ar"], served)
    records = collect(clients, settings, out_dir, items, progress, engines)
    return _results(records, items, served, dflash_url, settings, out_dir, drafter, engines)


def eval_items(settings: EvalSettings) -> list[EvalItem]:
    return [item for name in settings.sets for item in load_eval_set(name, settings.limit, settings.speedbench)]


def check_reachable(url: str, api_key: str | None = None, flag: str = "--url") -> None:
    """A ServerError naming `flag` and `url` unless a server answers GET /v1/models there: a wrong URL is refused
    before any server is started here."""
    try:
        Client(url, api_key, timeout=10.0).get("/v1/models")
    except ServerError as err:
        raise ServerError(f"{flag} must be the address of a running OpenAI-compatible server; received {url!r}, "
                          f"where {err}") from err


def _check_same_target(ar: Client, served: dict[str, Any]) -> None:
    if ar.model() != served["id"]:
        raise ValueError(f"the AR server serves {ar.model()!r} and the DFlash server {served['id']!r}; both must "
                         "serve the same target")


def _results(records: list[dict[str, Any]], items: Sequence[EvalItem], served: dict[str, Any], dflash_url: str,
             settings: EvalSettings, out_dir: Path, drafter: dict[str, Any] | None,
             engines: dict[str, Engine] | None = None) -> tuple[dict[str, Any], dict[str, Path]]:
    from dflash.eval.report import summarize, write_outputs

    answers = {item.id: item.answer for item in items if item.answer}
    block_size = int(served.get("block_size") or 0)
    engines = engines or {}
    speculative = engines.get("dflash") or DFlashEngine()
    meta = {"environment": environment(), "target": {"model": served["id"]},
            "drafter": {"url": dflash_url, **(drafter or {})},
            "settings": {**dataclasses.asdict(settings), "block_size": block_size},
            "engine": {"dflash": speculative.name, "ar": engines["ar"].name if "ar" in engines else "dflash",
                       "source": speculative.source, "unavailable": speculative.unavailable()}}
    results = summarize(records, settings.sets, settings.concurrency, block_size, answers, meta,
                        compare=settings.greedy)
    results["compiles"] = timed_compiles(records)
    return results, write_outputs(results, out_dir)


def timed_compiles(records: Sequence[dict[str, Any]]) -> dict[str, int | None]:
    """Programs each mode's server compiled inside its timed requests (None: the server does not say)."""
    out: dict[str, int | None] = {}
    for r in records:
        if r["kind"] == "compiles":
            known = out.get(r["mode"], 0)
            out[r["mode"]] = None if known is None or r["count"] is None else known + r["count"]
    return out


def template_variables(given: dict[str, Any] | None, recipe_kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The chat template's variables `dflash eval` sends with every request, and where they came from: `given`
    (`--chat-template-kwargs`) when it is not None, else the recipe's `data.regen.template_kwargs`, the variables its
    training answers were made with (and its real-τ prompts rendered with: a Qwen3 drafter trained on non-thinking
    answers is measured on non-thinking replies, gpt-oss at the recipe's effort and date)."""
    if given is not None:
        return dict(given), "--chat-template-kwargs"
    return dict(recipe_kwargs), "the recipe's data.regen.template_kwargs"


BEST_RESULTS = "results.json"  # <run_dir>/best/results.json: `dflash eval` of that best drafter, for its model card


def keep_with_best(results: dict[str, Any], best: Path, step: int) -> bool:
    """Store `results` (an evaluation of the best drafter of step `step`) inside `best` as BEST_RESULTS, so that
    best/ copied alone still carries its model card's eval table; not when best/ was replaced meanwhile (a run
    still training kept a newer drafter: those results are not its). Returns whether it was stored."""
    from dflash.data.files import write_atomic
    from dflash.models.drafter_io import BEST_JSON

    try:
        current = json.loads((best / BEST_JSON).read_text()).get("step")
    except (OSError, json.JSONDecodeError):
        current = None
    if current != step:
        log.warning("%s now holds the drafter of step %s, not the evaluated step %s: these results stay in the eval "
                    "directory only", best, current, step)
        return False
    write_atomic(best / BEST_RESULTS, json.dumps(results, indent=1) + "\n")
    return True


@dataclasses.dataclass(frozen=True)
class ServeArgs:
    """What each `dflash serve` subprocess `run_eval` starts is given: the recipe `config` with its `overrides` (its
    `serve` section, with them, is the DFlash server's decode plan), over `devices` of the host's devices
    (`dflash serve --devices`)."""

    config: str = "default"
    overrides: Sequence[str] = ()
    devices: int = 1


def run_eval(settings: EvalSettings, out_dir: str | Path, *, url: str | None = None, ar_url: str | None = None,
             drafter: str | None = None, step: str | None = None, serve: ServeArgs = ServeArgs(),
             api_key: str | None = None, progress: bool = True,
             engine: str = "auto") -> tuple[dict[str, Any], dict[str, Path]]:
    """`dflash eval`: the speculative server at `url` (served by `engine`: dflash, vllm, sglang, or auto: told from
    the server), or a `dflash serve` subprocess of `drafter` (a run dir or an export; `step`: N or best, which falls
    back to the newest checkpoint where a run kept no best/) started here, against the AR baseline at `ar_url`, or
    the target alone served by that same subprocess (`dflash serve --ar-port`: one process, one copy of the weights,
    one chip, as a TPU host needs) or, beside a given `url`, a `dflash serve --ar` subprocess of the same recipe;
    subprocesses get `serve` (`ServeArgs`: recipe, overrides, devices). Both servers are up together: at
    concurrency 1 each conversation runs on both back to back (paired; `collect`). Subprocess logs go to
    out_dir/server*.log; servers stop at the end."""
    config, overrides, devices = serve.config, serve.overrides, serve.devices
    import contextlib

    from dflash.eval import servers

    if (url is None) == (drafter is None):
        raise ValueError("pass exactly one of --url (a running speculative server: dflash serve, vLLM, SGLang) and "
                         "--drafter (a run dir or export)")
    best, best_step = None, None
    if drafter is not None:  # --step best of a run that kept no best/: its newest checkpoint, said so
        from dflash.models.drafter_io import BEST_JSON, best_dir_of, best_or_latest

        step, fallback = best_or_latest(drafter, step)
        if fallback:
            log.warning("%s", fallback)
        best = best_dir_of(drafter, step)
        best_step = json.loads((best / BEST_JSON).read_text()).get("step") if best is not None else None
    out_dir = Path(out_dir).expanduser()
    items = eval_items(settings)  # a wrong set name or file is refused before any server starts
    for flag, given in (("--url", url), ("--ar-url", ar_url)):
        if given is not None:
            check_reachable(given, api_key, flag)
    common = ["--config", config, "--devices", str(devices), *(["--api-key", api_key] if api_key else []),
              *overrides]
    slots = int(max(settings.concurrency))
    args = ["--drafter", drafter, *(["--step", step] if step else [])] if drafter else []
    with contextlib.ExitStack() as stack:
        if url is None and ar_url is None:
            url, ar_url = stack.enter_context(servers.serve_pair_subprocess([*args, *common], out_dir / "server.log",
                                                                            slots))
        elif url is None:
            url = stack.enter_context(servers.serve_subprocess([*args, *common], out_dir / "server-dflash.log", slots))
        elif ar_url is None:
            ar_url = stack.enter_context(servers.serve_subprocess(["--ar", *common], out_dir / "server-ar.log", slots))
        described = {"path": drafter, "step": step, **({"best_step": best_step} if best is not None else {})}
        results, paths = evaluate(url, ar_url, settings, out_dir, drafter=described if drafter else None,
                                  api_key=api_key, progress=progress, engine="dflash" if drafter else engine,
                                  items=items)
    if best is not None and keep_with_best(results, best, best_step):
        log.info("the results of the best drafter (step %s) are kept in %s too (its model card's eval table)",
                 best_step, best / BEST_RESULTS)
    return results, paths


__all__ = ["BEST_RESULTS", "MODES", "EvalSettings", "RecordStore", "ServeArgs", "check_reachable", "collect",
           "environment", "evaluate", "keep_with_best", "run_eval", "template_variables", "timed_compiles", "warm_up"]
