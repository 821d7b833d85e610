"""Package a `dflash data regenerate` output as a training set shipped in the repo (data/assets/regenerated).

    .venv/bin/python tools/package_regenerated.py runs/smollm2/data/regenerated.jsonl \
        data/assets/regenerated/smollm2-mix.jsonl.xz --name smollm2_mix --recipe smollm2 \
        [data.max_prompts=2400 ...]

Writes NAME.jsonl.xz (the records sorted by id, so the file does not depend on the order replies finished in;
xz preset 9) and NAME.meta.json beside it: the producing command (`dflash data regenerate --config RECIPE`),
the regeneration settings and tokenizer fingerprint (from the output's .meta.json), counts per source,
tokens, and the sha256 of both the uncompressed sorted JSONL and the .xz file. Only the ids of the
recipe's prompt mix are kept (an output directory reused across settings may hold others); overrides
(`section.key=value`, as given to `dflash data regenerate`) change the recipe's mix the same way.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import lzma
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash.configs.recipe import load_recipe  # noqa: E402
from dflash.data.config import DataConfig  # noqa: E402
from dflash.data.sources import mix, parse_mix  # noqa: E402


def mix_ids(cfg: DataConfig) -> set[str]:
    """The item ids of a recipe's prompt mix (what `dflash data regenerate` answers with that data section)."""
    spec = dataclasses.replace(parse_mix(cfg.prompts), max_prompts=cfg.max_prompts, dedup=cfg.dedup, seed=cfg.seed)
    return {item["id"] for item in mix(spec)[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a regenerated.jsonl written by `dflash data regenerate`")
    parser.add_argument("out", type=Path, help="the .jsonl.xz to write")
    parser.add_argument("--name", required=True, help="the set's name (data.source value)")
    parser.add_argument("--recipe", required=True, help="the recipe whose `dflash data regenerate` produced SOURCE")
    parser.add_argument("overrides", nargs="*", help="the section.key=value overrides that regeneration was given")
    args = parser.parse_intermixed_args()
    if args.out.suffixes[-2:] != [".jsonl", ".xz"]:
        parser.error(f"out must end in .jsonl.xz; received {args.out}")
    meta_in = args.source.with_name(args.source.name + ".meta.json")
    if not args.source.is_file() or not meta_in.is_file():
        parser.error(f"source must be a regenerate output with its .meta.json; missing {args.source} or {meta_in}")
    data = args.source.read_bytes()
    records = [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines() if line.strip()]
    data_cfg = load_recipe(args.recipe, args.overrides).data
    wanted = mix_ids(data_cfg)
    dropped = sum(r["id"] not in wanted for r in records)
    records = sorted((r for r in records if r["id"] in wanted), key=lambda r: r["id"])
    text = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records).encode()
    packed = lzma.compress(text, preset=9)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(packed)
    turns = [m for r in records for m in r["messages"] if m["role"] == "assistant"]
    meta = {
        "name": args.name,
        "command": " ".join(["dflash data regenerate --config", args.recipe, *args.overrides]),
        "prompts": f"data.prompts={data_cfg.prompts!r}, data.max_prompts={data_cfg.max_prompts}, "
                   f"data.seed={data_cfg.seed}",
        "records_not_in_the_mix_dropped": dropped,
        "regeneration": json.loads(meta_in.read_text()),
        "conversations": len(records),
        "assistant_turns": len(turns),
        "by_source": dict(sorted(collections.Counter(r["source"] for r in records).items())),
        "generated_tokens": sum(r.get("tokens", 0) for r in records),
        "finish_reasons": dict(collections.Counter(f for r in records for f in r.get("finish_reasons", []))),
        "jsonl_sha256": hashlib.sha256(text).hexdigest(),
        "xz_sha256": hashlib.sha256(packed).hexdigest(),
        "xz_bytes": len(packed),
    }
    meta_out = args.out.with_name(args.out.name.removesuffix(".jsonl.xz") + ".meta.json")
    meta_out.write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps(meta, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
