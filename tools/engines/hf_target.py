"""The embedded SmolLM2 target as a Hugging Face directory that vLLM loads: transformers dequantises the packaged GGUF
(Q4_1 -> float32, the same values our loader computes) and saves weights, config, tokenizer and chat template.

Runs in the engines environment (.venv-engines: torch, transformers, gguf), never the project's .venv:

    .venv-engines/bin/python tools/engines/hf_target.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf --out DIR

transformers records the GGUF's quantization in the config it loads; vLLM would then look for a quantized checkpoint,
so that entry (and the model's quantizer, which refuses to save) is dropped before saving: the weights saved are the
dequantised float32 ones. The directory is written beside DIR and renamed into place at the end, with
`dflash_source.json` naming the GGUF it came from.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True, help="the packaged GGUF file")
    parser.add_argument("--out", type=Path, required=True, help="the directory to write (replaced if present)")
    args = parser.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(args.gguf.parent), args.gguf.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model.hf_quantizer = None  # the weights are dequantised float32 tensors by now
    for config in (model.config, getattr(model, "generation_config", None)):
        if config is not None and hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
    tmp = args.out.with_name(f".{args.out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    saved = json.loads((tmp / "config.json").read_text())
    if "quantization_config" in saved:
        raise SystemExit(f"{tmp / 'config.json'} still holds a quantization_config; vLLM would refuse the weights")
    (tmp / "dflash_source.json").write_text(json.dumps(
        {"gguf": str(args.gguf), "size": args.gguf.stat().st_size, "transformers": transformers.__version__,
         "dtype": "float32"}, indent=2) + "\n")
    shutil.rmtree(args.out, ignore_errors=True)
    tmp.rename(args.out)
    print(f"wrote {args.out}: {saved['architectures']}, {saved['num_hidden_layers']} layers, "
          f"vocab {saved['vocab_size']}, float32")
    return 0


if __name__ == "__main__":
    sys.exit(main())
