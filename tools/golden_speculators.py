"""Reference outputs of an exported speculators-layout drafter from speculators' own torch `DFlashDraftModel`
(or `DFlash2DraftModel` for a `dflash2` config).

Run in an environment with speculators (vllm-project/speculators 0.9.0: it needs transformers >= 5) --
never the project's runtime env. The engines environment has it (`bin/setup-engines`, then
`.venv-engines/bin/python tools/golden_speculators.py ...`). Its full dependency set pins a CUDA torch and
torchvision/torchaudio (several GB of CUDA wheels); by hand on a CPU machine, install the CPU torch first and
speculators' Python dependencies without them, as tests/golden/export/MANIFEST.json records for the first goldens:

    python3.11 -m venv /tmp/specenv
    /tmp/specenv/bin/pip install torch transformers==5.19.0 safetensors numpy pydantic pydantic-settings \\
        loguru rich typer click httpx psutil protobuf openai datasets==5.1.0
    /tmp/specenv/bin/pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0
    /tmp/specenv/bin/python tools/golden_speculators.py --config tests/golden/export/speculators \\
        --weights tests/golden/export/zlab/model.safetensors --out tests/golden/export/speculators_reference.npz

The model is built by speculators from the exported config.json (`DFlashSpeculatorConfig.from_pretrained`),
the weights loaded with `load_state_dict` (the speculators layout's model.safetensors is the z-lab one byte
for byte): every tensor must land (only the verifier-filled embed_tokens / lm_head / verifier_* may be
missing). speculators has no inference loop of its own, so what is recorded is its TRAINING forward
(`_backbone_forward`, eager attention): N anchored blocks over one packed sequence, each block seeing the
context strictly before its anchor and its own block -- the same computation as our `DFlashDrafter.__call__`
with `BlockVisibility.from_anchors`.

Recorded (seeded; float32 unless noted): `feats` [1, T, F*D] (aux hidden states), `input_ids` int64 [1, T],
`embed` [V, D] (the embedding table used for the block tokens), `anchors` int64 [N], `block_ids` int64 [N*K],
`hidden` [1, N*K, D] (normed drafter output), `meta_json` (versions, the config; with --length, `weights_sha256`
of the weights file).

The DFlash2 and sliding-window goldens (speculators_dflash2_reference.npz, speculators_sliding_reference.npz) use
`--length 40` (so that anchors fall past the sliding window W = 8) and the z-lab weights of the same export
(tests/golden/export/zlab_<kind>/model.safetensors). speculators' sliding layers use the block-level window
(context s >= anchor - W, `create_anchor_block_mask_mod`), as ours do: they compare exactly.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file

T, ANCHORS, SEED = 24, 4, 11
VERIFIER_FILLED = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight", "t2d",
                   "d2t"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True, help="directory of the speculators config.json")
    parser.add_argument("--weights", type=Path, required=True, help="the model.safetensors of the export")
    parser.add_argument("--out", type=Path, required=True, help="the .npz to write")
    parser.add_argument("--length", type=int, default=T, help="positions of the packed sequence")
    args = parser.parse_args()
    length = args.length

    raw = json.loads((args.config / "config.json").read_text())
    if raw["speculators_model_type"] == "dflash2":
        from speculators.models.dflash2 import DFlash2DraftModel as DraftModel
        from speculators.models.dflash2 import DFlash2SpeculatorConfig as SpeculatorConfig
    else:
        from speculators.models.dflash import DFlashDraftModel as DraftModel
        from speculators.models.dflash import DFlashSpeculatorConfig as SpeculatorConfig

    torch.manual_seed(SEED)
    config = SpeculatorConfig.from_pretrained(str(args.config))
    config.transformer_layer_config._attn_implementation = "eager"
    model = DraftModel(config).float().eval()
    missing, unexpected = model.load_state_dict(load_file(str(args.weights)), strict=False)
    if unexpected or set(missing) - VERIFIER_FILLED:
        raise SystemExit(f"the export does not load into speculators' DFlashDraftModel: missing "
                         f"{sorted(set(missing) - VERIFIER_FILLED)}, unexpected {unexpected}")
    tl = config.transformer_layer_config
    k, d, f, vocab = model.block_size, tl.hidden_size, len(model.target_layer_ids), tl.vocab_size

    rng = np.random.default_rng(SEED)
    feats = rng.standard_normal((1, length, f * d)).astype(np.float32)
    input_ids = rng.integers(0, vocab - 1, size=(1, length)).astype(np.int64)
    embed = (0.5 * rng.standard_normal((vocab, d))).astype(np.float32)
    last = rng.standard_normal((1, length, d)).astype(np.float32)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.from_numpy(embed))
        hidden, _, _, _, indices = model._backbone_forward(
            torch.from_numpy(feats), torch.from_numpy(input_ids), torch.ones(1, length, dtype=torch.long),
            torch.from_numpy(last), torch.zeros(1, length, dtype=torch.long), max_anchors=ANCHORS)
    anchors = indices.view(-1, k)[:, 0].numpy()
    block_ids = np.full(ANCHORS * k, config.mask_token_id, np.int64)
    block_ids[::k] = input_ids[0, anchors]

    meta = {"generator": "tools/golden_speculators.py", "torch": torch.__version__,
            "transformers": transformers.__version__, "speculators": importlib.metadata.version("speculators"),
            "numpy": np.__version__, "seed": SEED, "attn_implementation": "eager", "config": raw}
    if length != T:  # the original golden's meta is kept as it was recorded
        meta.update(length=length, weights_sha256=hashlib.sha256(args.weights.read_bytes()).hexdigest())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, feats=feats, input_ids=input_ids, embed=embed, anchors=anchors.astype(np.int64),
                        block_ids=block_ids, hidden=hidden.numpy().astype(np.float32),
                        meta_json=np.asarray(json.dumps(meta)))
    print(f"wrote {args.out}: anchors {anchors.tolist()}, hidden {tuple(hidden.shape)}, "
          f"|hidden| mean {hidden.abs().mean().item():.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
