"""The recipe: one frozen config composed of every package's own section.

`configs/*.yaml` are instances of `Recipe`. Each component receives only its own section.
Load with `load_recipe(path_or_name, overrides)`; `dflash <stage> --config NAME a.b=1` does this.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from dflash.configs.schema import ConfigError, apply_overrides, build, require, to_dict
from dflash.data.config import DataConfig
from dflash.launch.config import LaunchConfig
from dflash.models.config import DrafterConfig, TargetConfig
from dflash.serve.config import SamplingConfig, ServeConfig
from dflash.train.config import TrainConfig

CONFIG_DIR = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Every section of a run. New stages add their section here."""

    target: TargetConfig = dataclasses.field(default_factory=TargetConfig)
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    drafter: DrafterConfig = dataclasses.field(default_factory=DrafterConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    serve: ServeConfig = dataclasses.field(default_factory=ServeConfig)
    launch: LaunchConfig = dataclasses.field(default_factory=LaunchConfig)

    def __post_init__(self) -> None:
        check_train_data(self.train, self.data)


def check_train_data(train: TrainConfig, data: DataConfig) -> None:
    """The rules between the train and data sections, checked when a recipe loads (so `dflash config` and `dflash
    launch` refuse what would otherwise stop the trainer on the pod) and again by the trainer's `build_run`:
    a loss beyond ce needs the target's stored distribution (data.labels=soft), and walk anchors a serving walk."""
    require(all(name == "ce" for name, _ in train.loss_terms) or data.labels == "soft", "train.loss", train.loss,
            f"be ce alone unless data.labels=soft (the other terms compare the drafter's distribution with the "
            f"target's stored top-k; data.labels is {data.labels!r})")
    require(not train.walk_anchors or bool(data.walk), "train.walk_anchors", train.walk_anchors,
            "be 0 unless data.walk names a serving walk (`auto` or a path; `dflash data walk` writes it)")


def shipped_configs() -> list[Path]:
    """The YAML recipes shipped in configs/."""
    return sorted(CONFIG_DIR.glob("*.yaml"))


def resolve_config_path(name_or_path: str) -> Path:
    """A recipe name (`default`, `tiny`) or a path to a YAML file."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    candidate = CONFIG_DIR / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    names = [p.stem for p in shipped_configs()]
    raise ConfigError(f"config must be a YAML file or one of {names}; received {name_or_path!r}")


def load_recipe(name_or_path: str | None = "default", overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Load a recipe YAML (or the defaults when None), apply dotted overrides, validate everything."""
    data: dict[str, Any] = {}
    if name_or_path is not None:
        path = resolve_config_path(name_or_path)
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path} is not valid YAML: {err}") from err
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections; received {type(loaded).__name__}")
        data = loaded or {}
    return build(Recipe, apply_overrides(data, list(overrides)))


def dump_recipe(recipe: Recipe) -> str:
    """The recipe as YAML text (what a run records next to its outputs)."""
    return yaml.safe_dump(to_dict(recipe), sort_keys=False)
