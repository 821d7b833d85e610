"""Offline features: atomic resumable capture, manifest checks, and the Grain shard loader (the record codec
alone: tests/test_data_records.py).

A tiny random Qwen3 target (tests/golden/tiny/qwen3_untied, 4 layers, hidden 64) captures layers (1, 3)
of random token rows; the loader must give back exactly what the online pipeline and `online_features`
give for the same rows.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

import dflash.data.capture as capture_module
from dflash.data.batch import BatchLayout, TrainBatch
from dflash.data.capture import CaptureFormat, CaptureRun, bytes_per_token, capture, examples_hash, write_estimate
from dflash.data.files import file_sha256
from dflash.data.manifest import (
    MANIFEST_NAME,
    ExpectedFeatures,
    ManifestMismatchError,
    Provenance,
    chat_template_hash,
    check_manifest,
    load_manifest,
)
from dflash.data.offline import HostShare, OfflineBatches, PackedRows, make_offline_batches
from dflash.data.online import make_batches
from dflash.data.records import BF16, HEADER_SIZE, ShardError, record_size
from dflash.data.shards import READER_OPTIONS, RecordSource, iter_shard, merge_shares
from dflash.models.decoder import forward
from dflash.models.drafter import online_features
from dflash.models.loading import load_hf_dir, weights_fingerprint

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


LAYER_IDS = (1, 3)
SEQ_LEN = 32
NUM_SAMPLES = 24
PER_SHARD = 6  # 4 shards
CAPTURE_BATCH = 4  # shards of 6 = a full batch and a padded one
PAD_ID = 2
B = 4  # loader batch: 6 batches per epoch


@dataclasses.dataclass(frozen=True)
class Setup:
    cfg: object
    params: dict
    provenance: Provenance
    examples: list
    capture_dir: Path
    report: object


def _examples(seed: int = 0, count: int = NUM_SAMPLES) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """Random padded rows: n in [6, S], assistant-like mask (zeros then ones), distinct first tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        n = int(rng.integers(6, SEQ_LEN + 1))
        tokens = np.full(SEQ_LEN, PAD_ID, np.int32)
        tokens[:n] = rng.integers(3, 256, n)
        tokens[0] = 3 + i  # rows are told apart by their first token
        mask = np.zeros(SEQ_LEN, np.float32)
        mask[int(rng.integers(1, n)) : n] = 1.0
        out.append((tokens, mask, n))
    return out


def _capture(setup_or_cfg, params, provenance, examples, out_dir, **kwargs):
    # Full-length batches (the trainer's online shape) unless a test asks for length buckets; each keyword goes to
    # the options type that has it (`CaptureFormat`, `CaptureRun`).
    given = dict(seq_len=SEQ_LEN, batch_size=CAPTURE_BATCH, samples_per_shard=PER_SHARD, progress=False,
                 length_bucket=0) | kwargs
    layer_ids = given.pop("layer_ids", LAYER_IDS)
    of = {cls: {f.name for f in dataclasses.fields(cls)} for cls in (CaptureFormat, CaptureRun)}
    assert set(given) <= of[CaptureFormat] | of[CaptureRun], set(given) - of[CaptureFormat] - of[CaptureRun]
    fmt, run = (cls(**{k: v for k, v in given.items() if k in names}) for cls, names in of.items())
    return capture(params, setup_or_cfg, provenance, examples, layer_ids, out_dir, fmt=fmt, run=run)


@pytest.fixture(scope="module")
def setup(golden_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Setup:
    target_dir = golden_dir / "tiny" / "qwen3_untied"
    cfg, params = load_hf_dir(target_dir)
    params = jax.tree.map(jax.numpy.asarray, params)
    provenance = Provenance(target_name="tiny-qwen3", target_fingerprint=weights_fingerprint(target_dir),
                            tokenizer_fingerprint="t" * 64, chat_template_hash=chat_template_hash("{{ x }}"))
    examples = _examples()
    out = tmp_path_factory.mktemp("capture")
    report = _capture(cfg, params, provenance, examples, out)
    return Setup(cfg, params, provenance, examples, out, report)


def _copy(setup: Setup, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(setup.capture_dir, target)
    return target


_online_features = jax.jit(online_features, static_argnums=(1, 3))


def _online_bf16(setup: Setup, tokens_BxS: np.ndarray) -> np.ndarray:
    """The trainer's features of these rows (fp32), cast to bf16 on the host."""
    return np.asarray(_online_features(setup.params, setup.cfg, tokens_BxS, LAYER_IDS)).astype(BF16)


# ----------------------------------------------------------------------------- capture


def test_round_trip_equals_online_features(setup: Setup) -> None:
    manifest = load_manifest(setup.capture_dir)
    stored = [s for shard in range(manifest.num_shards) for s in iter_shard(setup.capture_dir, manifest, shard)]
    assert len(stored) == NUM_SAMPLES
    # Online features of all rows in one batch of 24 (capture ran batches of 4): per-row results do not
    # depend on the batch, so the bf16 features are bit-equal.
    online = _online_bf16(setup, np.stack([t for t, _, _ in setup.examples]))
    for (tokens, mask, n), sample, expected in zip(setup.examples, stored, online, strict=True):
        np.testing.assert_array_equal(sample.tokens, tokens[:n])
        np.testing.assert_array_equal(sample.loss_mask, mask[:n].astype(np.uint8))
        assert sample.features.shape == (n, len(LAYER_IDS) * 64)
        np.testing.assert_array_equal(sample.features.view(np.uint16), expected[:n].view(np.uint16))


def test_length_buckets_skip_padding_and_store_the_same_shards(setup: Setup, tmp_path: Path) -> None:
    """Bucketed batches (rows of similar length together, each batch cut to its longest row rounded up) cover
    every row once at a length that holds it, in far fewer positions; the records keep the samples' order and
    hold the same tokens, mask and target labels as full-length batches, and the features up to the rounding of
    a different shape."""
    rows = list(range(NUM_SAMPLES))
    lengths = [int(n) for _, _, n in setup.examples]
    for bucket, batch in ((8, 4), (5, 3), (64, 4), (1, 2)):
        plan = capture_module._length_batches(setup.examples, rows, batch, SEQ_LEN, bucket)
        assert sorted(i for chunk, _ in plan for i in chunk) == rows
        for chunk, length in plan:
            longest = max(lengths[i] for i in chunk)
            assert len(chunk) <= batch and longest <= length <= SEQ_LEN
            assert length == SEQ_LEN or (length % bucket == 0 and length - longest < bucket)
    plan = capture_module._length_batches(setup.examples, rows, 4, SEQ_LEN, 8)
    assert sum(len(chunk) * length for chunk, length in plan) < 0.9 * NUM_SAMPLES * SEQ_LEN  # padding skipped
    assert capture_module._length_batches(setup.examples, rows, 4, SEQ_LEN, 0) == [
        (rows[b:b + 4], SEQ_LEN) for b in range(0, NUM_SAMPLES, 4)]

    bucketed = tmp_path / "bucketed"
    _capture(setup.cfg, setup.params, setup.provenance, setup.examples, bucketed, target_labels=True,
             length_bucket=8)
    manifest = load_manifest(bucketed, verify=True)
    assert manifest.examples_hash == load_manifest(setup.capture_dir).examples_hash
    stored = [s for shard in range(manifest.num_shards) for s in iter_shard(bucketed, manifest, shard)]
    tokens_BxS = np.stack([t for t, _, _ in setup.examples])
    online = _online_bf16(setup, tokens_BxS)  # full-length rows, as the trainer computes them online
    next_ids = np.asarray(jax.numpy.argmax(forward(setup.params, setup.cfg, jax.numpy.asarray(tokens_BxS))[0], -1))
    differing = 0
    for (tokens, mask, n), sample, expected, want in zip(setup.examples, stored, online, next_ids, strict=True):
        np.testing.assert_array_equal(sample.tokens, tokens[:n])
        np.testing.assert_array_equal(sample.loss_mask, mask[:n].astype(np.uint8))
        np.testing.assert_array_equal(sample.next_ids, want[:n])
        # A shorter shape may round differently (XLA picks other kernels): within 2 bf16 ulps, and rarely.
        got, ref = sample.features.astype(np.float32), expected[:n].astype(np.float32)
        np.testing.assert_allclose(got, ref, rtol=2 ** -6, atol=1e-6)
        differing += int((got != ref).sum())
    assert differing <= 1e-3 * sum(n for _, _, n in setup.examples) * len(LAYER_IDS) * 64
    with pytest.raises(ValueError, match="length_bucket must be >= 0"):
        _capture(setup.cfg, setup.params, setup.provenance, setup.examples, tmp_path / "bad", length_bucket=-1)


def test_manifest_fields(setup: Setup) -> None:
    manifest = load_manifest(setup.capture_dir, verify=True)
    raw = json.loads((setup.capture_dir / MANIFEST_NAME).read_text())
    assert raw["complete"] is True and raw["format_version"] == 1
    assert manifest.target_fingerprint == setup.provenance.target_fingerprint
    assert manifest.tokenizer_fingerprint == "t" * 64
    assert manifest.chat_template_hash == chat_template_hash("{{ x }}")
    assert manifest.layer_ids == LAYER_IDS and raw["layer_ids"] == list(LAYER_IDS)
    assert (manifest.hidden_size, manifest.feature_dim, manifest.feature_dtype) == (64, 128, "bfloat16")
    assert (manifest.seq_len, manifest.pad_id, manifest.num_samples, manifest.num_shards) == (SEQ_LEN, PAD_ID, 24, 4)
    assert manifest.examples_hash == examples_hash(setup.examples)
    tokens = sum(n for _, _, n in setup.examples)
    assert manifest.total_tokens == tokens
    assert [e.file for e in manifest.shards] == [f"shard-{i:05d}.array_record" for i in range(4)]
    assert [e.samples for e in manifest.shards] == [6, 6, 6, 6]
    for entry in manifest.shards:
        path = setup.capture_dir / entry.file
        assert entry.bytes == path.stat().st_size and entry.sha256 == file_sha256(path)
    total_bytes = sum(e.bytes for e in manifest.shards)
    assert manifest.bytes_per_token == pytest.approx(total_bytes / tokens)
    assert set(manifest.created) == {"time", "host", "versions"}
    report = setup.report
    assert report.shards_written == 4 and report.shards_kept == 0 and report.tokens == tokens
    assert report.tokens_per_s > 0 and report.bytes_per_token == manifest.bytes_per_token
    # The record payload is 2*F*D + 5 bytes per token plus a 32-byte header per sample; the rest is Riegeli's
    # per-file block padding (tens of KiB, dominant at this toy size).
    payload = sum(record_size(n, 128) for _, _, n in setup.examples)
    print(f"\nbytes/token: {manifest.bytes_per_token:.1f} on disk, {payload / tokens:.1f} payload "
          f"(2*F*D + 5 = {2 * 128 + 5}); capture {report.tokens_per_s:.0f} tokens/s")
    assert 2 * 128 + 5 < payload / tokens < 2 * 128 + 5 + HEADER_SIZE / 6 + 1
    assert not list(setup.capture_dir.glob("*.tmp"))


def test_resume_after_crash_matches_uninterrupted(setup: Setup, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "resumed"
    real_fetch = capture_module._fetch_batch
    calls = []

    class Crash(Exception):
        pass

    def crashing_fetch(*args):
        calls.append(1)
        if len(calls) == 6:  # shards of 6 rows are 2 batches: shard 2's second batch, its first rows written
            raise Crash
        return real_fetch(*args)

    monkeypatch.setattr(capture_module, "_fetch_batch", crashing_fetch)
    with pytest.raises(Crash):
        _capture(setup.cfg, setup.params, setup.provenance, setup.examples, out)
    monkeypatch.setattr(capture_module, "_fetch_batch", real_fetch)
    partial = json.loads((out / MANIFEST_NAME).read_text())
    assert partial["complete"] is False and [e["file"] for e in partial["shards"]] == [
        "shard-00000.array_record", "shard-00001.array_record"]
    with pytest.raises(ShardError, match="capture must be complete; received 2 of 4 shards"):
        load_manifest(out)
    # What a kill leaves behind: a half-written shard under its tmp name; and a shard renamed just before
    # the crash whose manifest update never happened (unlisted: rewritten).
    (out / "shard-00002.array_record.tmp").write_bytes(b"half a shard")
    (out / "shard-00003.array_record").write_bytes(b"unlisted")

    report = _capture(setup.cfg, setup.params, setup.provenance, setup.examples, out)
    assert (report.shards_kept, report.shards_written) == (2, 2)
    assert not list(out.glob("*.tmp"))
    uninterrupted = load_manifest(setup.capture_dir)
    resumed = load_manifest(out, verify=True)
    assert dataclasses.replace(resumed, created={}) == dataclasses.replace(uninterrupted, created={})
    for entry in uninterrupted.shards:
        assert (out / entry.file).read_bytes() == (setup.capture_dir / entry.file).read_bytes()

    again = _capture(setup.cfg, setup.params, setup.provenance, setup.examples, out)
    assert (again.shards_kept, again.shards_written, again.tokens) == (4, 0, 0)


def test_shards_finished_after_the_last_state_write_are_kept_on_resume(setup: Setup, tmp_path: Path) -> None:
    """What a kill -9 leaves now that the manifest is rewritten at most every STATE_SECONDS: shards renamed into place
    that no state lists yet. The rerun reads them back and keeps them (their entries recomputed: the same sha256); a
    file under a shard's name that is not that shard (another shard's bytes, garbage) is written again."""
    out = _copy(setup, tmp_path)
    header = dataclasses.replace(load_manifest(out), shards=(), complete=False, total_tokens=0, bytes_per_token=0.0)
    (out / MANIFEST_NAME).write_text(header.to_json())  # the state as written when the capture started
    (out / "shard-00003.array_record").unlink()
    shutil.copyfile(out / "shard-00000.array_record", out / "shard-00002.array_record")  # right count, wrong rows
    (out / "shard-00003.array_record.tmp").write_bytes(b"half a shard")
    report = _capture(setup.cfg, setup.params, setup.provenance, setup.examples, out)
    assert (report.shards_kept, report.shards_written) == (2, 2)
    resumed, uninterrupted = load_manifest(out, verify=True), load_manifest(setup.capture_dir)
    assert dataclasses.replace(resumed, created={}) == dataclasses.replace(uninterrupted, created={})
    for entry in uninterrupted.shards:
        assert (out / entry.file).read_bytes() == (setup.capture_dir / entry.file).read_bytes()
    assert not list(out.glob("*.tmp"))


def test_capture_writes_at_most_one_file_fsync_and_rename_per_100_records(setup: Setup, tmp_path: Path,
                                                                         io_count: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """1000 short rows in 2 shards: every file written (shards and manifests), fsync and rename at most once per 100
    records, the manifest written at the start and the end only (not per shard: one object rewritten in place,
    STATE_SECONDS). The negative control rewrites the manifest after every shard of 10 (STATE_SECONDS = 0): more
    than one write per 100 records. A shard's size also follows the bytes (`shard_samples`)."""
    import dflash.data.shards as shards_module

    rows = _examples(seed=3, count=1000)
    report = _capture(setup.cfg, setup.params, setup.provenance, rows, tmp_path / "big", samples_per_shard=500)
    assert report.manifest.num_shards == 2 and report.manifest.complete
    print(f"\ncapture of 1000 records in 2 shards: {io_count}")
    assert 0 < io_count.most() <= 1000 / 100, io_count

    io_count.writes = io_count.fsyncs = io_count.renames = 0
    monkeypatch.setattr(shards_module, "STATE_SECONDS", 0.0)
    _capture(setup.cfg, setup.params, setup.provenance, rows[:200], tmp_path / "small", samples_per_shard=10)
    print(f"capture of 200 records in 20 shards, the manifest after each: {io_count}")
    assert io_count.writes >= 40 and io_count.fsyncs >= 40

    per_token = bytes_per_token(report.manifest)
    assert capture_module.shard_samples(rows, 500, per_token, 1 << 30) == 500
    rows = rows[:100]
    mean = sum(int(r[2]) for r in rows) / len(rows) * per_token + HEADER_SIZE + capture_module.RECORD_OVERHEAD
    assert capture_module.shard_samples(rows, 500, per_token, int(40 * mean) + 1) == 40
    assert capture_module.shard_samples(rows, 500, per_token, 10) == 1
    sized = _capture(setup.cfg, setup.params, setup.provenance, rows, tmp_path / "sized", samples_per_shard=500,
                     shard_bytes=int(40 * mean) + 1)
    assert sized.manifest.samples_per_shard == 40 and sized.manifest.num_shards == 3


def test_rerun_with_other_settings_names_every_mismatch(setup: Setup, tmp_path: Path) -> None:
    out = _copy(setup, tmp_path)
    other = _examples(seed=1)
    with pytest.raises(ManifestMismatchError) as info:
        _capture(setup.cfg, setup.params, setup.provenance, other, out, layer_ids=(2,))
    message = str(info.value)
    for field in ("layer_ids", "feature_dim", "examples_hash"):
        assert field in message
    assert "manifest (1, 3), run (2,)" in message and "manifest 128, run 64" in message
    assert "target_fingerprint" not in message
    (out / "notes.txt").write_text("x")
    with pytest.raises(ShardError, match=r"must hold only manifest.json and shard files \(and parts/part-\*.json "
                                         r"while shares run\); received \[.notes.txt.\]"):
        _capture(setup.cfg, setup.params, setup.provenance, setup.examples, out)


def test_check_manifest_names_every_differing_field(setup: Setup) -> None:
    manifest = load_manifest(setup.capture_dir)
    check_manifest(manifest, ExpectedFeatures(target_fingerprint=setup.provenance.target_fingerprint,
                                              layer_ids=LAYER_IDS, hidden_size=64, seq_len=SEQ_LEN))
    with pytest.raises(ManifestMismatchError) as info:
        check_manifest(manifest, ExpectedFeatures(target_fingerprint="abc", tokenizer_fingerprint="def",
                                                  chat_template_hash=chat_template_hash("other"), layer_ids=[0, 1],
                                                  hidden_size=32, seq_len=64))
    message = str(info.value)
    assert "6 field(s) differ" in message
    for expected in (f"target_fingerprint: manifest '{setup.provenance.target_fingerprint}', run 'abc'",
                     "tokenizer_fingerprint: manifest '" + "t" * 64 + "', run 'def'", "chat_template_hash:",
                     "layer_ids: manifest (1, 3), run (0, 1)", "hidden_size: manifest 64, run 32",
                     "seq_len: manifest 32, run 64"):
        assert expected in message


def test_load_manifest_errors(setup: Setup, tmp_path: Path) -> None:
    with pytest.raises(ShardError, match="capture directory must exist"):
        load_manifest(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardError, match="manifest.json: must exist"):
        load_manifest(tmp_path / "empty")
    out = _copy(setup, tmp_path)
    (out / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ShardError, match="must be valid JSON"):
        load_manifest(out)
    out2 = tmp_path / "missing"
    shutil.copytree(setup.capture_dir, out2)
    (out2 / "shard-00003.array_record").unlink()
    with pytest.raises(ShardError, match=r"shard-00003\.array_record: shard listed in the manifest must exist"):
        load_manifest(out2)


def test_truncated_shard_is_named_before_iteration(setup: Setup, tmp_path: Path) -> None:
    out = _copy(setup, tmp_path)
    shard = out / "shard-00001.array_record"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ShardError, match=r"shard-00001\.array_record: shard must be \d+ bytes .*truncated"):
        _offline(out, seed=0, seq_len=SEQ_LEN)


def test_flipped_bytes_are_named_with_verify(setup: Setup, tmp_path: Path) -> None:
    out = _copy(setup, tmp_path)
    shard = out / "shard-00002.array_record"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0xFF
    shard.write_bytes(bytes(data))
    load_manifest(out)  # sizes match: only the checksum can tell
    with pytest.raises(ShardError, match=r"shard-00002\.array_record: shard sha256 must be .*corrupt shard"):
        load_manifest(out, verify=True)
    with pytest.raises(ShardError, match=r"shard-00002\.array_record: shard sha256"):
        _offline(out, seed=0, seq_len=SEQ_LEN, verify=True)


# ----------------------------------------------------------------------------- the loader


def _real_positions(setup: Setup, tokens_BxS: np.ndarray) -> np.ndarray:
    """[B, S] bool: the real (non-padding) tokens of each row, identified by its first token."""
    n_of = {int(t[0]): n for t, _, n in setup.examples}
    return np.arange(SEQ_LEN)[None, :] < np.array([n_of[int(row[0])] for row in tokens_BxS])[:, None]


@pytest.mark.parametrize("shard_count", [1, 2])
def test_offline_batches_equal_online_batches(setup: Setup, shard_count: int) -> None:
    online_examples = [(t, m) for t, m, _ in setup.examples]
    for host in range(shard_count):
        online = make_batches(online_examples, B, seed=5, shard_index=host, shard_count=shard_count)
        offline = _offline(setup.capture_dir, seed=5, seq_len=SEQ_LEN, host=HostShare(host, shard_count))
        for _ in range(8):  # past the end of the first epoch (6 or 3 global batches)
            expected, batch = next(online), next(offline)
            assert batch.label_kind == "text" and batch.segment_ids is None and batch.features is not None
            assert batch.tokens.dtype == np.int32 and batch.loss_mask.dtype == np.float32
            assert batch.features.dtype == BF16 and batch.features.shape == (B, SEQ_LEN, 128)
            np.testing.assert_array_equal(batch.tokens, expected.tokens)
            np.testing.assert_array_equal(batch.loss_mask, expected.loss_mask)
            # The trainer's online features of this very batch, cast to bf16: bit-equal on real positions
            # (same jitted function, rows independent of their batch); zero on padding, which no loss reads.
            real = _real_positions(setup, batch.tokens)
            online_feats = _online_bf16(setup, batch.tokens)
            np.testing.assert_array_equal(batch.features[real].view(np.uint16),
                                          online_feats[real].view(np.uint16))
            assert not batch.features[~real].astype(np.float32).any()
        assert offline.bad_records == 0


def test_shorter_seq_len_cuts_rows(setup: Setup) -> None:
    batch = next(_offline(setup.capture_dir, seed=5, seq_len=16))
    full = next(_offline(setup.capture_dir, seed=5, seq_len=SEQ_LEN))
    assert batch.features.shape == (B, 16, 128)
    np.testing.assert_array_equal(batch.tokens, full.tokens[:, :16])
    np.testing.assert_array_equal(batch.features.view(np.uint16), full.features[:, :16].view(np.uint16))


def _corrupt_record(setup: Setup, tmp_path: Path, shard: int, record: int) -> Path:
    """A copy of the capture whose `shard` has `record` replaced by an undecodable one (the manifest is
    updated to the new file, so only reading the record can tell)."""
    out = _copy(setup, tmp_path)
    path = out / f"shard-{shard:05d}.array_record"
    reader = ArrayRecordReader(str(path), READER_OPTIONS)
    records = reader.read_all()
    reader.close()
    records[record] = records[record][: HEADER_SIZE + 10]
    writer = ArrayRecordWriter(str(path), "group_size:1,uncompressed")
    for raw in records:
        writer.write(raw)
    writer.close()
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    manifest["shards"][shard].update(bytes=path.stat().st_size, sha256=file_sha256(path))
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    return out


def test_bad_record_mid_epoch_is_named_or_skipped_and_counted(setup: Setup, tmp_path: Path) -> None:
    out = _corrupt_record(setup, tmp_path, shard=1, record=2)  # global sample 8
    load_manifest(out, verify=True)
    batches = _offline(out, seed=5, seq_len=SEQ_LEN)
    with pytest.raises(ShardError, match=r"shard-00001\.array_record: record 2: length must be"):
        for _ in range(6):
            next(batches)

    skipping = _offline(out, seed=5, seq_len=SEQ_LEN, skip_bad_records=True)
    clean = _offline(setup.capture_dir, seed=5, seq_len=SEQ_LEN)
    bad_first_token = int(setup.examples[8][0][0])
    replaced = 0
    for _ in range(12):  # two epochs: sample 8 is read twice
        batch, good = next(skipping), next(clean)
        for row in range(B):
            if good.tokens[row, 0] == bad_first_token:
                replaced += 1
                assert (batch.tokens[row] == PAD_ID).all() and not batch.loss_mask[row].any()
                assert not batch.features[row].astype(np.float32).any()
            else:
                np.testing.assert_array_equal(batch.tokens[row], good.tokens[row])
                np.testing.assert_array_equal(batch.features[row].view(np.uint16),
                                              good.features[row].view(np.uint16))
    assert replaced == 2 and skipping.bad_records == 2
    assert skipping.get_state() == {"next_index": 12, "bad_records": 2}


def test_corrupt_riegeli_chunk_is_named(setup: Setup, tmp_path: Path) -> None:
    """A flipped byte inside a stored record fails Riegeli's chunk hash: the read error names the record."""
    out = _copy(setup, tmp_path)
    path = out / "shard-00000.array_record"
    data = bytearray(path.read_bytes())
    data[len(data) // 4] ^= 0x01
    path.write_bytes(bytes(data))
    batches = _offline(out, seed=5, seq_len=SEQ_LEN)
    with pytest.raises(ShardError, match=r"shard-00000\.array_record: record \d+"):
        for _ in range(6):
            next(batches)


@pytest.mark.parametrize("workers", [0, 2])
def test_state_round_trip_resumes_exact_batches(setup: Setup, workers: int) -> None:
    def run(iterator, count):
        return [next(iterator) for _ in range(count)]

    with _offline(setup.capture_dir, seed=9, seq_len=SEQ_LEN, worker_count=workers) as original:
        run(original, 4)
        state = json.loads(json.dumps(original.get_state()))
        assert state == {"next_index": 4, "bad_records": 0}
        expected = run(original, 4)
    reference = _offline(setup.capture_dir, seed=9, seq_len=SEQ_LEN)
    assert all(_equal(a, b) for a, b in zip(run(reference, 8)[4:], expected, strict=True))
    with _offline(setup.capture_dir, seed=9, seq_len=SEQ_LEN, worker_count=workers) as resumed:
        resumed.set_state(state)
        assert all(_equal(a, b) for a, b in zip(run(resumed, 4), expected, strict=True))
        assert resumed.get_state() == {"next_index": 8, "bad_records": 0}
    # The state does not depend on the worker count: restore it into the other setting.
    with _offline(setup.capture_dir, seed=9, seq_len=SEQ_LEN, worker_count=2 - workers) as other:
        other.set_state(state)
        assert all(_equal(a, b) for a, b in zip(run(other, 4), expected, strict=True))


def _equal(a: TrainBatch, b: TrainBatch) -> bool:
    return (jax.tree.structure(a) == jax.tree.structure(b)
            and all(np.array_equal(x.view(np.uint8), y.view(np.uint8))
                    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)))


def _offline(shard_dir: Path, *, seed: int, seq_len: int, next_ids: bool = False, soft_topk: int = 0, pack: int = 0,
             **kwargs: Any) -> OfflineBatches:
    """`make_offline_batches` with B rows of this capture's 128-wide features, conversations cut to `seq_len`,
    the labels of `next_ids` / `soft_topk` and rows of `pack` tokens when packing."""
    labels = "soft" if soft_topk else "target" if next_ids else "text"
    layout = BatchLayout(batch_size=B, seq_len=pack or seq_len, feature_dim=128, labels=labels, soft_topk=soft_topk,
                         packed=bool(pack))
    return make_offline_batches(shard_dir, layout, seed, seq_len=seq_len, **kwargs)


# ----------------------------------------------------------------------------- packed rows (data.pack)


def test_packed_rows_hold_every_sample_once_per_epoch_whole_and_deterministic() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 33, 101)
    rows = PackedRows(lengths, 64, seed=3, window=16)
    for epoch in range(3):
        plan = rows.epoch(epoch)
        assert all(lengths[row].sum() <= 64 for row in plan)
        np.testing.assert_array_equal(np.sort(np.concatenate(plan)), np.arange(101))
    assert lengths.sum() / (64 * rows.rows_per_epoch()) > 0.85  # first-fit decreasing; each window leaves a tail
    # Row r through __getitem__ = the epochs' rows laid end to end; another instance agrees (workers, resume).
    flat = [row for epoch in range(3) for row in rows.epoch(epoch)]
    again = PackedRows(lengths, 64, seed=3, window=16)
    for r in [len(flat) - 1, 0, 5, rows.rows_per_epoch(0), len(flat) // 2]:
        np.testing.assert_array_equal(again[r], flat[r])
    assert not np.array_equal(np.concatenate(rows.epoch(0)), np.concatenate(rows.epoch(1)))  # reshuffled
    assert not np.array_equal(np.concatenate(rows.epoch(0)),
                              np.concatenate(PackedRows(lengths, 64, seed=4, window=16).epoch(0)))
    with pytest.raises(ValueError, match=r"token counts in \[1, row_len=16\]"):
        PackedRows(lengths, 16, seed=0)


def test_packed_batches_lay_whole_samples_end_to_end_with_segment_ids(setup: Setup) -> None:
    by_first = {int(t[0]): (i, t, m, n) for i, (t, m, n) in enumerate(setup.examples)}
    source = RecordSource(setup.capture_dir, load_manifest(setup.capture_dir))
    packed = _offline(setup.capture_dir, seed=5, seq_len=SEQ_LEN, pack=2 * SEQ_LEN)
    seen: list[int] = []
    for _ in range(6):
        batch = next(packed)
        assert batch.label_kind == "text" and batch.segment_ids is not None and batch.features is not None
        assert batch.tokens.shape == batch.segment_ids.shape == (B, 2 * SEQ_LEN)
        assert batch.features.shape == (B, 2 * SEQ_LEN, 128)
        for row in range(B):
            seg = batch.segment_ids[row]
            count = int(seg.max())
            assert count >= 1 and np.all(np.diff(seg[seg > 0]) == 0) == (count == 1)
            np.testing.assert_array_equal(seg[: (seg > 0).sum()], np.sort(seg[seg > 0]))  # 1, 2, ..., then padding
            for k in range(1, count + 1):
                span = np.flatnonzero(seg == k)
                index, tokens, mask, n = by_first[int(batch.tokens[row, span[0]])]
                assert span.size == n and np.array_equal(span, np.arange(span[0], span[0] + n))
                np.testing.assert_array_equal(batch.tokens[row, span], tokens[:n])
                np.testing.assert_array_equal(batch.loss_mask[row, span], mask[:n])
                stored = source.read([index])[0].features
                np.testing.assert_array_equal(batch.features[row, span].view(np.uint16), stored.view(np.uint16))
                seen.append(int(tokens[0]))
            pad = seg == 0
            assert (batch.tokens[row, pad] == PAD_ID).all() and not batch.loss_mask[row, pad].any()
    rows = PackedRows(np.array([n for _, _, n in setup.examples]), 2 * SEQ_LEN, seed=5)
    first_epoch = rows.rows_per_epoch(0)
    assert first_epoch < NUM_SAMPLES  # rows do hold several samples
    assert sorted(seen[:sum(len(r) for r in rows.epoch(0))]) == sorted(by_first)  # each sample once per epoch
    # Resume by state: the same batches as reading on.
    state = packed.get_state()
    expected = [next(packed) for _ in range(2)]
    resumed = _offline(setup.capture_dir, seed=5, seq_len=SEQ_LEN, pack=2 * SEQ_LEN)
    resumed.set_state(state)
    assert all(_equal(a, next(resumed)) for a in expected)
    with pytest.raises(ValueError, match="pack must be 0 or a row length >= seq_len=32"):
        _offline(setup.capture_dir, seed=5, seq_len=SEQ_LEN, pack=16)


# ----------------------------------------------------------------------------- target labels (data.labels: target)


def test_capture_with_target_labels_stores_the_targets_argmax(setup: Setup, tmp_path: Path) -> None:
    """With target_labels every record holds argmax(logits) at each position (the target's greedy next token),
    the features are unchanged, and the loader hands them out as "next_ids" (-1 on padding) only when asked."""

    out = tmp_path / "labelled"
    _capture(setup.cfg, setup.params, setup.provenance, setup.examples, out, target_labels=True)
    manifest = load_manifest(out)
    assert manifest.target_labels and not load_manifest(setup.capture_dir).target_labels
    tokens_BxS = np.stack([t for t, _, _ in setup.examples])
    logits = forward(setup.params, setup.cfg, jax.numpy.asarray(tokens_BxS))[0]
    expected = np.asarray(jax.numpy.argmax(logits, -1))
    stored = [s for shard in range(manifest.num_shards) for s in iter_shard(out, manifest, shard)]
    before_manifest = load_manifest(setup.capture_dir)
    plain = [s for shard in range(manifest.num_shards) for s in iter_shard(setup.capture_dir, before_manifest, shard)]
    for (_, _, n), sample, want, before in zip(setup.examples, stored, expected, plain, strict=True):
        np.testing.assert_array_equal(sample.next_ids, want[:n])
        np.testing.assert_array_equal(sample.features.view(np.uint16), before.features.view(np.uint16))
    batch = next(_offline(out, seed=5, seq_len=SEQ_LEN, next_ids=True))
    real = _real_positions(setup, batch.tokens)
    assert batch.next_ids.dtype == np.int32 and (batch.next_ids[~real] == -1).all()
    rows = {int(t[0]): i for i, (t, _, _) in enumerate(setup.examples)}
    for row, tokens in enumerate(batch.tokens):
        n = int(real[row].sum())
        np.testing.assert_array_equal(batch.next_ids[row, :n], expected[rows[int(tokens[0])], :n])
    assert next(_offline(out, seed=5, seq_len=SEQ_LEN)).labels is None
    with pytest.raises(ValueError, match="does not hold"):
        _offline(setup.capture_dir, seed=5, seq_len=SEQ_LEN, next_ids=True)
    with pytest.raises(ManifestMismatchError, match="target_labels"):
        check_manifest(load_manifest(setup.capture_dir), ExpectedFeatures(target_labels=True))
    with pytest.raises(ManifestMismatchError, match="target_labels"):  # resuming with the other setting
        _capture(setup.cfg, setup.params, setup.provenance, setup.examples, out)


def test_manifest_written_before_target_labels_still_loads(setup: Setup, tmp_path: Path) -> None:
    out = _copy(setup, tmp_path)
    raw = json.loads((out / MANIFEST_NAME).read_text())
    del raw["target_labels"]
    (out / MANIFEST_NAME).write_text(json.dumps(raw))
    assert load_manifest(out).target_labels is False
    assert next(_offline(out, seed=5, seq_len=SEQ_LEN)).tokens.shape == (B, SEQ_LEN)


# ----------------------------------------------------------------------------- soft labels (data.labels: soft)


def test_capture_with_the_targets_top_k_stores_its_distribution(setup: Setup, tmp_path: Path) -> None:
    """With target_topk = k every record holds the target's k most likely next tokens after each position and
    their softmax probabilities (argmax first, so next_ids are the first column); the loader hands them out as
    "soft_ids" / "soft_probs" [B, S, k], zero on padding, in the padded and the packed layout."""

    k = 4
    out = tmp_path / "soft"
    _capture(setup.cfg, setup.params, setup.provenance, setup.examples, out, target_topk=k)
    manifest = load_manifest(out)
    assert manifest.target_labels and manifest.target_topk == k
    tokens_BxS = np.stack([t for t, _, _ in setup.examples])
    logits = np.asarray(forward(setup.params, setup.cfg, jax.numpy.asarray(tokens_BxS))[0], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    stored = [s for shard in range(manifest.num_shards) for s in iter_shard(out, manifest, shard)]
    for (_, _, n), sample, p in zip(setup.examples, stored, probs, strict=True):
        order = np.argsort(-p[:n], axis=-1)[:, :k]
        np.testing.assert_array_equal(sample.topk_ids, order)
        np.testing.assert_array_equal(sample.next_ids, order[:, 0])
        np.testing.assert_allclose(sample.topk_probs, np.take_along_axis(p[:n], order, -1), rtol=2e-3, atol=1e-6)
    for pack in (0, 2 * SEQ_LEN):
        batch = next(_offline(out, seed=5, seq_len=SEQ_LEN, next_ids=True, soft_topk=k, pack=pack))
        assert batch.labels.ids.shape == batch.labels.probs.shape == (B, pack or SEQ_LEN, k)
        assert batch.labels.ids.dtype == np.int32 and batch.labels.probs.dtype == np.float32
        pad = batch.next_ids < 0
        assert pad.any() and not batch.labels.probs[pad].any() and not batch.labels.ids[pad].any()
        real = ~pad
        np.testing.assert_array_equal(batch.labels.ids[real][:, 0], batch.next_ids[real])
    with pytest.raises(ValueError, match="does not hold"):
        _offline(out, seed=5, seq_len=SEQ_LEN, next_ids=True, soft_topk=k + 1)
    with pytest.raises(ManifestMismatchError, match="target_topk"):
        check_manifest(manifest, ExpectedFeatures(target_topk=k + 1))
    assert next(_offline(out, seed=5, seq_len=SEQ_LEN, next_ids=True)).label_kind == "target"


# ----------------------------------------------------------------------------- capture at scale (issue 53 item 4)


def _same_shards(a: Path, b: Path) -> None:
    """Both capture directories are complete with the same manifest (up to `created`) and byte-identical shards."""
    left, right = load_manifest(a, verify=True), load_manifest(b, verify=True)
    assert dataclasses.replace(left, created={}) == dataclasses.replace(right, created={})
    for entry in left.shards:
        assert (a / entry.file).read_bytes() == (b / entry.file).read_bytes(), entry.file


def test_replicas_and_shares_store_the_shards_of_one_device(setup: Setup, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches spread over 4 one-device replicas, and the shards split between two shares of one directory (each
    resuming on its own, then merged), store byte-identical shards and the same manifest as one device: each batch
    runs whole, at its one-device shape, wherever it runs."""
    devices = jax.local_devices()
    four = tmp_path / "four"
    report = _capture(setup.cfg, setup.params, setup.provenance, setup.examples, four,
                      devices=[(d,) for d in devices[:4]], length_bucket=8)
    one = tmp_path / "one"
    _capture(setup.cfg, setup.params, setup.provenance, setup.examples, one, length_bucket=8)
    assert report.shards_written == 4
    _same_shards(one, four)
    _capture(setup.cfg, setup.params, setup.provenance, setup.examples, tmp_path / "four-full",
             devices=[(d,) for d in devices[:4]])
    _same_shards(setup.capture_dir, tmp_path / "four-full")

    shared = tmp_path / "shared"
    real_fetch = capture_module._fetch_batch
    calls = []

    def crashing_fetch(*args):  # share 1 owns shards 1 and 3 (2 batches each): dies in shard 3, shard 1 finished
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("killed")
        return real_fetch(*args)

    monkeypatch.setattr(capture_module, "_fetch_batch", crashing_fetch)
    with pytest.raises(RuntimeError, match="killed"):
        _capture(setup.cfg, setup.params, setup.provenance, setup.examples, shared, share=(1, 2),
                 devices=[(devices[5],)])
    monkeypatch.setattr(capture_module, "_fetch_batch", real_fetch)
    assert sorted(p.name for p in shared.iterdir()) == ["parts", "shard-00001.array_record"]
    part0 = _capture(setup.cfg, setup.params, setup.provenance, setup.examples, shared, share=(0, 2),
                     devices=[(devices[6],), (devices[7],)])
    assert (part0.shards_written, part0.shards_kept) == (2, 0) and not part0.manifest.complete
    with pytest.raises(ShardError, match="unmerged shares of a multi-process capture"):
        load_manifest(shared)
    with pytest.raises(ShardError, match=r"must list shard 3 \(share 1 of 2 owns it\)"):
        merge_shares(shared, 2)
    part1 = _capture(setup.cfg, setup.params, setup.provenance, setup.examples, shared, share=(1, 2))
    assert (part1.shards_written, part1.shards_kept) == (1, 1)  # resumed on its own
    assert sorted(p.name for p in (shared / "parts").iterdir()) == ["part-00000-of-00002.json",
                                                                    "part-00001-of-00002.json"]
    merged = merge_shares(shared, 2, verify=True)
    assert merged.complete and not (shared / "parts").exists()
    _same_shards(setup.capture_dir, shared)

    # A run on another topology resumes what the shares left: share 0 of 2 finished, share 1 killed in its
    # second shard; one process keeps all three finished shards, writes the last and folds the parts in.
    moved = tmp_path / "moved"
    _capture(setup.cfg, setup.params, setup.provenance, setup.examples, moved, share=(0, 2))
    calls.clear()
    monkeypatch.setattr(capture_module, "_fetch_batch", crashing_fetch)
    with pytest.raises(RuntimeError, match="killed"):
        _capture(setup.cfg, setup.params, setup.provenance, setup.examples, moved, share=(1, 2))
    monkeypatch.setattr(capture_module, "_fetch_batch", real_fetch)
    alone = _capture(setup.cfg, setup.params, setup.provenance, setup.examples, moved)
    assert (alone.shards_kept, alone.shards_written) == (3, 1) and alone.manifest.complete
    assert not (moved / "parts").exists()
    _same_shards(setup.capture_dir, moved)
    with pytest.raises(ManifestMismatchError, match=r"part-00000-of-00002.json.*examples_hash"):
        other = tmp_path / "other"
        _capture(setup.cfg, setup.params, setup.provenance, setup.examples, other, share=(0, 2))
        _capture(setup.cfg, setup.params, setup.provenance, _examples(seed=1), other, share=(1, 2))


def test_a_replica_split_over_devices_stores_the_same_features_up_to_its_rounding(setup: Setup,
                                                                                  tmp_path: Path) -> None:
    """Two replicas, each the target split over 2 devices in tensor parallel (a target larger than one chip): the
    same tokens, masks and greedy next ids as one device, and features equal up to the rounding of the split's
    all-reduce (a partial sum per device, added in another order): within 2 bf16 ulps, in few places."""
    devices = jax.local_devices()
    out = tmp_path / "split"
    report = _capture(setup.cfg, setup.params, setup.provenance, setup.examples, out, target_labels=True,
                      devices=[tuple(devices[0:2]), tuple(devices[2:4])])
    assert report.shards_written == 4
    manifest = load_manifest(out, verify=True)
    assert manifest.examples_hash == load_manifest(setup.capture_dir).examples_hash
    tokens_BxS = np.stack([t for t, _, _ in setup.examples])
    next_ids = np.asarray(jax.numpy.argmax(forward(setup.params, setup.cfg, jax.numpy.asarray(tokens_BxS))[0], -1))
    one = load_manifest(setup.capture_dir)
    differing = total = 0
    for shard in range(manifest.num_shards):
        for sample, before in zip(iter_shard(out, manifest, shard), iter_shard(setup.capture_dir, one, shard),
                                  strict=True):
            np.testing.assert_array_equal(sample.tokens, before.tokens)
            np.testing.assert_array_equal(sample.loss_mask, before.loss_mask)
            row = int(sample.tokens[0]) - 3
            np.testing.assert_array_equal(sample.next_ids, next_ids[row, :len(sample.tokens)])
            got, ref = sample.features.astype(np.float32), before.features.astype(np.float32)
            np.testing.assert_allclose(got, ref, rtol=2 ** -6, atol=1e-6)  # as another batch shape's (D36)
            differing += int((got != ref).sum())
            total += got.size
    print(f"\ntensor parallel over 2 devices: {differing} of {total} bf16 features differ from one device's")
    assert differing <= 1e-3 * total, (differing, total)


def test_capture_prints_what_it_writes_and_refuses_a_disk_that_cannot_hold_it(setup: Setup, tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Before any shard: a log line with tokens x bytes per token of the manifest's layout and the free space;
    a destination with less free space than that (plus the margin) is refused naming both numbers. The estimate
    holds the shards the capture writes (an upper bound)."""
    manifest = load_manifest(setup.capture_dir)
    estimate = write_estimate(manifest, setup.examples, range(manifest.num_shards))
    tokens = sum(n for _, _, n in setup.examples)
    assert (estimate.tokens, estimate.per_token, estimate.samples, estimate.shards) == (tokens, 2 * 128 + 5, 24, 4)
    assert bytes_per_token(dataclasses.replace(manifest, target_labels=True, target_topk=4)) == 2 * 128 + 5 + 4 + 24
    assert sum(e.bytes for e in manifest.shards) <= estimate.bytes

    usage = shutil.disk_usage(tmp_path)
    free = {"bytes": estimate.bytes}  # less than the estimate plus its margin
    monkeypatch.setattr(capture_module.shutil, "disk_usage",
                        lambda path: usage._replace(free=free["bytes"]))
    out = tmp_path / "full"
    caplog.set_level("INFO", logger="dflash.data.capture")
    with pytest.raises(OSError, match=rf"free space must hold the capture's .* \({tokens:,} tokens x 261 "
                                      r"bytes/token, 24 records in 4 shards\) .* received .* free"):
        _capture(setup.cfg, setup.params, setup.provenance, setup.examples, out)
    assert not list(out.glob("shard-*"))
    assert f"writes 4 shards, 24 samples, {tokens:,} tokens x 261 bytes/token" in caplog.text
    free["bytes"] = int(estimate.bytes * (1 + capture_module.FREE_MARGIN)) + capture_module.FREE_RESERVE
    report = _capture(setup.cfg, setup.params, setup.provenance, setup.examples, out)
    assert report.shards_written == 4
    free["bytes"] = 0  # nothing left to write: nothing to refuse
    assert _capture(setup.cfg, setup.params, setup.provenance, setup.examples, out).shards_kept == 4
