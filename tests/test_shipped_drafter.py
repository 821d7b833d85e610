"""The drafter shipped for the embedded default target (data/assets/drafters/smollm2-dflash): it is the file its
README records, small enough to ship, fits the target, decodes losslessly and accepts drafts (it was trained)."""

import hashlib
import re

import pytest

from dflash.models.registry import SHIPPED_DRAFTERS, shipped_drafter_path

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


SHIPPED = SHIPPED_DRAFTERS / "smollm2-dflash"


def test_the_default_target_has_a_shipped_drafter_whose_files_match_its_readme():
    assert shipped_drafter_path("smollm2") == SHIPPED
    readme = (SHIPPED / "README.md").read_text()
    weights = SHIPPED / "model.safetensors"
    assert weights.stat().st_size <= 20 * 2**20
    recorded = dict(re.findall(r"sha256 of `([\w.]+)`: `([0-9a-f]{64})`", readme))
    assert set(recorded) >= {"model.safetensors", "config.json", "draft_vocab.json"}
    for name, digest in recorded.items():
        assert hashlib.sha256((SHIPPED / name).read_bytes()).hexdigest() == digest, name
    assert "dflash train --config smollm2" in readme and "dflash-export" in readme


@pytest.mark.e2e
def test_the_shipped_drafter_is_lossless_and_accepts_drafts_on_held_out_prompts(smollm2_target):
    """Greedy DFlash with the shipped drafter emits AR's tokens, and it accepts drafts on GSM8K test questions
    (a random drafter's τ is about 1.0; the README's table reports what the recipe's drafter reaches)."""
    from dflash.data.eval_sets import eval_prompts
    from dflash.models.drafter_io import load_drafter
    from dflash.serve.engine import decode

    target = smollm2_target
    drafter = load_drafter(SHIPPED, target.cfg)
    assert drafter.draft_vocab is not None and drafter.arch.num_layers == 2
    # items 3 and 4: training picked its best checkpoint by real τ on items 1 and 2
    prompts = [list(p.ids) for p in eval_prompts(target.tokenizer, ["gsm8k"], 4)[2:]]
    stops = tuple(target.tokenizer.stop_token_ids)
    ar = decode(target.params, target.cfg, prompts, 48, max_len=512, stop_ids=stops)
    dflash = decode(target.params, target.cfg, prompts, 48, max_len=512, drafter=drafter, stop_ids=stops)
    assert [c.token_ids for c in dflash] == [c.token_ids for c in ar]
    tokens = sum(len(c.token_ids) - 1 for c in dflash)
    steps = sum(len(c.accepted) for c in dflash)
    assert tokens / steps >= 1.3, f"tau {tokens / steps:.2f}"
