"""speculators' own PyTorch model of an exported drafter (speculators layout: `dflash`, `dflash2`, sliding-window
layers) computing draft logits from given target features: what `bin/test --engines` compares ours with.

Runs in the engines environment (.venv-engines: speculators 0.9.0, torch, transformers), never the project's .venv:

    .venv-engines/bin/python tools/engines/speculators_logits.py --drafter DIR --inputs IN.npz --out OUT.npz

The model is built from DIR/config.json (`DFlashSpeculatorConfig` / `DFlash2SpeculatorConfig.from_pretrained`, eager
attention, float32) and DIR/model.safetensors is loaded strictly: only the tensors the verifier fills at training
time (embedding, LM head, verifier norm and head, vocabulary maps) may be missing, and they are set from IN.npz's
`embed` [V, D] and `lm_head` [V, D] (the target's). IN.npz also holds `feats` [1, T, F*D] (the target's features at
the drafter's layers) and `input_ids` [1, T], and `anchors` (how many blocks). speculators has no inference loop:
its training forward (`_backbone_forward`) draws the anchors itself (torch seeded with `seed`), builds each block
`[x_a, MASK...]` at positions a..a+K-1 seeing the context strictly before a, and returns the normed hidden states and
the unary logits through `lm_head`. For `dflash2` the candidate selector then ranks each slot's top-k unary
candidates after its predecessor token (`CandidateSelector.select`, the teacher-forced predecessors of its training
forward).

OUT.npz: `anchors` int64 [N], `hidden` [1, N*K, D], `logits` [1, N*K, V]; for dflash2 also `predecessor_ids` int64
[1, N*K], `candidate_ids` int64 [1, N*K, top_k], `candidate_scores` [1, N*K, top_k]; `meta_json` (versions, model
class, the tensors loaded).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from pathlib import Path

import numpy as np

VERIFIER_FILLED = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight", "t2d",
                   "d2t"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", type=Path, required=True, help="an export in the speculators layout")
    parser.add_argument("--inputs", type=Path, required=True, help="feats, input_ids, embed, lm_head, anchors (.npz)")
    parser.add_argument("--out", type=Path, required=True, help="the .npz to write")
    parser.add_argument("--seed", type=int, default=0, help="torch's seed (speculators draws the anchors)")
    args = parser.parse_args()

    import torch
    from safetensors.torch import load_file

    raw = json.loads((args.drafter / "config.json").read_text())
    kind = raw["speculators_model_type"]
    if kind == "dflash2":
        from speculators.models.dflash2 import DFlash2DraftModel as DraftModel
        from speculators.models.dflash2 import DFlash2SpeculatorConfig as SpeculatorConfig
    else:
        from speculators.models.dflash import DFlashDraftModel as DraftModel
        from speculators.models.dflash import DFlashSpeculatorConfig as SpeculatorConfig

    torch.manual_seed(args.seed)
    inputs = np.load(args.inputs)
    config = SpeculatorConfig.from_pretrained(str(args.drafter))
    config.transformer_layer_config._attn_implementation = "eager"
    model = DraftModel(config).float().eval()
    tensors = load_file(str(args.drafter / "model.safetensors"))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    if unexpected or set(missing) - VERIFIER_FILLED:
        raise SystemExit(f"{args.drafter} does not load into speculators' {type(model).__name__}: missing "
                         f"{sorted(set(missing) - VERIFIER_FILLED)}, unexpected {sorted(unexpected)}")
    embed, head = torch.from_numpy(inputs["embed"]), torch.from_numpy(inputs["lm_head"])
    feats, input_ids = torch.from_numpy(inputs["feats"]), torch.from_numpy(inputs["input_ids"]).long()
    length, anchors = input_ids.shape[1], int(inputs["anchors"])
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
        if getattr(model, "verifier_lm_head", None) is not None:
            model.verifier_lm_head.weight.copy_(head)
        if getattr(model, "verifier_norm", None) is not None:
            model.verifier_norm.weight.fill_(1.0)
        hidden, logits, _, _, indices = model._backbone_forward(
            feats, input_ids, torch.ones(1, length, dtype=torch.long), torch.zeros(1, length, embed.shape[1]),
            torch.zeros(1, length, dtype=torch.long), max_anchors=anchors)
        out = {"anchors": indices.view(-1, model.block_size)[:, 0].numpy().astype(np.int64),
               "hidden": hidden.numpy().astype(np.float32), "logits": logits.numpy().astype(np.float32)}
        if kind == "dflash2":
            predecessors = model._predecessor_ids(input_ids, indices).reshape(1, -1)
            ids, scores = model.candidate_selector.select(logits, hidden, predecessors)
            out.update(predecessor_ids=predecessors.numpy().astype(np.int64),
                       candidate_ids=ids.numpy().astype(np.int64), candidate_scores=scores.numpy().astype(np.float32))
    meta = {"generator": "tools/engines/speculators_logits.py", "model_class": type(model).__name__,
            "speculators": importlib.metadata.version("speculators"), "torch": torch.__version__,
            "loaded": sorted(tensors), "seed": args.seed}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(args.out, meta_json=np.asarray(json.dumps(meta)), **out)
    print(f"wrote {args.out}: {type(model).__name__}, anchors {out['anchors'].tolist()}, logits "
          f"{tuple(out['logits'].shape)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
