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

With `--kind dflash2` or `--kind sliding`, the same 2-layer drafter in one of the newer layouts, as
`<out>/zlab_<kind>/` and `<out>/speculators_<kind>/config.json` (its tensors again the z-lab ones byte for byte),
recorded by tools/golden_zlab.py (z-lab's DFlash2-era model.py) and tools/golden_speculators.py (speculators 0.9.0,
which has `dflash2` and sliding-window layers):

- `dflash2`: `drafter.variant: dflash2` with its convolution on, every base kernel and kernel projection drawn at
  random (nonzero, so the convolutions are not the identity); exported as `DFlash2DraftModel` with the zero
  candidate selector (docs/decisions.md D49);
- `sliding`: DFlash v1 with `layer_types [full_attention, sliding_attention]`, `sliding_window` 8 (= 2K, so that
  windows W-1-i >= K can reproduce z-lab's per-query window row by row, see tests/test_export_parity.py).

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
KINDS = ("dflash", "dflash2", "sliding")
SLIDING_WINDOW = 8


def build_drafter(kind: str = "dflash"):
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dflash.models.config import DrafterConfig
    from dflash.models.drafter import DFlashDrafter, resolve_drafter
    from dflash.models.loading import load_hf_dir

    target_cfg, _ = load_hf_dir(ROOT / TARGET)
    extra = {"dflash": {}, "dflash2": {"variant": "dflash2"},
             "sliding": {"layer_types": ("full_attention", "sliding_attention"), "sliding_window": SLIDING_WINDOW}}
    arch = resolve_drafter(DrafterConfig(num_layers=2, num_features=2, layer_ids=(1, 2), block_size=4,
                                         mask_token_id=255, **extra[kind]), target_cfg)
    drafter = DFlashDrafter(arch, nnx.Rngs(SEED))
    rng = np.random.default_rng(SEED)
    flat = []
    for keys, variable in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
        name = str(keys[-1])
        if name == "weight":  # RMSNorm weights: 1 + N(0, 0.1)
            value = 1.0 + 0.1 * rng.standard_normal(variable.shape)
            variable = variable.replace(jnp.asarray(value, jnp.float32))
        elif name == "base_kernel":  # DFlash2's static kernels: identity + N(0, 0.3)
            value = np.asarray(variable.get_value()) + 0.3 * rng.standard_normal(variable.shape)
            variable = variable.replace(jnp.asarray(value, jnp.float32))
        elif "kernel_projection" in map(str, keys):  # its dynamic-kernel projections (zero at init): N(0, 0.05)
            variable = variable.replace(jnp.asarray(0.05 * rng.standard_normal(variable.shape), jnp.float32))
        flat.append((keys, variable))
    nnx.update(drafter, nnx.from_flat_state(flat))
    return drafter, target_cfg


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "golden" / "export")
    parser.add_argument("--kind", choices=KINDS, default="dflash", help="which drafter (see above)")
    args = parser.parse_args()

    import jax
    from flax import nnx

    from dflash.export.run import ExportFor, ExportLayout, export_run
    from dflash.train.checkpoint import Checkpointer
    from dflash.train.loop import arch_dict
    from dflash.train.step import init_state, make_optimizer

    drafter, _ = build_drafter(args.kind)
    layouts = {"zlab": ("config.json", "model.safetensors"), "speculators": ("config.json",)}
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "fixture_run"
        state = init_state(nnx.state(drafter, nnx.Param), make_optimizer(1e-3, 10), jax.random.PRNGKey(0))
        ckpt = Checkpointer(run_dir / "checkpoints", {"arch": arch_dict(drafter.arch)})
        ckpt.save(1, state, {"iterator": {"next_index": 1}})
        ckpt.close()
        for fmt, names in layouts.items():
            export_run(run_dir, ExportLayout(fmt), out=Path(tmp) / fmt, export_for=ExportFor(target=VERIFIER))
            directory = args.out / (fmt if args.kind == "dflash" else f"{fmt}_{args.kind}")
            directory.mkdir(parents=True, exist_ok=True)
            for name in names:
                shutil.copyfile(Path(tmp) / fmt / name, directory / name)
            print(f"wrote {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
