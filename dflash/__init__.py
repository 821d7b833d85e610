"""dflash-tpu: distil DFlash block-diffusion drafters in JAX and serve them with a bundled speculative-decoding engine.

Subpackages, one concern each (docs/architecture.md): configs, models, serve, data, train, eval,
export, launch; below them all, `files` (durable writes, stdlib only)."""
