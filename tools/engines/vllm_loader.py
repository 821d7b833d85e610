"""Does vLLM's own weight loader take every tensor of an exported drafter? For the layouts vLLM cannot serve on a CPU
(DFlash2 with its candidate selector, drafters that mix sliding and full layers: its V1 model runner, the only one
without Triton, refuses them), this builds the model class vLLM would serve the export with, on the CPU, and loads
the export through that class's `load_weights`, strictly:

- the speculative config is made as `vllm serve --speculative-config '{"method": "dflash", "model": DIR, ...}'` makes
  it; the runner's refusal (`Model Runner V1 does not support: ...`) is recorded, then that one check is skipped so
  that the config (and the model class it names) can be built, as the V2 runner (which needs Triton) builds it;
- every parameter of the model is filled with NaN, the export is loaded, and each parameter is compared with the
  export's tensors as vLLM packs them at tensor-parallel size 1 (`qkv_proj` = q | k | v rows, `gate_up_proj` =
  gate | up rows, the rest by name): a parameter still NaN or unequal is `missing` / `mismatched`, an export tensor
  that no parameter took is `left_over`; the target's embedding and LM head (shared from the target at serving
  time) and the parameters of features the export does not use (`optional`: a separately trained mask embedding, a
  reduced draft vocabulary's map) are the only ones allowed to stay unloaded. A tensor of the wrong shape stops
  vLLM's own loader (an `error`).

Runs in the engines environment (.venv-engines), never the project's .venv:

    .venv-engines/bin/python tools/engines/vllm_loader.py --target HF_TARGET_DIR --out REPORT.json DRAFTER_DIR [...]

REPORT.json (vLLM logs to stdout) is a list with one object per export, `{"dir", "architecture", "model_class",
"refused", "parameters", "tensors", "checked", "missing", "left_over", "mismatched", "shared", "optional", "reads",
"error"}`
(`reads`: how the class read the config: each layer's window, causality and
convolution, the selector's top-k and rank); exit status 0 when every export loaded strictly, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import traceback
from pathlib import Path

# Parameters vLLM fills from the target at serving time (the drafter ships neither): allowed to stay unloaded.
SHARED = ("model.embed_tokens.weight", "lm_head.weight")
# Parameters of the class that only exist for features the export does not use (a separately trained mask
# embedding, a reduced draft vocabulary): allowed to stay unloaded when the export has no tensor for them.
OPTIONAL = ("model.mask_embedding", "draft_id_to_target_id")
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _vllm_config(target: Path, drafter: Path, k: int):
    """The VllmConfig `vllm serve TARGET --speculative-config {dflash, DRAFTER, K-1}` builds, and the V1 runner's
    refusal of it (None: accepted)."""
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(target), dtype="float32", enforce_eager=True, max_model_len=256,
                      skip_tokenizer_init=True, max_num_seqs=1,
                      speculative_config={"method": "dflash", "model": str(drafter), "num_speculative_tokens": k - 1})
    try:
        return args.create_engine_config(), None
    except ValueError as err:
        if "Model Runner V1 does not support" not in str(err):
            raise
        refused = str(err)
    original = VllmConfig._validate_v1_model_runner
    VllmConfig._validate_v1_model_runner = lambda self: None
    try:
        return args.create_engine_config(), refused
    finally:
        VllmConfig._validate_v1_model_runner = original


def _build(vllm_config, draft_config, v2: bool):
    """The draft model class instance; `v2`: built as the V2 model runner builds it (a layout the V1 runner refused:
    the class itself refuses mixed sliding/full layers outside V2)."""
    from vllm.model_executor.model_loader.utils import initialize_model

    before = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if v2:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    try:
        return initialize_model(vllm_config=vllm_config, model_config=draft_config)
    finally:
        if before is None:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = before


def _reads(model) -> dict:
    """How the built class read the export's config: per layer its attention window and causality, and for DFlash2
    each layer's convolution (taps, group size) and the candidate selector's top-k and rank."""
    layers = []
    for layer in model.model.layers:
        entry = {"sliding_window": layer.self_attn.sliding_window, "causal": bool(layer.self_attn.causal)}
        conv = getattr(layer, "attention_conv", None)
        if conv is not None:
            entry.update(conv_taps=conv.taps, conv_group_size=conv.group_size)
        layers.append(entry)
    out: dict = {"layers": layers}
    selector = getattr(model.model, "candidate_selector", None)
    if selector is not None:
        out["selector"] = {"top_k": selector.top_k, "rank": int(selector.predecessor_codebook.shape[1])}
    return out


def _expected(name: str, tensors: dict, used: set[str]):
    """The export's value for vLLM parameter `name` (tensor-parallel size 1), marking the tensors it takes."""
    import torch

    key = name.removeprefix("model.")
    parts = key.rsplit(".", 2)
    if len(parts) == 3 and parts[1] in PACKED:
        names = [f"{parts[0]}.{sub}.{parts[2]}" for sub in PACKED[parts[1]]]
        if all(n in tensors for n in names):
            used.update(names)
            return torch.cat([tensors[n] for n in names], dim=0)
        return None
    if key in tensors:
        used.add(key)
        return tensors[key]
    return None


def check(target: Path, drafter: Path) -> dict:
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.model_executor.model_loader.utils import get_model_architecture

    config = json.loads((drafter / "config.json").read_text())
    k = config.get("block_size") or config.get("dflash_config", {}).get("block_size")
    report: dict = {"dir": str(drafter), "architecture": (config.get("architectures") or [None])[0],
                    "model_class": None, "refused": None, "parameters": 0, "tensors": 0, "checked": 0,
                    "missing": [], "left_over": [], "mismatched": [], "shared": [], "optional": [],
                    "reads": None, "error": None}
    try:
        vllm_config, report["refused"] = _vllm_config(target, drafter, int(k))
        draft_config = vllm_config.speculative_config.draft_model_config
        model_class, _ = get_model_architecture(draft_config)
        report["model_class"] = model_class.__name__
        with set_current_vllm_config(vllm_config):
            if not parallel_state.model_parallel_is_initialized():
                parallel_state.init_distributed_environment(
                    world_size=1, rank=0, local_rank=0, backend="gloo",
                    distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
                parallel_state.ensure_model_parallel_initialized(1, 1)
            model = _build(vllm_config, draft_config, v2=report["refused"] is not None)
            params = dict(model.named_parameters())
            with torch.no_grad():
                for p in params.values():
                    p.fill_(float("nan"))
            tensors = {n: t.float() for n, t in load_file(str(drafter / "model.safetensors")).items()}
            model.load_weights(iter(tensors.items()))
        report["parameters"], report["tensors"] = len(params), len(tensors)
        report["reads"] = _reads(model)
        used: set[str] = set()
        for name, param in sorted(params.items()):
            want = _expected(name, tensors, used)
            if want is None:
                if name in SHARED:
                    report["shared"].append(name)
                elif name.endswith(OPTIONAL):
                    report["optional"].append(name)
                else:
                    report["missing"].append(name)
                continue
            got = param.detach().float()
            if torch.isnan(got).any():
                report["missing"].append(name)
            elif tuple(got.shape) != tuple(want.shape) or not torch.equal(got, want):
                report["mismatched"].append(f"{name}: {tuple(got.shape)} vs export {tuple(want.shape)}")
            else:
                report["checked"] += 1
        report["left_over"] = sorted(set(tensors) - used)
    except Exception as err:  # noqa: BLE001 - reported, the caller asserts on it
        report["error"] = f"{type(err).__name__}: {err}\n{traceback.format_exc()[-1500:]}"
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="the target's Hugging Face directory")
    parser.add_argument("--out", type=Path, required=True, help="the JSON report to write")
    parser.add_argument("drafters", type=Path, nargs="+", help="exported drafter directories")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    reports = [check(args.target, d) for d in args.drafters]
    args.out.write_text(json.dumps(reports, indent=1) + "\n")
    strict = all(not (r["missing"] or r["left_over"] or r["mismatched"] or r["error"]) for r in reports)
    return 0 if strict else 1


if __name__ == "__main__":
    sys.exit(main())
