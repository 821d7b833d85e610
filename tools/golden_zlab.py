"""Reference outputs of an exported z-lab-layout drafter from z-lab's own torch `DFlashDraftModel` /
`DFlash2DraftModel` (the class the config's `architectures` names).

Run in an environment with torch and transformers 4.57.1 (z-lab's pin) -- never the project's runtime env:

    python3.11 -m venv /tmp/goldenv && /tmp/goldenv/bin/pip install torch transformers==4.57.1 safetensors numpy
    git clone https://github.com/z-lab/dflash /tmp/zlab-dflash      # or any checkout of it
    /tmp/goldenv/bin/python tools/golden_zlab.py --zlab-model /tmp/zlab-dflash/dflash/model.py \\
        --drafter tests/golden/export/zlab --out tests/golden/export/zlab_reference.npz

z-lab's modelling file is imported from the path given (it is not part of this repository). The DFlash2 and
sliding-window goldens (`zlab_dflash2_reference.npz`, `zlab_sliding_reference.npz`) need a revision of it with
`DFlash2DraftModel` and `layer_types` / `is_causal` (tests/golden/export/MANIFEST.json names the one used and its
sha256); give `--target tests/golden/tiny/llama3_scaled_untied` for them. The drafter
directory is one `dflash-export --format zlab` wrote (tools/export_fixture.py makes the committed tiny one);
it is loaded with `DFlashDraftModel.from_pretrained` exactly as transformers' remote code would (fp32, eager
attention), and every tensor must be consumed (no missing, no unexpected keys).

Recorded (float32 unless noted), for fixed inputs drawn from a seeded numpy generator, B = 2 sequences:
- `ctx_feats` [B, S2, F*D]: target features (the concatenated layers' hidden states) of positions 0..S2-1;
- `block1` [B, K, D] and `block2` [B, K, D]: block input embeddings at positions S1.. and S2..;
- `hidden1` [B, K, D]: the drafter's output for block1 over the context 0..S1-1 (one forward, no cache);
- `hidden2` [B, K, D]: the output for block2 after the features of S1..S2-1 are added through the draft
  cache, as z-lab's `dflash_generate` does it (the cache cropped back to the committed length after step 1);
- `positions` int64 [3]: S1, S2, K. Plus `meta_json` (a JSON string): versions, the model file's sha256, the
  config and `tensors_sha256` (of the export's tensors: sorted names, dtypes, shapes and bytes).
With sliding-window layers, also `hidden1_full` / `hidden2_full`: the same model and weights with every layer
`full_attention` (what the window changes). With `--target` (DFlash2): `anchor_ids` int64 [B] and
`tokens1` / `tokens2` int64 [B, K-1], the reference's own proposal (`DFlash2DraftModel.propose`: the candidate
selector's greedy walk over the target's LM head, `dflash_generate`'s rows 1..K-1) for each step.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file

S1, S2, BATCH, SEED = 37, 70, 2, 7


def load_zlab_module(path: Path):
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tensors_sha256(path: Path) -> str:
    """sha256 over the tensors of a safetensors file: sorted names, dtype, shape and little-endian bytes."""
    digest = hashlib.sha256()
    for name, value in sorted(load_file(str(path)).items()):
        digest.update(f"{name}|{value.dtype.str}|{list(value.shape)}|".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()


def two_steps(model, ctx, block1, block2, position_ids):
    """One uncached forward (context 0..S1-1, block at S1) and dflash_generate's second step through the draft
    cache (step 1 as above, crop to S1: block K/V dropped; step 2 adds the features of S1..S2-1, block at S2)."""
    k = block1.shape[1]
    hidden1 = model(target_hidden=torch.from_numpy(ctx[:, :S1]), noise_embedding=torch.from_numpy(block1),
                    position_ids=position_ids[:, :S1 + k], is_causal=False)
    cache = transformers.DynamicCache()
    model(target_hidden=torch.from_numpy(ctx[:, :S1]), noise_embedding=torch.from_numpy(block1),
          position_ids=position_ids[:, :S1 + k], past_key_values=cache, use_cache=True, is_causal=False)
    cache.crop(S1)
    hidden2 = model(target_hidden=torch.from_numpy(ctx[:, S1:S2]), noise_embedding=torch.from_numpy(block2),
                    position_ids=position_ids[:, cache.get_seq_length():S2 + k], past_key_values=cache,
                    use_cache=True, is_causal=False)
    return hidden1.numpy().astype(np.float32), hidden2.numpy().astype(np.float32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zlab-model", type=Path, required=True, help="z-lab's dflash/model.py")
    parser.add_argument("--drafter", type=Path, required=True, help="a z-lab layout directory (dflash-export)")
    parser.add_argument("--out", type=Path, required=True, help="the .npz to write")
    parser.add_argument("--target", type=Path, help="the target's HF directory (its lm_head.weight drafts DFlash2)")
    args = parser.parse_args()

    torch.manual_seed(0)
    zlab = load_zlab_module(args.zlab_model)
    config = json.loads((args.drafter / "config.json").read_text())
    cls = getattr(zlab, config["architectures"][0])
    model, info = cls.from_pretrained(args.drafter, dtype=torch.float32, attn_implementation="eager",
                                      output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise SystemExit(f"the export does not load cleanly into z-lab's DFlashDraftModel: {bad}")
    model.eval()
    cfg = model.config
    k, d, f = model.block_size, cfg.hidden_size, len(model.target_layer_ids)

    rng = np.random.default_rng(SEED)
    ctx = rng.standard_normal((BATCH, S2, f * d)).astype(np.float32)
    block1 = (0.5 * rng.standard_normal((BATCH, k, d))).astype(np.float32)
    block2 = (0.5 * rng.standard_normal((BATCH, k, d))).astype(np.float32)
    position_ids = torch.arange(S2 + k).unsqueeze(0).expand(BATCH, -1)

    extra = {}
    with torch.inference_mode():
        hidden1, hidden2 = two_steps(model, ctx, block1, block2, position_ids)
        if "sliding_attention" in (config.get("layer_types") or []):
            # The same weights with every layer full: the reference's own measure of what the window changes.
            full_cfg = copy.deepcopy(model.config)
            full_cfg.layer_types = ["full_attention"] * full_cfg.num_hidden_layers
            full = cls(full_cfg).float().eval()
            full.load_state_dict(model.state_dict())
            extra["hidden1_full"], extra["hidden2_full"] = two_steps(full, ctx, block1, block2, position_ids)
        if args.target is not None:
            head = torch.nn.Linear(d, cfg.vocab_size, bias=False)
            head.weight.copy_(torch.from_numpy(load_file(str(args.target / "model.safetensors"))["lm_head.weight"]))
            anchor_ids = torch.from_numpy(rng.integers(0, cfg.vocab_size, size=BATCH).astype(np.int64))
            for step, hidden in (("tokens1", hidden1), ("tokens2", hidden2)):
                tokens, _, _ = model.propose(torch.from_numpy(hidden[:, 1:]), anchor_ids, head, 0.0)
                extra[step] = tokens.numpy().astype(np.int64)
            extra["anchor_ids"] = anchor_ids.numpy()

    meta = {"generator": "tools/golden_zlab.py", "torch": torch.__version__, "transformers": transformers.__version__,
            "numpy": np.__version__, "zlab_model_sha256": hashlib.sha256(args.zlab_model.read_bytes()).hexdigest(),
            "seed": SEED, "attn_implementation": "eager", "config": config,
            "tensors_sha256": tensors_sha256(args.drafter / "model.safetensors")}
    if args.target is not None:
        meta["target_lm_head_sha256"] = hashlib.sha256(
            np.ascontiguousarray(load_file(str(args.target / "model.safetensors"))["lm_head.weight"]).tobytes()
        ).hexdigest()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, ctx_feats=ctx, block1=block1, block2=block2, hidden1=hidden1, hidden2=hidden2,
                        positions=np.asarray([S1, S2, k], np.int64), meta_json=np.asarray(json.dumps(meta)), **extra)
    print(f"wrote {args.out}: hidden1 {hidden1.shape}, hidden2 {hidden2.shape}, |hidden| mean "
          f"{np.abs(hidden1).mean():.3f}, extra {sorted(extra)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
