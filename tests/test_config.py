"""The recipe system: every shipped YAML parses; bad keys and values are rejected with a clear message."""

import pytest
import yaml

from dflash.configs.recipe import Recipe, dump_recipe, load_recipe, shipped_configs
from dflash.configs.schema import ConfigError, apply_overrides, build
from dflash.models.config import TargetConfig


@pytest.mark.parametrize("path", shipped_configs(), ids=lambda p: p.stem)
def test_every_shipped_config_loads(path):
    recipe = load_recipe(str(path))
    assert isinstance(recipe, Recipe)
    # What a run records (dump_recipe) loads back to the same recipe.
    assert build(Recipe, yaml.safe_load(dump_recipe(recipe))) == recipe


def test_shipped_configs_exist():
    names = {p.stem for p in shipped_configs()}
    assert {"default", "tiny"} <= names


def test_dotted_overrides_apply_and_parse_yaml_scalars():
    recipe = load_recipe("tiny", ["target.dtype=bfloat16", "sampling.temperature=0.7", "sampling.max_new_tokens=5"])
    assert recipe.target.dtype == "bfloat16"
    assert recipe.sampling.temperature == 0.7
    assert recipe.sampling.max_new_tokens == 5
    assert recipe.target.max_seq_len == 256  # untouched key keeps the YAML's value


def test_unknown_key_is_rejected_naming_it():
    with pytest.raises(ConfigError, match=r"target\.max_len.*allowed keys"):
        load_recipe("tiny", ["target.max_len=3"])
    with pytest.raises(ConfigError, match=r"unknown key.*'trian'"):
        load_recipe("tiny", ["trian.lr=3"])


def test_invalid_value_names_field_value_and_rule():
    with pytest.raises(ConfigError, match=r"target\.dtype must be one of \['float32', 'bfloat16'\]; received 'fp8'"):
        load_recipe("tiny", ["target.dtype=fp8"])
    with pytest.raises(ConfigError, match=r"sampling\.top_p must lie in \(0, 1\]; received 1.5"):
        load_recipe("tiny", ["sampling.top_p=1.5"])
    with pytest.raises(ConfigError, match=r"target\.max_seq_len must be an integer; received 'long'"):
        load_recipe("tiny", ["target.max_seq_len=long"])


def test_malformed_override_and_unknown_config_name():
    with pytest.raises(ConfigError, match="section.key=value"):
        apply_overrides({}, ["target.dtype"])
    with pytest.raises(ConfigError, match="one of"):
        load_recipe("no-such-recipe")


def test_bool_is_not_an_int():
    with pytest.raises(ConfigError, match="must be an integer"):
        build(TargetConfig, {"max_seq_len": True})


def test_training_md_names_every_shipped_recipe():
    """docs/training.md's recipe list names every configs/*.yaml (issue 58: it had left out gpt_oss_20b)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    listed = text.split("Recipes in `configs/`:", 1)[1].split("`dflash config", 1)[0]
    missing = [p.stem for p in shipped_configs() if f"`{p.stem}`" not in listed]
    assert not missing, f"docs/training.md's recipe list does not name {missing}"


def test_gpt_oss_20b_header_counts_its_epochs_from_the_rows_it_trains():
    """gpt_oss_20b trains one row per assistant turn (docs/data.md "Harmony"), so its 5,880 steps are not the 6 epochs
    of the recipes that train one row per conversation: the header's counts are the mix's, and its arithmetic holds."""
    import re

    from dflash.configs.recipe import resolve_config_path
    from dflash.data.sources import mix, mix_spec

    recipe = load_recipe("gpt_oss_20b")
    items, _ = mix(mix_spec(recipe.data))
    turns = sum(1 for item in items for m in item["messages"] if m["role"] == "user")
    header = " ".join(line.lstrip("# ") for line in resolve_config_path("gpt_oss_20b").read_text().splitlines()
                      if line.startswith("#"))
    rows = recipe.train.steps * recipe.train.batch_size
    assert f"{len(items):,} prompts" in header and f"{turns:,} user turns" in header
    assert f"{rows:,} rows = 6 epochs" in header and rows == 6 * len(items)
    assert f"{rows / turns:.1f} epochs" in header and rows / turns < 3  # 2.6: the negative of the old claim
    steps = re.search(r"6 x [\d,]+ / \d+ = ([\d,]+) steps", header)
    assert steps and int(steps.group(1).replace(",", "")) == round(6 * turns / recipe.train.batch_size)


MAX_LEAVES = 100  # D108: a leaf is what a recipe sets or a study needs; how one machine runs a stage is a flag


def _leaves(tree) -> int:
    return sum(_leaves(v) for v in tree.values()) if isinstance(tree, dict) else 1


def test_the_recipe_has_at_most_a_hundred_leaves():
    """`dflash config --config default` prints at most MAX_LEAVES leaf fields (issue 60; a list is one leaf)."""
    from dflash.launch.cli import main

    assert _leaves({"a": {"b": 1, "c": [1, 2]}, "d": None}) == 3  # the count sees nesting, lists and nulls
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["config", "--config", "default"]) == 0
    n = _leaves(yaml.safe_load(out.getvalue()))
    assert 90 <= n <= MAX_LEAVES, n
