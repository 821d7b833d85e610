"""Expected mistakes end in one line (issue 63): every `dflash` subcommand, given a wrong value (a missing file, an
unreachable URL, a model name the server does not serve, a bad config field or flag), exits non-zero with one
message naming the field, the value and the rule, and no traceback. Each runs the real entry point in a fresh
interpreter, as a user would, and fails before any weights load or any program compiles (about 1 to 10 s each)."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash.eval.servers import free_port

ROOT = Path(__file__).resolve().parents[1]
MISSING = "/nonexistent/dflash-run"  # no such directory on any machine the tests run on
POD = ["--cluster", "c1", "--run-dir", "gs://b1/runs/r1", "--dry-run"]


@pytest.fixture(scope="module")
def models_server() -> Iterator[str]:
    """An OpenAI-compatible server that serves the model id `smollm2` (its /v1/models only): enough for
    `data.regen.endpoint`'s check to refuse another model name."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = json.dumps({"object": "list", "data": [{"id": "smollm2", "object": "model"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


# (subcommand as `build_parser` names it, its arguments, what the message must name: the field and the value)
CASES = {
    "demo": (["demo", "--config", "tiny", "target.max_seq_len=-5"], ["target.max_seq_len", "-5"]),
    "chat": (["chat", "--config", "tiny", "--prompt", "hi", "target.source=/nonexistent/model.gguf"],
             ["target source", "/nonexistent/model.gguf"]),
    "train": (["train", "--config", "tiny", "train.steps=abc"], ["train.steps", "'abc'"]),
    "data regenerate": (["data", "regenerate", "--config", "tiny", "data.regen.endpoint.url={url}",
                         "data.regen.endpoint.model=wrong-model", "data.dir={tmp}/data"],
                        ["data.regen.endpoint.model", "'wrong-model'"]),
    "data capture": (["data", "capture", "--config", "tiny", "data.source=/nonexistent/rows.jsonl"],
                     ["data.source", "/nonexistent/rows.jsonl"]),
    "data walk": (["data", "walk", "--config", "tiny", "--drafter", MISSING], ["drafter", MISSING]),
    "data inspect": (["data", "inspect", "--config", "tiny", "data.seq_len=0"], ["data.seq_len", "0"]),
    "serve": (["serve", "--config", "tiny", "--drafter", MISSING], ["drafter", MISSING]),
    "eval": (["eval", "--config", "tiny", "--url", "http://127.0.0.1:{port}", "--out", "{tmp}/eval"],
             ["--url", "http://127.0.0.1:{port}"]),
    "launch xpk": (["launch", "xpk", "train", "--config", "tiny", "--tpu-type", "v9x-8", *POD],
                   ["--tpu-type", "'v9x-8'"]),
    "launch gcluster": (["launch", "gcluster", "train", "--config", "tiny", "--tpu-type", "v9x-8", *POD],
                        ["--tpu-type", "'v9x-8'"]),
    "launch compile": (["launch", "compile", "--config", "tiny", "--topology", "v9x-8"], ["--topology", "'v9x-8'"]),
    "export": (["export", MISSING, "--format", "zlab", "--out", "{tmp}/export"], ["run dir", MISSING]),
    "config": (["config", "--config", "tiny", "sampling.temperature=hot"], ["sampling.temperature", "'hot'"]),
}


def subcommands() -> set[str]:
    """Every runnable `dflash` subcommand, nested ones as `data walk`, read from the parser itself."""
    import argparse

    from dflash.launch.cli import build_parser

    def leaves(parser: argparse.ArgumentParser, prefix: str) -> set[str]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return {prefix}
        return {leaf for name, child in subs[0].choices.items() for leaf in leaves(child, f"{prefix} {name}".strip())}

    return leaves(build_parser(), "")


def test_the_cases_cover_every_subcommand():
    assert set(CASES) == subcommands()


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_wrong_value_ends_in_one_line_naming_it(name, models_server, tmp_path):
    argv, named = CASES[name]
    port = free_port()  # nothing listens there
    fill = {"url": models_server, "tmp": str(tmp_path), "port": str(port)}
    argv = [a.format(**fill) for a in argv]
    named = [n.format(**fill) for n in named]
    done = subprocess.run([sys.executable, "-m", "dflash.launch.cli", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**__import__("os").environ, "DFLASH_COMPILE_CACHE": "off"})
    assert done.returncode != 0, done.stdout[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith(f"dflash {name.split()[0]}: error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert all(part in errors[0] for part in named), (errors[0], named)


def test_a_bug_still_shows_its_traceback(monkeypatch):
    """Negative control: an error that is no wrong input (here a RuntimeError inside `dflash config`) is not turned
    into a one-line message; its traceback is what to report."""
    from dflash.launch import cli

    def broken(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "cmd_config", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["config", "--config", "tiny"])
