"""The data stages end to end on the embedded target: `dflash data regenerate` -> `capture` -> `inspect` ->
`dflash train data.features=offline`; online and offline batches equal; bad captures refused before
the first step, naming what is wrong."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash.configs.recipe import load_recipe
from dflash.data.examples import build_examples
from dflash.data.manifest import ManifestMismatchError
from dflash.data.online import make_batches
from dflash.launch.cli import main
from dflash.models.drafter import online_features
from dflash.train.loop import _offline_batches

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


ONLINE = ["data.source=regenerated"]


def _args(data_dir, *extra: str) -> list[str]:
    return ["--config", "tiny", f"data.dir={data_dir}", *ONLINE, *extra]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Regenerated GSM8K answers (8 prompts, 24 tokens each) and their captured features (2 shards)."""
    d = tmp_path_factory.mktemp("data")
    assert main(["data", "regenerate", *_args(d), "--no-progress"]) == 0
    assert main(["data", "capture", *_args(d), "--no-progress"]) == 0
    return d


@pytest.mark.slow
@pytest.mark.e2e
def test_regenerate_then_capture_writes_what_training_reads(data_dir, capsys):
    records = [json.loads(line) for line in (data_dir / "regenerated.jsonl").read_text().splitlines()]
    assert len(records) == 8 and len({r["id"] for r in records}) == 8
    assert all(r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"] for r in records)
    manifest = json.loads((data_dir / "shards" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["num_samples"] == 8 and manifest["num_shards"] == 2
    assert manifest["layer_ids"] == [1, 3] and manifest["feature_dim"] == 2 * 576 and manifest["seq_len"] == 128

    # A rerun of each stage finds its work done and redoes nothing.
    assert main(["data", "regenerate", *_args(data_dir), "--no-progress"]) == 0
    assert main(["data", "capture", *_args(data_dir), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "0 errors, 0 dropped, 8 skipped (already done)" in out
    assert "captured 0 shards (2 kept from an earlier run)" in out

    assert main(["data", "inspect", *_args(data_dir), "--sample", "5"]) == 0
    out = capsys.readouterr().out
    assert "regenerated: 8 conversations" in out and "capture: complete, 8 of 8 samples in 2 of 2 shards" in out
    assert "sample 5 (" in out and "shard-00001.array_record: record 1" in out
    # The loss span opens right after the assistant header and closes after its end-of-turn token.
    assert "<|im_start|>assistant\n\u27e6" in out and "<|im_end|>\u27e7" in out


@pytest.mark.slow
@pytest.mark.e2e
def test_online_and_offline_batches_are_equal(data_dir, smollm2_target):
    """For the same rows, seed and batch size: identical tokens and masks; stored features equal the online
    features of the batch within bf16 rounding on every real position."""
    recipe = load_recipe("tiny", [f"data.dir={data_dir}", *ONLINE])
    target = smollm2_target
    arch = target.drafter_arch(recipe.drafter)
    examples, _ = build_examples(recipe.data, target.tokenizer)
    online = make_batches([(t, m) for t, m, _ in examples], 4, recipe.train.seed)
    offline, fingerprint = _offline_batches(recipe.data, target, arch, per_host=4)
    assert fingerprint.startswith("offline:")
    feats = jax.jit(lambda p, t: online_features(p, target.cfg, t, arch.layer_ids))
    lengths = {np.asarray(t, np.int32).tobytes(): n for t, _, n in examples}
    try:
        for _ in range(5):  # 8 samples, batches of 4: crosses two epoch boundaries
            a, b = next(online), next(offline)
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
            want = np.asarray(feats(target.params, jnp.asarray(a.tokens)), np.float32)
            got = np.asarray(b.features, np.float32)
            n = np.array([lengths[row.tobytes()] for row in np.asarray(a.tokens, np.int32)])
            real = np.arange(got.shape[1])[None, :] < n[:, None]
            np.testing.assert_allclose(got[real], want[real], rtol=2**-8, atol=1e-6)
            assert not got[~real].any()  # padding positions hold zero features offline
    finally:
        offline.close()


@pytest.mark.slow
@pytest.mark.e2e
def test_offline_training_runs_and_a_mismatched_capture_is_refused(data_dir, tmp_path, capsys, caplog):
    run = ["train", *_args(data_dir), "data.features=offline", f"train.run_dir={tmp_path / 'run'}",
           "train.batch_size=8", "--no-progress"]  # the test process has 8 devices
    with caplog.at_level("INFO", logger="dflash.train.loop"):
        assert main(run) == 0
    assert "trained 8 steps (to step 8)" in capsys.readouterr().out
    assert "offline features: 8 samples" in caplog.text

    # Another layer choice and another row length: refused before any step, every field named.
    bad = [a if not a.startswith("train.run_dir") else f"train.run_dir={tmp_path / 'bad'}" for a in run]
    assert main([*bad, "drafter.layer_ids=[1,4]", "data.seq_len=64"]) == 2
    err = capsys.readouterr().err
    assert "2 field(s) differ: layer_ids: manifest (1, 3), run (1, 4); seq_len: manifest 128, run 64" in err
    assert not (tmp_path / "bad" / "checkpoints").exists()

    # Packed rows (data.pack): several conversations per row; a row length below seq_len, or packing online
    # features, is a config error.
    packed = [a if not a.startswith("train.run_dir") else f"train.run_dir={tmp_path / 'packed'}" for a in run]
    with caplog.at_level("INFO", logger="dflash.train.loop"):
        assert main([*packed, "data.pack=384", "train.steps=2"]) == 0
    assert "trained 2 steps (to step 2)" in capsys.readouterr().out
    assert main([*bad, "data.pack=64"]) == 2
    err = capsys.readouterr().err
    assert "data.pack must be 0 (one conversation per row) or a row length >= data.seq_len (128)" in err
    assert main([*bad, "data.pack=384", "data.features=online"]) == 2
    assert "data.pack must be 0 with data.features=online" in capsys.readouterr().err

    # A truncated shard is named before training starts.
    broken = tmp_path / "broken"
    shutil.copytree(data_dir, broken)
    shard = broken / "shards" / "shard-00001.array_record"
    shard.write_bytes(shard.read_bytes()[:1000])
    assert main([*bad, f"data.dir={broken}"]) == 2
    assert "shard-00001.array_record" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.e2e
def test_target_labels_are_captured_and_trained_on(data_dir, tmp_path, capsys):
    """data.labels=target: the capture also stores the target's next tokens, offline training reads them, a
    capture without them is refused before any step, and online features cannot have them."""
    labelled = tmp_path / "labelled"
    labelled.mkdir()
    shutil.copy(data_dir / "regenerated.jsonl", labelled)
    shutil.copy(data_dir / "regenerated.jsonl.meta.json", labelled)
    target = ["data.features=offline", "data.labels=target"]
    assert main(["data", "capture", *_args(labelled), *target, "--no-progress"]) == 0
    assert json.loads((labelled / "shards" / "manifest.json").read_text())["target_labels"] is True
    run = ["train", *_args(labelled), *target, f"train.run_dir={tmp_path / 'run'}", "train.batch_size=8",
           "train.steps=2", "--no-progress"]
    assert main(run) == 0
    assert "trained 2 steps (to step 2)" in capsys.readouterr().out

    unlabelled = [a if not a.startswith("data.dir") else f"data.dir={data_dir}" for a in run]
    assert main([*unlabelled[:-2], f"train.run_dir={tmp_path / 'bad'}", "--no-progress"]) == 2
    assert "target_labels: manifest False, run True" in capsys.readouterr().err
    assert main(["train", *_args(labelled), "data.labels=target", f"train.run_dir={tmp_path / 'bad'}"]) == 2
    assert "data.labels must be 'text' with data.features=online" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.e2e
def test_soft_labels_are_captured_and_trained_on(data_dir, tmp_path, capsys):
    """data.labels=soft: the capture stores the target's top-k, offline training (padded and packed rows)
    distils it, a fine-tune of that drafter with a mix of distribution losses runs and logs each term, those
    terms are refused without soft labels, and a capture of another k or without it is refused before any step."""
    soft_dir = tmp_path / "soft"
    soft_dir.mkdir()
    shutil.copy(data_dir / "regenerated.jsonl", soft_dir)
    shutil.copy(data_dir / "regenerated.jsonl.meta.json", soft_dir)
    soft = ["data.features=offline", "data.labels=soft", "data.soft_topk=4"]
    assert main(["data", "capture", *_args(soft_dir), *soft, "--no-progress"]) == 0
    manifest = json.loads((soft_dir / "shards" / "manifest.json").read_text())
    assert manifest["target_labels"] is True and manifest["target_topk"] == 4
    for extra in ([], ["data.pack=256"]):
        run = ["train", *_args(soft_dir), *soft, *extra, f"train.run_dir={tmp_path / ('run' + str(len(extra)))}",
               "train.batch_size=8", "train.steps=2", "--no-progress"]
        assert main(run) == 0
        assert "trained 2 steps (to step 2)" in capsys.readouterr().out
    # the distribution losses fine-tune that drafter (train.init_from) on the same soft labels, each term logged
    mix = ["train", *_args(soft_dir), *soft, f"train.run_dir={tmp_path / 'mix'}", "train.batch_size=8",
           "train.steps=2", f"train.init_from={tmp_path / 'run0'}", "train.loss=ce:0.1,tv:0.9,opd:0.5",
           "train.weighting=dpace", "--no-progress"]
    assert main(mix) == 0
    assert "trained 2 steps (to step 2)" in capsys.readouterr().out
    logged = [json.loads(line) for line in (tmp_path / "mix" / "metrics.jsonl").read_text().splitlines()]
    assert any({"loss/ce", "loss/tv", "loss/opd"} <= set(r) for r in logged)
    assert main(["train", *_args(data_dir), f"train.run_dir={tmp_path / 'bad3'}", "train.loss=tv",
                 "train.batch_size=8", "--no-progress"]) == 2
    assert "train.loss must be ce alone unless data.labels=soft" in capsys.readouterr().err
    assert main(["train", *_args(soft_dir), "data.features=offline", "data.labels=soft", "data.soft_topk=8",
                 f"train.run_dir={tmp_path / 'bad'}", "train.batch_size=8", "--no-progress"]) == 2
    assert "target_topk: manifest 4, run 8" in capsys.readouterr().err
    assert main(["train", *_args(data_dir), *soft, f"train.run_dir={tmp_path / 'bad2'}", "train.batch_size=8",
                 "--no-progress"]) == 2
    assert "target_labels: manifest False, run True" in capsys.readouterr().err


def test_capture_over_two_shares_and_replicas_stores_what_one_process_does(smollm2_target, tmp_path, caplog):
    """`run_capture` as each process of a 2-process run calls it (share 1 first, then share 0, which merges), with
    2 replicas each: the same manifest and byte-identical shards as one process on one device (the 2-process run
    on localhost: tests/test_multiprocess.py, nightly)."""
    from dflash.data import stages
    from dflash.data.scaleout import Share

    def recipe(name: str, *extra: str):
        return load_recipe("tiny", [f"data.dir={tmp_path / name}", "data.max_examples=8", "data.samples_per_shard=2",
                                    *extra])

    one = stages.run_capture(recipe("one"), target=smollm2_target, progress=False)
    sliced = recipe("sliced", "data.capture_replicas=2")
    with caplog.at_level("INFO", logger="dflash.data"):
        part = stages.run_capture(sliced, target=smollm2_target, progress=False, share=Share(1, 2), merge=False)
    assert "capture: 2 replica(s) on cpu:0; cpu:1; shards i with i % 2 == 1" in caplog.text
    assert (part.shards_written, part.manifest.complete) == (2, False)
    assert "capture: 2 shards finished by 1 share(s) under" in stages.inspect_data(sliced)
    merged = stages.run_capture(sliced, target=smollm2_target, progress=False, share=Share(0, 2))
    assert merged.shards_written == 2 and merged.manifest.complete
    assert dataclasses.replace(merged.manifest, created={}) == dataclasses.replace(one.manifest, created={})
    for entry in one.manifest.shards:
        assert (sliced.data.shard_dir / entry.file).read_bytes() == (recipe("one").data.shard_dir / entry.file
                                                                     ).read_bytes()
    assert not (sliced.data.shard_dir / "parts").exists()
    with pytest.raises(ValueError, match="data.capture_devices_per_replica must be at most this process's 8 local"):
        stages.run_capture(recipe("bad", "data.capture_devices_per_replica=9"), target=smollm2_target, progress=False)


def test_manifest_mismatch_error_is_a_value_error():
    assert issubclass(ManifestMismatchError, ValueError)  # the CLI maps ValueError to exit status 2
