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
