"""Make the tiny exported drafter that the reference-parity goldens are recorded from (project env, JAX).

    .venv/bin/python tools/export_fixture.py --out tests/golden/export

A 2-layer drafter for the tiny Llama target `tests/golden/tiny/llama3_scaled_untied` (hidden 64, 4 heads /
2 kv heads, head_dim 16, llama3 RoPE scaling: so the export's rope fields matter), target layer ids (1, 2),
K = 4, mask id 255, random weights with every RMSNorm weight perturbed (a loader that drops a norm cannot
match). It is saved as a `dflash train` checkpoint (train.checkpoint.Checkpointer, Orbax) in a temporary
run dir and exported from there by `dflash-export` (export.run.export_run), as a user would:

- `<out>/zlab/config.json`, `<out>/zlab/model.safetensors`: the z-lab layout, float32;
- `<out>/speculators/config.json`: the speculators layout's config (its model.safetensors is the z-lab one
  byte for byte, which tests/test_export_parity.py checks, so it is not stored twice).

Then record the reference outputs in the torch environment (see tools/golden_zlab.py and
tools/golden_speculators.py). Rerun all three after a change of either layout.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGET = "tests/golden/tiny/llama3_scaled_untied"
VERIFIER = "golden/tiny/llama3_scaled_untied"
SEED = 2026


def build_drafter():
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dflash.models.config import DrafterConfig
    from dflash.models.drafter import DFlashDrafter, resolve_drafter
    from dflash.models.loading import load_hf_dir

    target_cfg, _ = load_hf_dir(ROOT / TARGET)
    arch = resolve_drafter(DrafterConfig(num_layers=2, num_features=2, layer_ids=(1, 2), block_size=4,
                                         mask_token_id=255), target_cfg)
    drafter = DFlashDrafter(arch, nnx.Rngs(SEED))
    rng = np.random.default_rng(SEED)
    flat = []
    for keys, variable in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
        if str(keys[-1]) == "weight":  # RMSNorm weights: 1 + N(0, 0.1)
            value = 1.0 + 0.1 * rng.standard_normal(variable.shape)
            variable = variable.replace(jnp.asarray(value, jnp.float32))
        flat.append((keys, variable))
    nnx.update(drafter, nnx.from_flat_state(flat))
    return drafter, target_cfg


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "golden" / "export")
    args = parser.parse_args()

    import jax
    from flax import nnx

    from dflash.export.run import export_run
    from dflash.train.checkpoint import Checkpointer
    from dflash.train.loop import arch_dict
    from dflash.train.step import init_state, make_optimizer

    drafter, _ = build_drafter()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "fixture_run"
        state = init_state(nnx.state(drafter, nnx.Param), make_optimizer(1e-3, 10), jax.random.PRNGKey(0))
        ckpt = Checkpointer(run_dir / "checkpoints", {"arch": arch_dict(drafter.arch)})
        ckpt.save(1, state, {"iterator": {"next_index": 1}})
        ckpt.close()
        for fmt in ("zlab", "speculators"):
            export_run(run_dir, fmt=fmt, out=Path(tmp) / fmt, target=VERIFIER)
        for fmt, names in (("zlab", ("config.json", "model.safetensors")), ("speculators", ("config.json",))):
            (args.out / fmt).mkdir(parents=True, exist_ok=True)
            for name in names:
                shutil.copyfile(Path(tmp) / fmt / name, args.out / fmt / name)
    print(f"wrote {args.out}/zlab and {args.out}/speculators")
    return 0


if __name__ == "__main__":
    sys.exit(main())
