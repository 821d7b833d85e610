"""Tiny Qwen3-MoE and gpt-oss targets end to end (issue 52's "done when"): a drafter trains a few steps online (the
MoE target inside the train step), serves with greedy output equal to AR through the engine, and exports to the z-lab
and the speculators layouts (layer ids + 1), each loading back to the same drafter. The targets are the golden tiny
`qwen3_moe` and `gpt_oss` (tools/golden_families.py) with a small word-level tokenizer and a ChatML template built
by tools/tiny_moe.py (their 256-row embeddings fit no real tokenizer)."""

import json

import jax
import jax.numpy as jnp
import pytest
from conftest import assert_same_params

from dflash.configs.recipe import load_recipe
from dflash.models.loading import load_hf_dir
from dflash.models.target import Target
from dflash.models.tokenizer import load_tokenizer_from_hf_dir
from tools.tiny_moe import MASK_TOKEN_ID, tiny_moe_dir

pytestmark = [pytest.mark.heavy, pytest.mark.e2e]


# slow (both, ~1.5 min each): test_target_families keeps each piece for both MoE kinds in the default tier: the
# sharded MoE forward over a training mesh equals transformers (test_experts_split_over_an_expert_mesh_axis), the
# engine's DFlash chain equals transformers' greedy tokens (test_engine_greedy_equals_transformers_generate
# [qwen3_moe-chain], [gpt_oss-chain]), and the z-lab layout carries a drafter for each family
@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss"])
def test_a_drafter_for_a_moe_target_trains_online_serves_losslessly_and_exports(case, tmp_path):
    from dflash.export.run import ExportLayout, export_run
    from dflash.models.drafter_io import load_drafter
    from dflash.models.drafter_io import load_hf_dir as load_drafter_dir
    from dflash.serve.engine import Engine
    from dflash.serve.plan import AR, Chain, Limits
    from dflash.train.loop import run_training

    path = tiny_moe_dir(case, tmp_path / "moe")
    cfg, params = load_hf_dir(path)
    assert cfg.num_experts == 8 and cfg.family == case
    tokenizer = load_tokenizer_from_hf_dir(path)
    target = Target(name=str(path), path=path, cfg=cfg, weights=jax.tree.map(jnp.asarray, params),
                    tokenizer=tokenizer, dtype=jnp.float32)
    recipe = load_recipe("tiny", [
        f"target.source={path}", f"drafter.mask_token_id={MASK_TOKEN_ID}", "drafter.block_size=4",
        "drafter.layer_ids=[0,2]",
        "data.seq_len=64", "data.max_examples=16", "train.batch_size=8", "train.steps=3", "train.save_every=3",
        f"train.run_dir={tmp_path / 'run'}"])
    result = run_training(recipe, target=target, progress=False)
    assert result.final_step == 3

    drafter = load_drafter(tmp_path / "run", cfg)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is 3 plus 4 ?"}], add_generation_prompt=True)
    outputs = []
    for plan, with_drafter in ((AR(), None), (Chain(4), drafter)):
        engine = Engine(target.params, cfg, with_drafter, plan, Limits(slots=2, max_len=96))
        rid = engine.submit(prompt, 24, ())
        outputs.append(engine.run()[rid].token_ids)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 24

    export_run(tmp_path / "run", ExportLayout("zlab"), out=tmp_path / "zlab", say=lambda _: None)
    exported = json.loads((tmp_path / "zlab" / "config.json").read_text())
    assert exported["dflash_config"]["mask_token_id"] == MASK_TOKEN_ID and exported["num_target_layers"] == 4
    assert_same_params(drafter, load_drafter_dir(tmp_path / "zlab", cfg))
    export_run(tmp_path / "run", ExportLayout("speculators"), out=tmp_path / "spec", say=lambda _: None)
    spec = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert spec["aux_hidden_state_layer_ids"] == [1, 3] and spec["target_hidden_size"] == cfg.hidden_size
    assert_same_params(drafter, load_drafter_dir(tmp_path / "spec", cfg))
