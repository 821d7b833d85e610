"""Refuse early (issue 51 item 5): every stage reads only the target's config.json (a directory's, a known target's,
the Hub's through `hf_hub_download` of that one file) or a GGUF's metadata and refuses an unsupported architecture
before any weights move or any pod starts; a recipe's cross-section rules and its fit to the launch slice are
checked when it loads or launches, not on the pod."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.configs.recipe import load_recipe
from dflash.configs.schema import ConfigError
from dflash.launch.cli import main
from dflash.models import registry
from dflash.models.config import SUPPORTED_FAMILIES, TargetConfig
from dflash.models.registry import TargetUnavailable, check_target

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_TINY = ROOT / "tests" / "golden" / "tiny"
# an architecture no session plans to support (a state-space model): the refusals' example
UNSUPPORTED = {"architectures": ["MambaForCausalLM"], "model_type": "mamba", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 2, "vocab_size": 100}
LAUNCH = ["launch", "xpk", "train", "--config", "qwen3_8b", "--cluster", "c1", "--run-dir", "gs://bk1/runs/r1",
          "--dry-run"]


@pytest.fixture
def unsupported_dir(tmp_path) -> Path:
    """An HF directory of an unsupported family whose "weights" are not a safetensors file: reading them would fail
    with another message than the architecture's."""
    (tmp_path / "config.json").write_text(json.dumps(UNSUPPORTED))
    (tmp_path / "model.safetensors").write_bytes(b"not weights")
    return tmp_path


def test_an_unsupported_config_json_is_refused_naming_the_architecture(unsupported_dir):
    """Only config.json is read (the weights file beside it is not a safetensors file): 0.2 s through `dflash
    config`, measured (D73), not asserted here."""
    with pytest.raises(ConfigError) as err:
        check_target(str(unsupported_dir))
    message = str(err.value)
    assert "MambaForCausalLM" in message and "model_type 'mamba'" in message
    assert str(unsupported_dir / "config.json") in message and str(list(SUPPORTED_FAMILIES)) in message


@pytest.mark.parametrize("argv", [
    ["config", "--config", "tiny"],
    ["train", "--config", "tiny"],
    ["data", "regenerate", "--config", "tiny"],
    ["serve", "--config", "tiny", "--ar"],
    LAUNCH + ["--tpu-type", "v5p-128"],
])
def test_every_stage_refuses_it_before_jax_is_imported(unsupported_dir, argv):
    """Through the real entry point in a fresh interpreter: exit 2 with the architecture named, and JAX (hence any
    weight) never imported."""
    argv = [*argv, f"target.source={unsupported_dir}"]
    code = (f"import sys; from dflash.launch.cli import main; rc = main({argv!r}); "
            "print('jax imported' if 'jax' in sys.modules else 'no jax'); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "MambaForCausalLM (model_type 'mamba')" in done.stderr
    assert done.stdout.strip() == "no jax"


def test_load_target_checks_before_it_resolves_or_downloads(unsupported_dir, monkeypatch):
    from dflash.models import target

    def never(*args, **kwargs):
        raise AssertionError("resolve_source ran before the architecture check")

    monkeypatch.setattr(target, "resolve_source", never)
    with pytest.raises(ConfigError, match="MambaForCausalLM"):
        target.load_target(TargetConfig(source=str(unsupported_dir)))


def test_a_hub_id_is_checked_from_its_config_json_alone(tmp_path, monkeypatch, caplog):
    """hf_hub_download of config.json only (no snapshot of the weights); where neither the cache nor the Hub has it,
    a stage stops naming the repo, and `dflash config` / `dflash launch` only warn (the pod checks it again)."""
    import huggingface_hub

    (tmp_path / "config.json").write_text(json.dumps(UNSUPPORTED))
    asked = []

    def fake_download(repo_id, filename, **kwargs):
        asked.append((repo_id, filename))
        return str(tmp_path / "config.json")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("weights were fetched"))
    with pytest.raises(ConfigError, match=r"MambaForCausalLM .*state-spaces/mamba-130m-hf/config\.json"):
        check_target("state-spaces/mamba-130m-hf")
    assert asked == [("state-spaces/mamba-130m-hf", "config.json")]

    def offline(repo_id, filename, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(TargetUnavailable, match=r"'org/model'.*hf download org/model"):
        check_target("org/model")
    assert check_target("org/model", unreachable_ok=True) is None
    assert "checked on the pod" in caplog.text
    # Known targets need no network: their config.json fields are recorded in models/registry.py.
    assert check_target("Qwen/Qwen3-8B").family == "qwen3"


def test_supported_sources_pass_with_their_architecture():
    smollm2 = check_target("smollm2")  # the packaged GGUF's metadata
    assert (smollm2.family, smollm2.cfg.num_layers, smollm2.mask_token_id) == ("llama", 30, 16)
    assert smollm2.where.endswith(".gguf")
    for directory in sorted(p for p in GOLDEN_TINY.iterdir() if (p / "config.json").is_file()):
        found = check_target(str(directory))
        assert found.family in SUPPORTED_FAMILIES and found.where == str(directory / "config.json")


def test_a_gguf_of_another_architecture_is_refused_from_its_metadata(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match=r"general\.architecture 'gemma3', read from .*gemma\.gguf"):
        check_target(str(path))


def test_other_unsupported_config_fields_are_named(tmp_path):
    qwen2 = {**UNSUPPORTED, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
             "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}
    (tmp_path / "config.json").write_text(json.dumps(qwen2))
    with pytest.raises(ConfigError, match=r"must be default, llama3, linear or yarn; received 'longrope'"):
        check_target(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"target\.source must be a Hugging Face model directory holding config"):
        check_target(str(empty))


def test_cross_section_rules_are_refused_when_the_recipe_loads():
    """A loss the data mode cannot feed, walk anchors without a walk: refused at load (so `dflash config` and
    `dflash launch` refuse them), not by the trainer on the pod."""
    with pytest.raises(ConfigError, match=r"^train\.loss must be ce alone unless data\.labels=soft.*received 'tv'$"):
        load_recipe("qwen3_8b", ["train.loss=tv"])
    with pytest.raises(ConfigError, match=r"^train\.walk_anchors must be 0 unless data\.walk"):
        load_recipe("tiny", ["train.walk_anchors=0.5"])
    assert load_recipe("tiny", ["train.loss=ce:0.1,tv:0.9", "data.labels=soft", "data.features=offline"])


def test_the_drafter_section_is_checked_against_the_target_architecture(capsys):
    assert main(["config", "--config", "tiny", "drafter.layer_ids=[1,40]"]) == 2
    assert "drafter.layer_ids must lie in [0, 30) for a 30-layer target" in capsys.readouterr().err
    assert main(["config", "--config", "qwen3_8b", "drafter.mask_token_id=200000"]) == 2
    assert "drafter.mask_token_id must lie inside the target's vocab [0, 151936)" in capsys.readouterr().err


@pytest.mark.parametrize(("tpu", "overrides", "message"), [
    ("v5p-128", ["train.batch_size=24"], "train.batch_size must be a multiple of mesh data x fsdp = 16 on v5p-128"),
    ("v5p-128", ["train.mesh.tensor=3"], "train.mesh must divide the 64 devices"),
    ("v5p-128", ["train.mesh.tensor=64", "train.batch_size=8"],
     "train.batch_size must be a multiple of the host count 16 of v5p-128"),
])
def test_the_launch_refuses_a_recipe_that_does_not_fit_the_slice(capsys, tpu, overrides, message):
    assert main([*LAUNCH, "--tpu-type", tpu, *overrides]) == 2
    assert message in capsys.readouterr().err
    assert main([*LAUNCH, "--tpu-type", "v5p-128"]) == 0  # the recipe as shipped fits its slice
    assert "xpk workload create" in capsys.readouterr().out


def test_the_supported_families_are_one_list():
    from dflash.models import loading

    assert loading.SUPPORTED_FAMILIES is SUPPORTED_FAMILIES is registry.SUPPORTED_FAMILIES
