"""What regeneration writes, and how often: chunks of many conversations written whole (a bucket takes about one write
per second per object, and through gcsfuse an fsync per record is neither cheap nor durable), resumed after a kill -9
at any point into the same file (docs/design.md §6; data.regen_store). No model: tests/regen_worker.py's fake
tokenizer and instant backend. Capture's side of the rule: tests/test_data_shards.py."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from regen_worker import FakeTokenizer, InstantBackend, items

from dflash.data.config import RegenConfig
from dflash.data.files import ChunkWriter, FlushPolicy
from dflash.data.regen_store import chunk_name, done_ids, merge_parts, part_files, parts_dir, read_regenerated
from dflash.data.regenerate import regenerate

WORKER = Path(__file__).resolve().parent / "regen_worker.py"
CFG = RegenConfig(seed=5)


def _regenerate(out: Path, n: int, **kwargs):
    return regenerate(InstantBackend(), FakeTokenizer(), items(n), out, CFG, progress=False, **kwargs)


def test_regeneration_writes_at_most_one_file_fsync_and_rename_per_100_conversations(tmp_path, io_count):
    """1000 conversations on one process, then 2 x 1000 on two shares merged: every write, fsync and rename at most
    once per 100 conversations (the whole run: chunks, the settings file, the merge). The negative control, a chunk
    per conversation (what one fsynced line per conversation cost), counts at least one of each per conversation."""
    stats = _regenerate(tmp_path / "one" / "regenerated.jsonl", 1000)
    assert stats.succeeded + stats.errors == 1000 and stats.errors == 20
    print(f"\none process, 1000 conversations: {io_count}")
    assert 0 < io_count.most() <= 1000 / 100, io_count

    io_count.writes = io_count.fsyncs = io_count.renames = 0
    out = tmp_path / "two" / "regenerated.jsonl"
    both = items(2000)
    for index in range(2):
        mine = [item for i, item in enumerate(both) if i % 2 == index]
        regenerate(InstantBackend(), FakeTokenizer(), mine, out, CFG, progress=False, share=(index, 2), merge=False)
    assert len(part_files(out)) == 2
    merge_parts(out)
    print(f"two shares, 2000 conversations, merged: {io_count}")
    assert 0 < io_count.most() <= 2000 / 100, io_count
    assert len(read_regenerated(out)) == 1960

    io_count.writes = io_count.fsyncs = io_count.renames = 0
    _regenerate(tmp_path / "each" / "regenerated.jsonl", 200, policy=FlushPolicy(records=1))
    print(f"a chunk per conversation, 200 conversations: {io_count}")
    assert min(io_count.writes, io_count.fsyncs, io_count.renames) >= 200


def test_the_file_is_the_same_whatever_the_chunks_and_shares(tmp_path):
    """Chunks of 1000, of 7 and of 1 conversation, and two shares of chunks of 13: byte-identical merged files,
    sorted by id, the errors file too; no chunk left."""
    outs = []
    for name, records in (("big", 1000), ("small", 7), ("each", 1)):
        out = tmp_path / name / "regenerated.jsonl"
        _regenerate(out, 120, policy=FlushPolicy(records=records))
        assert not parts_dir(out).exists()
        outs.append(out)
    shared = tmp_path / "shared" / "regenerated.jsonl"
    for index in (1, 0):
        mine = [item for i, item in enumerate(items(120)) if i % 2 == index]
        regenerate(InstantBackend(capacity=3), FakeTokenizer(), mine, shared, CFG, progress=False,
                   share=(index, 2), merge=False, policy=FlushPolicy(records=13))
    merge_parts(shared)
    outs.append(shared)
    first = outs[0].read_bytes()
    ids = [json.loads(line)["id"] for line in first.splitlines()]
    assert ids == sorted(ids) and len(ids) == 118
    for out in outs[1:]:
        assert out.read_bytes() == first, out
        assert (out.parent / "regenerated.jsonl.errors.jsonl").read_bytes() == \
            (outs[0].parent / "regenerated.jsonl.errors.jsonl").read_bytes()


def test_a_slow_stage_writes_its_chunk_on_the_time_bound(tmp_path):
    """A chunk is written once its first record is `seconds` old, whether the next record or a tick finds it so; never
    before (a fake clock)."""
    now = [0.0]
    written = []
    writer = ChunkWriter(lambda n: written.append(n) or tmp_path / f"c{n}.jsonl", policy=FlushPolicy(seconds=60),
                         clock=lambda: now[0])
    writer.add({"id": "a"})
    now[0] = 59.0
    writer.tick()
    writer.add({"id": "b"})
    assert written == [] and not list(tmp_path.iterdir())
    now[0] = 60.0
    writer.tick()
    assert written == [0] and (tmp_path / "c0.jsonl").read_text().splitlines() == ['{"id": "a"}', '{"id": "b"}']
    now[0] = 100.0
    writer.add({"id": "c"})  # a new chunk's clock starts at its first record
    now[0] = 159.0
    writer.tick()
    assert written == [0]
    now[0] = 160.0
    writer.add({"id": "d"})
    assert written == [0, 1]
    writer.close()
    assert written == [0, 1] and not list(tmp_path.glob("*.tmp"))

    # the same through a run whose replies come slowly: DFLASH_FLUSH_SECONDS=0 writes every finished conversation
    out = tmp_path / "slow" / "regenerated.jsonl"
    regenerate(InstantBackend(capacity=1, delay_s=0.01), FakeTokenizer(), items(5), out, CFG, progress=False,
               merge=False, policy=FlushPolicy(seconds=0))
    assert len(part_files(out)) == 5


def test_a_rerun_skips_what_the_chunks_hold_and_drops_a_chunk_half_written(tmp_path):
    """What a kill leaves: chunks renamed into place (kept), a chunk being written under its temporary name (dropped:
    its items are answered again), nothing of the chunk being filled. The rerun answers the rest and merges a file
    equal to an uninterrupted run's."""
    whole = tmp_path / "whole" / "regenerated.jsonl"
    _regenerate(whole, 100)
    out = tmp_path / "killed" / "regenerated.jsonl"
    _regenerate(out, 100, merge=False, policy=FlushPolicy(records=9))
    chunks = part_files(out)
    assert len(chunks) == 12
    for chunk in chunks[5:]:
        chunk.unlink()  # filled, never written
    tmp = parts_dir(out) / (chunk_name((0, 1), 5) + ".tmp")
    tmp.write_text(chunks[5].name)  # half written when the process died
    done = done_ids(out)
    assert len(done) == 45
    stats = _regenerate(out, 100)
    assert (stats.skipped, stats.succeeded + stats.errors) == (45, 55)
    assert out.read_bytes() == whole.read_bytes()
    assert (out.parent / "regenerated.jsonl.errors.jsonl").read_bytes() == \
        (whole.parent / "regenerated.jsonl.errors.jsonl").read_bytes()
    assert not parts_dir(out).exists()
    again = _regenerate(out, 100)
    assert (again.skipped, again.succeeded) == (100, 0) and out.read_bytes() == whole.read_bytes()


def test_unmerged_chunks_are_counted_by_inspect_and_refused_by_training(tmp_path):
    out = tmp_path / "regenerated.jsonl"
    _regenerate(out, 60, merge=False, policy=FlushPolicy(records=20))
    with pytest.raises(ValueError, match=r"must be merged with its chunks .* rerun `dflash data regenerate`"):
        read_regenerated(out)
    from dflash.configs.recipe import load_recipe
    from dflash.data.stages import inspect_data

    report = inspect_data(load_recipe("tiny", [f"data.dir={tmp_path}"]))
    assert "regenerated: 0 conversations in regenerated.jsonl; errors: none" in report
    assert "and 59 conversations, 1 errors in 3 unmerged chunk(s) under regenerated.jsonl.parts/" in report
    merge_parts(out)
    report = inspect_data(load_recipe("tiny", [f"data.dir={tmp_path}"]))
    assert "regenerated: 59 conversations in regenerated.jsonl; errors: invalid 1" in report
    assert "unmerged chunk" not in report


def test_sigterm_writes_the_chunk_in_progress_and_exits_42(tmp_path):
    """SIGTERM (a preempted pod) halfway through a chunk that would hold 10^6 conversations: the conversations finished
    so far are written as one chunk before the process exits 42 (a kill -9 there would leave none), and the rerun
    skips exactly them and ends with the file of an uninterrupted run. Without the handler the process dies of the
    signal with nothing on disk (the negative control is the default action itself)."""
    n = 200
    whole = tmp_path / "whole" / "regenerated.jsonl"
    _regenerate(whole, n)
    out = tmp_path / "stopped" / "regenerated.jsonl"
    stopped = subprocess.run([sys.executable, str(WORKER), str(out), str(n), "0", str(10**6), "40"],
                             capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 42 and stopped.stdout.strip() == "STOPPED", stopped.stdout + stopped.stderr
    assert "SIGTERM: writing the finished conversations held" in stopped.stderr
    assert len(part_files(out)) == 1 and not out.exists()
    held = done_ids(out)
    assert 20 <= len(held) < n  # 40 turns answered: at least 20 conversations of one or two turns
    rerun = _regenerate(out, n)
    assert rerun.skipped == len(held) and rerun.succeeded + rerun.errors == n - len(held)
    assert out.read_bytes() == whole.read_bytes()


def test_dflash_data_regenerate_exits_42_when_stopped_by_sigterm(monkeypatch, capsys):
    """The CLI maps a regeneration stopped by SIGTERM to exit 42, which the launchers restart on
    (`launch.pod.RESTART_EXIT_CODES`)."""
    import dflash.data.stages as stages
    from dflash.data.regenerate import RegenerationStopped, RegenStats
    from dflash.launch.cli import main
    from dflash.launch.pod import RESTART_EXIT_CODES

    def stop(*args, **kwargs):
        raise RegenerationStopped(RegenStats(succeeded=7))

    monkeypatch.setattr(stages, "run_regenerate", stop)
    assert main(["data", "regenerate", "--config", "tiny"]) == 42 and 42 in RESTART_EXIT_CODES
    assert "stopped by SIGTERM with 7 conversations of this run written" in capsys.readouterr().err


@pytest.mark.slow  # ~40 s of subprocesses (each imports JAX); in the default tier the same resume from what a kill
# leaves: test_a_rerun_skips_what_the_chunks_hold_and_drops_a_chunk_half_written, test_data_regenerate's crash test
def test_kill_9_at_random_points_resumes_to_the_file_of_an_uninterrupted_run(tmp_path):
    """`regenerate` in a subprocess (replies taking 50 ms, 8 at a time, chunks of 7) killed with SIGKILL at random
    moments, three times, then run to the end: the merged file and its errors file are byte-identical to an
    uninterrupted run's, every id once."""
    n = 400
    whole = tmp_path / "whole" / "regenerated.jsonl"
    _regenerate(whole, n)
    out = tmp_path / "killed" / "regenerated.jsonl"
    rng = random.Random(58)
    for attempt in range(3):
        before = len(done_ids(out))
        proc = subprocess.Popen([sys.executable, str(WORKER), str(out), str(n), "0.05", "7"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        want = before + rng.randint(10, 60)
        while proc.poll() is None and len(done_ids(out)) < want and time.time() < deadline:
            time.sleep(0.005)
        time.sleep(rng.random() * 0.05)
        assert proc.poll() is None, f"finished before it was killed: {proc.stdout.read().decode()}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        after = len(done_ids(out))
        assert before < after < n, (attempt, before, after)
        assert not out.exists()
    finished = subprocess.run([sys.executable, str(WORKER), str(out), str(n)], capture_output=True, text=True,
                              timeout=120)
    assert finished.returncode == 0 and finished.stdout.strip() == "OK", finished.stdout + finished.stderr
    assert out.read_bytes() == whole.read_bytes()
    assert (out.parent / "regenerated.jsonl.errors.jsonl").read_bytes() == \
        (whole.parent / "regenerated.jsonl.errors.jsonl").read_bytes()
    assert not parts_dir(out).exists()
