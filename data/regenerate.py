"""Regenerate the assistant turns of conversations with the TARGET (docs/design.md §2: a drafter trained on the
target's own outputs is accepted more often), through the engine's AR mode with continuous batching.

    target = load_target(recipe.target)
    cfg = RegenConfig(max_new_tokens=512, temperature=0.7, top_p=0.9, seed=0, slots=16, max_len=2048)
    engine = make_regen_engine(target, slots=cfg.slots, max_len=cfg.max_len)
    stats = regenerate(engine, target.tokenizer, items, "regen/gsm8k.jsonl", cfg)   # items: data.sources.mix

Turn splitting: `split_turns`; output, errors and resume: `regenerate`. `dflash data regenerate` runs it
(`data.stages.run_regenerate`). Design: docs/decisions.md D15; a gpt-oss target's harmony replies: D85
(`data.harmony`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from dflash.data import harmony
from dflash.data.config import RegenConfig
from dflash.data.files import FlushPolicy
from dflash.data.progress import Progress
from dflash.data.regen_store import ChunkStore, done_ids, errors_path, merge_parts, meta_path, repair_jsonl
from dflash.serve.config import SamplingConfig
from dflash.serve.engine import Completion, Engine
from dflash.serve.plan import AR, Limits

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")


@dataclasses.dataclass
class RegenStats:
    """What one `regenerate` call did (skipped items were done by an earlier run)."""

    succeeded: int = 0
    errors: int = 0
    dropped: int = 0  # first reply truncated with drop_truncated (written to the errors file)
    skipped: int = 0
    turns: int = 0  # replies written
    truncated_turns: int = 0  # replies written with finish_reason "length"
    turns_cut: int = 0  # conversations ended early (later prompt too long, or a truncated later reply dropped)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0
    repaired_bytes: int = 0  # partial last lines removed from the output files on resume
    retokenized_differs: int = 0  # server replies whose text re-tokenises to another count than was generated
    unrenderable: int = 0  # harmony replies the template cannot render back as generated (not kept)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> str:
        return (f"regenerated {self.succeeded} conversations ({self.turns} turns, {self.truncated_turns} hit "
                f"max_new_tokens, {self.turns_cut} cut short); {self.errors} errors, {self.dropped} dropped, "
                f"{self.skipped} skipped (already done); {self.prompt_tokens} prompt tokens, "
                f"{self.generated_tokens} generated in {self.wall_s:.1f}s = {self.tokens_per_s:.1f} tokens/s"
                + (f"; repaired a partial last line ({self.repaired_bytes} bytes)" if self.repaired_bytes else "")
                + (f"; {self.retokenized_differs} replies re-tokenise to another token count than the server "
                   "generated (kept: training reads the text)" if self.retokenized_differs else "")
                + (f"; {self.unrenderable} harmony replies not kept (a shape the template cannot render back: see "
                   "the errors file)" if self.unrenderable else ""))


class ItemError(ValueError):
    """An item cannot be regenerated; `kind` is the errors-file category."""

    def __init__(self, kind: str, message: str, turn: int | None = None):
        super().__init__(message)
        self.kind, self.turn = kind, turn


def request_seed(seed: int, item_id: str, turn: int) -> int:
    """The seed of one turn's request: stable across processes (sha256, not the salted `hash`), in [0, 2^31)."""
    digest = hashlib.sha256(f"{seed}\x00{item_id}\x00{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def split_turns(messages: Any, system_prompt: str | None = None, max_turns: int = 0) -> list[list[dict[str, str]]]:
    """The prompt segments of a conversation: segment t is appended (after reply t-1) to form prompt t.

    Assistant turns are dropped; each one (and the end of the conversation) closes a segment when the
    segment holds a user turn; system turns are kept where they are. A conversation with no assistant
    turn at all (prompt sets such as MT-Bench: [user, user]) gets a reply after every user turn. Raises
    ItemError("invalid") on an unknown role, non-string content, an empty user turn, or no user turn.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise ItemError("invalid", f"messages must be a list of {{role, content}}; received {type(messages).__name__}")
    segments: list[list[dict[str, str]]] = []
    current: list[dict[str, str]] = []
    has_system = False
    unanswered = not any(isinstance(m, Mapping) and m.get("role") == "assistant" for m in messages)
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ItemError("invalid", f"messages[{i}] must be {{role: one of {list(ROLES)}, content: str}}; "
                                       f"received {m!r:.200}")
        role, content = m["role"], m["content"]
        if role == "user" and not content.strip():
            raise ItemError("invalid", f"messages[{i}] is an empty user turn; every user turn must hold text")
        has_system |= role == "system"
        if role == "assistant":
            if any(x["role"] == "user" for x in current):
                segments.append(current)
                current = []
            continue  # an assistant turn without a user turn before it has nothing to answer
        current.append({"role": role, "content": content})
        if unanswered and role == "user":
            segments.append(current)
            current = []
    if any(x["role"] == "user" for x in current):
        segments.append(current)
    if not segments:
        raise ItemError("invalid", "messages must hold at least one user turn; received none")
    if system_prompt is not None and not has_system:
        segments[0].insert(0, {"role": "system", "content": system_prompt})
    return segments[:max_turns] if max_turns else segments


def _check_meta(path: Path, cfg: RegenConfig, tokenizer: Any) -> None:
    """Write the run's settings next to the output, or refuse to resume it under different ones."""
    # how answers are made, not where: slots, replicas and the endpoint (in process or a server of the same
    # target, checked by `data.endpoint`) give the same answers
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("slots", "replicas", "endpoint")}
    fingerprint = getattr(tokenizer, "fingerprint", None)
    meta = {"config": settings, "tokenizer": fingerprint() if callable(fingerprint) else None}
    meta = json.loads(json.dumps(meta))  # normalise (tuples -> lists) for the comparison
    if path.exists():
        old = json.loads(path.read_text())
        if old != meta:
            fields = sorted(k for k in settings if old.get("config", {}).get(k) != meta["config"][k])
            if old.get("tokenizer") != meta["tokenizer"]:
                fields.append("tokenizer")
            raise ValueError(f"{path} records other regeneration settings than this run's (differing: {fields}); "
                             "resume with the same config, or write to a new out_path")
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # the processes of one run may write it at once
    tmp.write_text(json.dumps(meta, indent=1, ensure_ascii=True))
    os.replace(tmp, path)


@dataclasses.dataclass
class _Conversation:
    item_id: str
    source: str
    segments: list[list[dict[str, str]]]
    messages: list[dict[str, str]] = dataclasses.field(default_factory=list)
    finish_reasons: list[str] = dataclasses.field(default_factory=list)
    tokens: int = 0
    prompt_ids: list[int] = dataclasses.field(default_factory=list)  # the turn in flight's (harmony's round trip)

    @property
    def turn(self) -> int:
        return len(self.finish_reasons)

    def record(self) -> dict[str, Any]:
        return {"id": self.item_id, "source": self.source, "messages": self.messages,
                "finish_reasons": self.finish_reasons, "tokens": self.tokens}


@dataclasses.dataclass(frozen=True)
class Reply:
    """One finished turn, as a backend returns it: the reply text without its stop token, the tokens generated
    (the stop token included) as the engine or server counts them, "stop" or "length", whether the text
    re-tokenised with the recipe's tokenizer gives that count (always true in process), and the generated ids, stop
    token included (the engine's; None from a server), which a harmony reply is split by."""

    text: str
    tokens: int
    finish_reason: str
    retokenized_same: bool = True
    token_ids: tuple[int, ...] | None = None


class Backend(Protocol):
    """Where a turn's reply comes from: the in-process engine (`EngineBackend`), several engine replicas
    (`data.replicas`) or an OpenAI-compatible server (`data.endpoint.EndpointBackend`).

    capacity: requests kept in flight. submit: start one turn (`messages` and their `prompt_ids` under the
    recipe's template, the request's seed) and return a handle; raise ItemError for a turn that cannot be sent
    (e.g. too long). poll: wait for progress and return the turns that finished, each a Reply or the ItemError
    that ends its conversation; an exception that is neither stops the run (it resumes on the next)."""

    capacity: int

    def submit(self, messages: list[dict[str, str]], prompt_ids: list[int], seed: int, turn: int) -> Hashable: ...

    def poll(self) -> list[tuple[Hashable, Reply | ItemError]]: ...


class EngineBackend:
    """Turns through one AR-mode engine in this process (continuous batching over its slots)."""

    def __init__(self, engine: Engine, tokenizer: Any, cfg: RegenConfig):
        if engine.busy:
            raise ValueError("engine must be idle (no queued or running requests) when regenerate starts")
        self.engine, self.tok, self.cfg = engine, tokenizer, cfg
        self.stop_ids = tuple(tokenizer.stop_token_ids)
        self.mine: set[int] = set()

    @property
    def capacity(self) -> int:
        return self.engine.slots

    def submit(self, messages: list[dict[str, str]], prompt_ids: list[int], seed: int, turn: int) -> Hashable:
        try:
            rid = self.engine.submit(prompt_ids, max_new_tokens=self.cfg.max_new_tokens, stop_ids=self.stop_ids,
                                     seed=seed, sampling=self.cfg.sampling)
        except ValueError as err:
            raise ItemError("too_long", str(err), turn) from err
        self.mine.add(rid)
        return rid

    def poll(self) -> list[tuple[Hashable, Reply | ItemError]]:
        self.engine.step()
        out: list[tuple[Hashable, Reply | ItemError]] = []
        for rid in [r for r in self.engine.done if r in self.mine]:
            self.mine.discard(rid)
            out.append((rid, completion_reply(self.engine.done.pop(rid), self.tok, self.stop_ids)))
        return out


def completion_reply(completion: Completion, tokenizer: Any, stop_ids: tuple[int, ...]) -> Reply:
    """The Reply of an engine's finished request: its ids less the stop token, decoded."""
    reason = completion.finish_reason or "length"
    ids = completion.token_ids
    if reason == "stop" and ids and ids[-1] in stop_ids:
        ids = ids[:-1]
    return Reply(tokenizer.decode(ids), len(completion.token_ids), reason, token_ids=tuple(completion.token_ids))


class _Regenerator:
    """The host loop: keeps `backend.capacity` conversations in flight, one request each."""

    def __init__(self, backend: Backend, tokenizer: Any, cfg: RegenConfig, store: ChunkStore, stats: RegenStats):
        self.backend, self.tok, self.cfg, self.store, self.stats = backend, tokenizer, cfg, store, stats
        self.in_flight: dict[Hashable, _Conversation] = {}  # backend handle -> conversation
        self.finished = 0  # conversations finished (any outcome) in this call, for the progress bar
        self.harmony = harmony.is_harmony(tokenizer)  # gpt-oss: replies split into channels, history rewritten
        if self.harmony:
            harmony.check_reasoning_effort(cfg.template_kwargs)

    def start(self, item: Any, done: set[str]) -> bool:
        """Begin one item (False when it ended at once: skipped or an error)."""
        item_id = item.get("id") if isinstance(item, Mapping) else None
        source = str(item.get("source", "")) if isinstance(item, Mapping) else ""
        if not isinstance(item_id, str) or not item_id:
            self.fail(_Conversation(repr(item_id), source, []), ItemError(
                "invalid", f"item must be a mapping with a non-empty string 'id'; received {item!r:.200}"))
            return False
        if item_id in done:
            self.stats.skipped += 1
            return False
        done.add(item_id)
        conv = _Conversation(item_id, source, [])
        try:
            conv.segments = split_turns(item.get("messages"), self.cfg.system_prompt, self.cfg.max_turns)
            self.submit_next(conv)
        except ItemError as err:
            self.fail(conv, err)
            return False
        return True

    def submit_next(self, conv: _Conversation) -> None:
        """Submit the conversation's next turn; ItemError when it cannot be."""
        turn = conv.turn
        messages = conv.messages + conv.segments[turn]
        shown = harmony.history(messages) if self.harmony else messages  # what the target is prompted with
        try:
            text = self.tok.apply_chat_template(shown, add_generation_prompt=True, **self.cfg.template_kwargs)
            prompt_ids = self.tok.encode(text)
        except Exception as err:  # noqa: BLE001 - any template failure is this item's error
            raise ItemError("template", f"the chat template failed: {type(err).__name__}: {err}", turn) from err
        limit = self.cfg.max_prompt_tokens
        if limit and len(prompt_ids) > limit:
            raise ItemError("too_long", f"the prompt ({len(prompt_ids)} tokens) must be at most max_prompt_tokens "
                                        f"({limit})", turn)
        handle = self.backend.submit(shown, prompt_ids, request_seed(self.cfg.seed, conv.item_id, turn), turn)
        conv.messages, conv.prompt_ids = messages, prompt_ids
        self.stats.prompt_tokens += len(prompt_ids)
        self.in_flight[handle] = conv

    def finish_turn(self, conv: _Conversation, reply: Reply) -> None:
        self.stats.generated_tokens += reply.tokens
        self.stats.retokenized_differs += not reply.retokenized_same
        reason = reply.finish_reason
        if reason == "length" and self.cfg.drop_truncated:
            if conv.turn == 0:
                self.fail(conv, ItemError("truncated", f"the reply hit max_new_tokens ({self.cfg.max_new_tokens}) "
                                                       "and drop_truncated is set", 0))
            else:
                self.cut(conv)
            return
        message: dict[str, str] = {"role": "assistant", "content": reply.text}
        if self.harmony:
            try:
                message = self.harmony_message(conv, reply)
            except ItemError as err:
                self.stats.unrenderable += err.kind == "format"
                if conv.turn == 0:
                    self.fail(conv, err)
                else:  # the turns before round-trip: keep them
                    self.fail_later(conv, err)
                return
        conv.messages = conv.messages + [message]
        conv.finish_reasons.append(reason)
        conv.tokens += reply.tokens
        if conv.turn == len(conv.segments):
            self.write(conv)
            return
        try:
            self.submit_next(conv)
        except ItemError as err:
            if err.kind == "too_long":
                self.cut(conv)
            else:
                self.fail(conv, err)

    def harmony_message(self, conv: _Conversation, reply: Reply) -> dict[str, str]:
        """The assistant message of a harmony reply (`data.harmony.split_reply`), checked to render back to the ids
        the target generated; ItemError "truncated" for a reply cut before its final answer, "format" for any other
        shape the template cannot render as generated."""
        if reply.token_ids is None:
            raise ValueError("a harmony (gpt-oss) reply must come with its token ids to be split into its analysis "
                             "and final channels; this backend returns text only (a server): regenerate a gpt-oss "
                             "target in process (data.regen.endpoint.url='')")
        try:
            message = harmony.split_reply(self.tok, reply.token_ids)
            harmony.round_trip(self.tok, conv.messages, conv.prompt_ids, message, reply.token_ids,
                               self.cfg.template_kwargs)
        except harmony.FormatError as err:
            if reply.finish_reason == "length":
                raise ItemError("truncated", f"the reply hit max_new_tokens ({self.cfg.max_new_tokens}) before the "
                                             f"harmony template could render it ({err})", conv.turn) from err
            raise ItemError("format", f"the harmony reply cannot be kept: {err}", conv.turn) from err
        return message

    def fail_later(self, conv: _Conversation, err: ItemError) -> None:
        """A later turn's reply is not kept: the conversation ends after the turns before it, and the reason is
        written to the errors file (a line with the same id; resume skips it either way)."""
        self.store.add({"id": conv.item_id, "source": conv.source, "turn": err.turn, "kind": err.kind,
                        "error": str(err), "kept_turns": conv.turn})
        self.cut(conv)

    def cut(self, conv: _Conversation) -> None:
        """End the conversation after the replies it has: drop the unanswered segment."""
        self.stats.turns_cut += 1
        conv.messages = conv.messages[: _answered_length(conv)]
        self.write(conv)

    def write(self, conv: _Conversation) -> None:
        self.store.add(conv.record())
        self.stats.succeeded += 1
        self.stats.turns += conv.turn
        self.stats.truncated_turns += conv.finish_reasons.count("length")
        self.finished += 1

    def fail(self, conv: _Conversation, err: ItemError) -> None:
        self.store.add({"id": conv.item_id, "source": conv.source, "turn": err.turn, "kind": err.kind,
                        "error": str(err)})
        if err.kind == "truncated":
            self.stats.dropped += 1
        else:
            self.stats.errors += 1
        self.finished += 1

    def collect(self) -> None:
        """Wait for the backend and handle every turn of ours that finished."""
        for handle, result in self.backend.poll():
            conv = self.in_flight.pop(handle)
            if isinstance(result, ItemError):
                if result.turn is None:
                    result.turn = conv.turn
                if conv.turn > 0 and result.kind == "too_long":
                    self.cut(conv)
                else:
                    self.fail(conv, result)
            else:
                self.finish_turn(conv, result)


class RegenerationStopped(Exception):  # noqa: N818 - an outcome, not an error: the CLI exits 42 on it
    """Regeneration stopped on SIGTERM (what GKE sends a preempted pod) with every finished conversation written;
    the launchers restart on `dflash data regenerate`'s exit 42 and the rerun resumes after them."""

    def __init__(self, stats: RegenStats):
        super().__init__(f"stopped by SIGTERM with {stats.succeeded + stats.errors + stats.dropped} conversations "
                         "of this run written (the ones in flight are answered again on resume, with the same seeds)")
        self.stats = stats


class _SigtermWatch:
    """`with _SigtermWatch() as watch: ... if watch.received: <stop>` around the host loop: a SIGTERM handler that
    records the notice (from the main thread only; elsewhere nothing is installed and `received` stays False).
    On exit the previous handler comes back; one installed outside Python (JAX's preemption notifier in a
    `jax.distributed` run, which would otherwise swallow the signal) cannot be, and the default action takes its
    place."""

    def __init__(self) -> None:
        self.received = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> _SigtermWatch:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)
            self._installed = False

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if not self.received:
            log.warning("SIGTERM: writing the finished conversations held, then stopping")
        self.received = True


def _answered_length(conv: _Conversation) -> int:
    """Messages up to and including the last reply."""
    last = max((i for i, m in enumerate(conv.messages) if m["role"] == "assistant"), default=-1)
    return last + 1


def regenerate(engine: Engine | Backend, tokenizer: Any, items: Iterable[Mapping[str, Any]], out_path: str | Path,
               cfg: RegenConfig, *, progress: bool = True, share: tuple[int, int] = (0, 1), merge: bool = True,
               policy: FlushPolicy | None = None, label: str = "regenerate") -> RegenStats:
    """Regenerate every item's assistant turns with the target into `out_path`; resumes a previous run on the
    same `out_path`. Returns this call's stats. `engine`: an AR-mode Engine in this process, or any `Backend`
    (engine replicas over several devices, an OpenAI-compatible server): the file is the same.

    Items: `{"id": str, "source": str, "messages": [{"role", "content"}, ...]}`. Assistant turns are dropped
    and regenerated turn by turn (segments: `split_turns`): for [user1, (assistant1), user2, (assistant2)]
    the reply a1' is generated from [system?, user1], then a2' from [system?, user1, a1', user2].
    `cfg.system_prompt` is prepended when the conversation has no system turn. Up to `engine.slots`
    conversations are in flight, one request each; a conversation's next turn is submitted as soon as its
    previous reply finishes, with the seed `request_seed(cfg.seed, id, turn)`, so a conversation's output
    depends neither on its batch neighbours nor on `slots` nor on resuming.

    Files (`data.regen_store`):
    - `out_path` (JSONL, one line per finished conversation, sorted by id): `{"id", "source", "messages": [system?,
      user1, a1', user2, a2', ...], "finish_reasons": ["stop"|"length", ...], "tokens": generated tokens over all
      turns (stop tokens included)}`; a harmony (gpt-oss) target's replies are `{"role": "assistant", "thinking":
      analysis, "content": final}`, and its later turns are prompted with earlier analysis dropped (`data.harmony`;
      replies it cannot render back: kind "format");
    - `<out_path>.errors.jsonl` (sorted by id): `{"id", "source", "turn", "kind", "error"}`, kind one of "invalid"
      (bad item, empty user turn), "template" (the chat template failed), "too_long" (the first prompt does not
      fit), "truncated" (the first reply hit max_new_tokens while `drop_truncated`). A later turn whose
      prompt no longer fits the context, or (with `drop_truncated`) whose reply hit max_new_tokens, ends
      the conversation after the turns already regenerated (counted as `turns_cut`);
    - `<out_path>.meta.json`: the config (all but `slots`) and the tokenizer fingerprint; a rerun with
      different ones is refused, so one file never mixes two regeneration settings.

    While it runs, finished conversations and failed items go out in whole chunks under `<out_path>.parts/`
    (`data.regen_store.ChunkStore`, as share `share` = (p, P) of a multi-process run; when `policy` says:
    default 1000 conversations, 64 MiB or 5 minutes, `data.files.FlushPolicy`), never a write or an fsync per
    conversation. With `merge` (a single process) the chunks are merged into the two files at the end; a
    multi-process run merges once every share is done (`data.stages.run_regenerate`).

    SIGTERM (a preempted pod): the loop stops at its next turn, the chunk being filled is written, and
    `RegenerationStopped` is raised (`dflash data regenerate` exits 42, on which the launchers restart); only the
    conversations in flight are answered again. Resume: a rerun skips every id already in `out_path`, its errors
    file or a chunk of any topology (counted as skipped). A kill -9 loses at most the chunk being filled (whose
    items are answered again, with the same seeds), so the merged files do not depend on where a run was stopped.
    A partial last line of a file of the older line-by-line layout is truncated (logged, counted in
    `RegenStats.repaired_bytes`). `label` names the progress lines.
    """
    backend = EngineBackend(engine, tokenizer, cfg) if isinstance(engine, Engine) else engine
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _check_meta(meta_path(out_path), cfg, tokenizer)
    stats = RegenStats()
    if share[1] == 1:  # files of the line-by-line layout a single process wrote before chunks
        for path in (out_path, errors_path(out_path)):
            stats.repaired_bytes += repair_jsonl(path)[1]
    done = done_ids(out_path)
    total = len(items) if hasattr(items, "__len__") else None
    # resumed items are progress already made, not speed: the bar starts at them and counts new work only
    initial = sum(1 for i in items if isinstance(i, Mapping) and i.get("id") in done) if total is not None else 0
    t0 = time.perf_counter()
    store = ChunkStore(out_path, share, policy)
    with Progress(total, initial=initial, enabled=progress, unit="conv", desc=label) as bar, _SigtermWatch() as sigterm:
        regen = _Regenerator(backend, tokenizer, cfg, store, stats)
        source = iter(items)
        exhausted = False
        shown = 0
        try:
            while not sigterm.received:
                while not exhausted and len(regen.in_flight) < backend.capacity:
                    item = next(source, _END)
                    if item is _END:
                        exhausted = True
                    else:
                        regen.start(item, done)
                if not regen.in_flight:
                    break
                regen.collect()
                store.tick()  # a slow stage still writes its chunk on the time bound
                stats.wall_s = time.perf_counter() - t0
                advanced = regen.finished - shown
                if advanced:
                    shown += advanced
                    bar.set_postfix(ok=stats.succeeded, err=stats.errors + stats.dropped, skip=stats.skipped)
                    bar.update(advanced, tokens=stats.generated_tokens - bar.tokens)
        finally:
            close = getattr(backend, "close", None)
            if callable(close):
                close()
            store.close()  # what finished is kept, also when the run stops on an error
        bar.update(regen.finished - shown, tokens=stats.generated_tokens - bar.tokens)
    stats.wall_s = time.perf_counter() - t0
    if sigterm.received:  # the chunk held is written (store.close above): a restart loses none of it
        log.info("%s", stats.summary())
        raise RegenerationStopped(stats)
    if merge and share[1] == 1:
        merge_parts(out_path)
    stats.wall_s = time.perf_counter() - t0
    if progress:
        bar.write(stats.summary())
    log.info("%s", stats.summary())
    return stats


_END = object()


def make_regen_engine(target: Any, *, slots: int, max_len: int, sampling: SamplingConfig | None = None,
                      page_size: int = 16) -> Engine:
    """The AR-mode engine over a loaded `models.target.Target` (the target alone decodes).

    `sampling` is the engine's default rule; `regenerate` sends its config's rule with every request anyway.
    """
    return Engine(target.params, target.cfg, None, AR(), Limits(slots=slots, max_len=max_len, page_size=page_size),
                  sampling=sampling)


__all__ = ["Backend", "EngineBackend", "ItemError", "RegenConfig", "RegenStats", "RegenerationStopped", "Reply",
           "completion_reply", "make_regen_engine", "regenerate", "request_seed", "split_turns"]
