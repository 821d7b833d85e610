"""Which engine serves a URL, and how `dflash eval` reads its speculative-decoding counts: τ and acceptance by draft
position from each engine's own statistics.

    engine = engine_for(client, "auto")       # dflash, vllm or sglang: from /v1/models owned_by, /metrics, ...
    meter = Meter(engine, client)             # per mode; configures how requests are sent (stream, extra fields)
    before = meter.before(concurrency); reply = client.chat(...); counts = meter.after(reply, before, concurrency)

Every count is a `Counts`: verify steps, draft tokens accepted over them (the bonus token not included), steps whose
draft at position i was accepted, and (where known) steps with exactly j drafts accepted; τ = 1 + accepted / steps,
bonus counted, as for our engine.

- **dflash** (`dflash serve`): the `dflash` object of each streamed reply (`accepted_per_step`): per request.
- **vllm** (vLLM, tpu-inference): its Prometheus counters at /metrics (`vllm/v1/spec_decode/metrics.py`):
  `vllm:spec_decode_num_drafts_total` (verify steps: one per request per step that carried drafts),
  `vllm:spec_decode_num_draft_tokens_total`, `vllm:spec_decode_num_accepted_tokens_total` and
  `vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}` (steps whose draft i was accepted), summed over
  the `engine` / `model_name` labels. vLLM's own "mean acceptance length" is 1 + accepted / drafts: τ here. Read
  before and after each request at concurrency 1 (the deltas are that request's: nobody else may use the server
  meanwhile; the read after waits until `vllm:request_success_total` has counted the request, which vLLM records with
  the same step's counts), or around a whole segment at higher concurrency (pooled over the run, said so).
- **sglang** (SGLang, sglang-jax): the request's `meta_info` (`return_meta_info: true`), which SGLang refuses on a
  streamed chat request, so requests to SGLang go unstreamed: `spec_verify_ct` (verify steps), `completion_tokens`
  (τ = (completion_tokens - 1) / spec_verify_ct: SGLang's own `spec_accept_length` is completion_tokens /
  spec_verify_ct, which also counts the first token, made by the prefill and no verify step) and, where SGLang sends
  it, `spec_accept_histogram` (steps with j drafts accepted: acceptance by position). The reply's time per output
  token comes from its `prefill_finished_ts` / `decode_finished_ts` (the server's clock; `timing: server`), or,
  without them, from the whole request (`timing: latency`, prefill included).

An engine that reports no speculative counts (an AR server, a server started without its speculative flags) gives
τ None with a note, "τ not available from <engine> ...": speed is still measured.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from dflash.eval.client import Client, Reply, ServerError

ENGINES = ("dflash", "vllm", "sglang")
log = logging.getLogger(__name__)

VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
VLLM_FINISHED = "vllm:request_success_total"


@dataclasses.dataclass(frozen=True)
class Counts:
    """Speculative counts over some verify steps: `steps`, draft tokens `accepted` over them (no bonus),
    `per_position[i]`: steps whose draft i (0-based) was accepted; `hist[j]`: steps with exactly j drafts accepted
    (empty where the engine does not say)."""

    steps: int
    accepted: int
    per_position: tuple[int, ...] = ()
    hist: tuple[int, ...] = ()

    @property
    def tau(self) -> float | None:
        return 1.0 + self.accepted / self.steps if self.steps > 0 else None

    @classmethod
    def of_steps(cls, accepted_per_step: list[int], width: int = 0) -> Counts:
        """The counts of our engine's per-step accepted drafts (`width`: at least this many positions)."""
        width = max([width, *accepted_per_step]) if accepted_per_step else width
        return cls(len(accepted_per_step), sum(accepted_per_step),
                   tuple(sum(a > i for a in accepted_per_step) for i in range(width)),
                   tuple(sum(a == j for a in accepted_per_step) for j in range(width + 1)))

    def histogram(self) -> tuple[int, ...]:
        """`hist`, or derived from `per_position` (drafts are accepted as a prefix: the steps with exactly j
        accepted are those that accepted draft j-1 but not draft j)."""
        if self.hist or not self.per_position:
            return self.hist
        pp = self.per_position
        return (self.steps - pp[0], *(pp[j - 1] - pp[j] for j in range(1, len(pp))), pp[-1])

    def positions(self) -> tuple[int, ...]:
        """`per_position`, or derived from `hist` (the steps that accepted draft i are those with more than i
        accepted): the inverse of `histogram`."""
        if self.per_position or not self.hist:
            return self.per_position
        return tuple(sum(self.hist[i + 1:]) for i in range(len(self.hist) - 1))

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.steps + other.steps, self.accepted + other.accepted,
                      _add(self.per_position, other.per_position), _add(self.hist, other.hist))

    def __sub__(self, other: Counts) -> Counts:
        neg = lambda v: tuple(-x for x in v)  # noqa: E731
        return Counts(self.steps - other.steps, self.accepted - other.accepted,
                      _add(self.per_position, neg(other.per_position)), _add(self.hist, neg(other.hist)))

    def to_json(self) -> dict[str, Any]:
        return {"steps": self.steps, "accepted": self.accepted, "per_position": list(self.per_position),
                "hist": list(self.hist)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Counts:
        return cls(int(data["steps"]), int(data["accepted"]), tuple(int(x) for x in data.get("per_position") or ()),
                   tuple(int(x) for x in data.get("hist") or ()))


def _add(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    if not a or not b:
        return a or b
    n = max(len(a), len(b))
    return tuple((a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n))


def metric_samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A Prometheus text exposition as {sample name: [(labels, value), ...]}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def _total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float | None:
    """The sum of `name` over its labels (vLLM has one series per engine and model); None when absent."""
    return sum(v for _, v in samples[name]) if name in samples else None


class Engine:
    """How requests go to one engine and where its speculative counts come from (see the module docstring)."""

    name = ""
    per_request = True  # counts come with each reply (else: from server counters, read around requests)
    stream = True
    extra_body: dict[str, Any] = {}
    missing = ""  # why τ may be unavailable: the second half of "τ not available from <engine>: ..."
    source = ""  # where its counts come from, for the report

    def configure(self, client: Client) -> Client:
        client.stream, client.extra_body = self.stream, dict(self.extra_body)
        return client

    def reply_counts(self, reply: Reply) -> Counts | None:
        return None

    def snapshot(self, client: Client) -> tuple[Counts, float] | None:
        """(counts so far, requests finished so far) from the server's counters; None: it has none."""
        return None

    def describe(self, client: Client) -> dict[str, Any]:
        """The served model's id, block size K (None: unknown) and drafter (None: unknown), for the setup."""
        served = client.get("/v1/models")["data"][0]
        return {"id": served["id"], "block_size": None, "drafter": None}

    def unavailable(self) -> str:
        return f"τ not available from {self.name}: {self.missing}"


class DFlashEngine(Engine):
    name = "dflash"
    missing = "its replies carry no accepted_per_step (an AR server?)"
    source = "each reply's `dflash` object (accepted drafts per verify step), per request"

    def reply_counts(self, reply: Reply) -> Counts | None:
        return Counts.of_steps(reply.accepted) if reply.accepted else None

    def describe(self, client: Client) -> dict[str, Any]:
        served = client.get("/v1/models")["data"][0]
        return {"id": served["id"], "block_size": served.get("block_size"), "drafter": served.get("drafter")}


class VLLMEngine(Engine):
    name = "vllm"
    per_request = False
    extra_body = {"stream_options": {"include_usage": True}}
    missing = "its /metrics has no vllm:spec_decode_* counters (served without --speculative-config?)"
    source = ("its Prometheus counters (`vllm:spec_decode_*` at /metrics), read before and after each request at "
              "concurrency 1 (per request), around the whole run above it (pooled)")

    def snapshot(self, client: Client) -> tuple[Counts, float] | None:
        samples = metric_samples(client.text("/metrics"))
        drafts = _total(samples, VLLM_DRAFTS)
        if drafts is None:
            return None
        per_pos: dict[int, float] = {}
        for labels, value in samples.get(VLLM_PER_POS, []):
            per_pos[int(labels["position"])] = per_pos.get(int(labels["position"]), 0.0) + value
        positions = tuple(int(per_pos.get(i, 0)) for i in range(max(per_pos) + 1)) if per_pos else ()
        return (Counts(int(drafts), int(_total(samples, VLLM_ACCEPTED) or 0), positions),
                _total(samples, VLLM_FINISHED) or 0.0)

    def describe(self, client: Client) -> dict[str, Any]:
        out = super().describe(client)
        samples = metric_samples(client.text("/metrics"))
        positions = {labels.get("position") for labels, _ in samples.get(VLLM_PER_POS, [])}
        out["block_size"] = len(positions) + 1 if positions else None  # num_speculative_tokens = K - 1
        return out


class SGLangEngine(Engine):
    name = "sglang"
    stream = False  # SGLang refuses return_meta_info on a streamed chat request
    extra_body = {"return_meta_info": True}
    missing = "its meta_info has no spec_verify_ct (served without --speculative-algorithm?)"
    source = ("each reply's `meta_info` (`spec_verify_ct`, `completion_tokens`, `spec_accept_histogram` where sent), "
              "per request; requests unstreamed, timed by the server's prefill/decode stamps")

    def reply_counts(self, reply: Reply) -> Counts | None:
        meta = reply.meta or {}
        steps = int(meta.get("spec_verify_ct") or 0)
        if steps <= 0:
            return None
        tokens = int(meta.get("completion_tokens") or reply.tokens)
        hist = tuple(int(x) for x in meta.get("spec_accept_histogram") or ())
        counts = Counts(steps, max(0, tokens - 1 - steps), (), hist)
        return dataclasses.replace(counts, per_position=counts.positions())

    def describe(self, client: Client) -> dict[str, Any]:
        out = super().describe(client)
        try:
            info = client.get("/get_server_info")
        except ServerError:
            return out
        info = info.get("server_args", info) if isinstance(info, dict) else {}
        k = info.get("speculative_num_draft_tokens")  # SGLang counts the K block tokens
        out["block_size"] = int(k) if k else None
        out["drafter"] = info.get("speculative_draft_model_path")
        return out


class OpenAIEngine(Engine):
    """Any other OpenAI-compatible server (an AR baseline whose engine could not be told): streamed with the usage
    chunk, no speculative counts."""

    name = "openai"
    extra_body = {"stream_options": {"include_usage": True}}
    missing = "an OpenAI-compatible server of unknown engine reports none"
    source = "none"


ENGINE_TYPES: dict[str, type[Engine]] = {"dflash": DFlashEngine, "vllm": VLLMEngine, "sglang": SGLangEngine}


def detect(client: Client) -> str:
    """The engine serving `client`'s URL: the /v1/models `owned_by`, else the prefix of its /metrics names, else an
    SGLang /get_server_info; a ServerError naming what was seen when none of them tells."""
    owner = None
    try:
        owner = client.get("/v1/models")["data"][0].get("owned_by")
    except (ServerError, KeyError, IndexError, TypeError, ValueError):
        pass
    if owner in ENGINES:
        return owner
    try:
        names = [line.split("{")[0].split()[0] for line in client.text("/metrics").splitlines()
                 if line.strip() and not line.startswith("#")]
    except ServerError:
        names = []
    for prefix, engine in (("vllm:", "vllm"), ("sglang:", "sglang"), ("dflash_", "dflash")):
        if any(n.startswith(prefix) for n in names):
            return engine
    try:
        client.get("/get_server_info")
        return "sglang"
    except ServerError:
        pass
    raise ServerError(f"could not tell which engine serves {client.url} (/v1/models owned_by {owner!r}, no vllm:, "
                      "sglang: or dflash_ metrics at /metrics, no /get_server_info); pass --engine dflash, vllm or "
                      "sglang")


def engine_for(client: Client, name: str = "auto", fallback: bool = False) -> Engine:
    """The `Engine` named (`auto`: detected from the server) with `client` configured to send its requests;
    `fallback`: a server whose engine cannot be told is a plain OpenAI-compatible one (an AR baseline) instead of
    an error."""
    if name != "auto" and name not in ENGINE_TYPES:
        raise ValueError(f"engine must be auto or one of {', '.join(ENGINES)}; received {name!r}")
    try:
        engine = ENGINE_TYPES[detect(client) if name == "auto" else name]()
    except ServerError:
        if not fallback:
            raise
        engine = OpenAIEngine()
    engine.configure(client)
    return engine


class Meter:
    """One mode's speculative counts: per reply where the engine sends them; where it has only counters, from their
    deltas around each request at concurrency 1, or pooled around a segment above it (`pooled_*`). Every read of
    the counters first waits until the server has counted every request this client sent since the meter was made
    (warm-ups included: vLLM counts a request only after handing out its last output), for at most `sync_timeout`
    seconds. `measure` False (the AR mode): nothing read, only the request style kept. Make the meter before the
    client's first request."""

    def __init__(self, engine: Engine, client: Client, measure: bool = True, sync_timeout: float = 5.0):
        self.engine, self.client, self.measure, self.sync_timeout = engine, client, measure, sync_timeout
        self.available: bool | None = None  # learnt from the first counts read
        self._start: tuple[float, int] | None = None  # (requests the server had counted, requests this client sent)
        if self.by_counters:
            snap = self._snapshot()
            self._start = None if snap is None else (snap[1], client.sent)

    @property
    def by_counters(self) -> bool:
        return self.measure and not self.engine.per_request

    def _snapshot(self) -> tuple[Counts, float] | None:
        snap = self.engine.snapshot(self.client)
        self.available = self.available or snap is not None
        return snap

    def _settled(self) -> Counts | None:
        """The counters once the server has counted every request sent through this client (see the class)."""
        if self._start is None:
            return None
        deadline = time.monotonic() + self.sync_timeout
        while True:
            snap = self._snapshot()
            want = self._start[0] + self.client.sent - self._start[1]
            if snap is None or snap[1] >= want:
                return None if snap is None else snap[0]
            if time.monotonic() > deadline:
                log.warning("%s: its finished-request counter stayed at %d of %d requests for %.0f s (another "
                            "client?); counts read as they are", self.client.url, snap[1], want, self.sync_timeout)
                return snap[0]
            time.sleep(0.02)

    def before(self, concurrency: int) -> Counts | None:
        return self._settled() if self.by_counters and concurrency == 1 else None

    def after(self, reply: Reply, before: Counts | None, concurrency: int) -> Counts | None:
        if not self.measure:
            return None
        if self.engine.per_request:
            counts = self.engine.reply_counts(reply)
            self.available = self.available or counts is not None
            return counts
        if concurrency != 1 or before is None:
            return None
        after = self._settled()
        return None if after is None else after - before

    def pooled_before(self, concurrency: int) -> Counts | None:
        return self._settled() if self.by_counters and concurrency > 1 else None

    def pooled_after(self, before: Counts | None) -> Counts | None:
        """The counts of the requests sent since `pooled_before`."""
        if before is None:
            return None
        after = self._settled()
        return None if after is None else after - before


__all__ = ["ENGINES", "Counts", "DFlashEngine", "Engine", "Meter", "OpenAIEngine", "SGLangEngine", "VLLMEngine",
           "detect", "engine_for", "metric_samples"]
