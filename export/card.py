"""The model card (`README.md`) of an exported drafter: what it drafts for, how it was trained, how well it
did under `dflash eval`, and the lines that serve it in vLLM, SGLang and transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash.eval.report import SCHEMA, headline_line
from dflash.models.drafter import DrafterArch
from dflash.models.drafter_io import RunDrafter

# Hub ids of the targets a recipe can name without one (`target.source`).
KNOWN_TARGETS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def target_id(source: str | None) -> str | None:
    """The Hugging Face id of a recipe's `target.source`: the known name, the `_name_or_path` an HF
    directory's config.json records when it looks like `org/name`, else None (unknown)."""
    if not source:
        return None
    if source in KNOWN_TARGETS:
        return KNOWN_TARGETS[source]
    config = Path(source).expanduser() / "config.json"
    if config.is_file():
        name = str(json.loads(config.read_text()).get("_name_or_path") or "")
        if name.count("/") == 1 and not name.startswith(("/", ".")):
            return name
    return None


def find_results(run_dir: Path) -> Path | None:
    """The newest `dflash eval` results.json (schema dflash-eval/1) under the run dir (`<run_dir>/eval*/`)."""
    found = []
    for path in run_dir.glob("eval*/results.json"):
        try:
            if json.loads(path.read_text()).get("schema") == SCHEMA:
                found.append(path)
        except (OSError, json.JSONDecodeError):
            continue
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def best_results(best: Path, step: int | None) -> Path | None:
    """The `dflash eval` results kept inside a best/ drafter (`eval.run.BEST_RESULTS`) when they evaluated that
    drafter (their recorded best step is `step`), else None."""
    from dflash.eval.run import BEST_RESULTS

    path = Path(best) / BEST_RESULTS
    try:
        results = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    evaluated = (results.get("drafter") or {}).get("best_step")
    return path if results.get("schema") == SCHEMA and step is not None and evaluated == step else None


def read_results(path: Path) -> dict[str, Any]:
    """A results.json of `dflash eval`; ValueError unless it carries schema dflash-eval/1."""
    try:
        results = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--results {path} is not a readable results.json ({err})") from err
    if results.get("schema") != SCHEMA:
        raise ValueError(f"--results {path} must be a `dflash eval` results.json (schema {SCHEMA!r}); received "
                         f"schema {results.get('schema')!r}")
    return results


def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def template_text(kwargs: dict[str, Any] | None) -> str:
    """How the card names a chat template's variables: the JSON object, or the template's defaults."""
    return f"`{json.dumps(kwargs)}`" if kwargs else "none (the template's defaults)"


def _eval_section(results: dict[str, Any] | None, source: str | None) -> list[str]:
    lines = ["## Evaluation", ""]
    if results is None:
        return lines + ["No `dflash eval` results were given or found in the run dir; `dflash eval --drafter RUN_DIR` "
                        "measures τ and speed against the served engine, and `dflash-export --results` puts them here.",
                        ""]
    s = results.get("settings", {})
    mismatches = results["headline"].get("mismatches")
    engine = (results.get("engine") or {}).get("dflash", "dflash")
    served = "the bundled JAX engine" if engine == "dflash" else f"{engine} serving this drafter"
    lines += [f"`dflash eval` against {served} ({source}): **{headline_line(results)}**; greedy replies "
              f"differing from AR decoding: {mismatches}. Sets {', '.join(s.get('sets', []))}, {s.get('limit')} items "
              f"each, {s.get('max_new_tokens')} new tokens per turn, on "
              f"{results.get('environment', {}).get('machine', '?')}; chat template variables "
              f"{template_text(s.get('chat_template_kwargs'))}.", "",
              "| set | τ (accepted + 1 per step) | speedup | DFlash tok/s | AR tok/s | differ from AR |",
              "|---|---|---|---|---|---|"]
    for name, r in results.get("sets", {}).items():
        lines.append(f"| {name} | {_fmt(r.get('tau'))} | {_fmt(r.get('speedup'), '.2f', 'x')} | "
                     f"{_fmt(r.get('dflash', {}).get('tok_s'), '.1f')} | {_fmt(r.get('ar', {}).get('tok_s'), '.1f')} | "
                     f"{r.get('mismatches')} |")
    return lines + [""]


def _loss(train: dict[str, Any]) -> str:
    """`train.loss` and its weighting; a recipe from before `train.weighting` named the weighting in `loss`."""
    loss, weighting = str(train.get("loss", "ce")), train.get("weighting")
    if weighting is None and loss in ("decay", "dpace"):
        loss, weighting = "ce", loss
    return f"{loss} weighted {weighting or 'decay'}"


def _packed(pack: Any) -> str:
    return f" packed end to end into rows of {pack}" if pack else ""


def _examples(max_examples: object) -> str:
    return "every example" if not max_examples else f"up to {max_examples} examples"


def _chosen(record: dict[str, Any] | None) -> list[str]:
    """The line saying how a best/ drafter was chosen (its best.json), or none."""
    if not record or "tau" not in record:
        return []
    setup = record.get("eval") or {}
    sets = ", ".join(f"{k} {v:.2f}" for k, v in (record.get("tau_per_set") or {}).items())
    variables = template_text(setup.get("template_kwargs"))
    how = (f" on {setup.get('per_set')} prompts of each of {', '.join(setup.get('sets', []))} (first turns, greedy, "
           f"{setup.get('new_tokens')} new tokens), chat template variables {variables}"
           if setup else " (its prompts were not recorded)")
    return [f"- Chosen: real τ {record['tau']:.2f} ({sets}) decoded by the bundled engine during training{how}."]


def _training_section(meta: dict[str, Any] | None, step: int | None, best: bool,
                      best_record: dict[str, Any] | None = None) -> list[str]:
    lines = ["## Training", ""]
    which = f"step {step}" + (" (the best drafter by real τ during training)" if best else "")
    if not meta or "recipe" not in meta:
        return lines + [f"Exported from {which}; the run's recipe was not found (no checkpoint left).",
                        *_chosen(best_record), ""]
    recipe = meta["recipe"]
    train, data, target = recipe.get("train", {}), recipe.get("data", {}), recipe.get("target", {})
    lines += [f"- Exported: {which} of `train.steps={train.get('steps')}`, trained with dflash-tpu (JAX, Orbax "
              "checkpoints), the target frozen.",
              f"- Target: `{target.get('source')}` ({target.get('dtype')}), fingerprint "
              f"`{str(meta.get('target_fingerprint', '?'))[:16]}`.",
              f"- Recipe: batch {train.get('batch_size')}, {train.get('num_anchors')} anchors per sequence, AdamW lr "
              f"{train.get('lr')} (cosine, warmup {train.get('warmup_frac')}), clip {train.get('clip')}, weight decay "
              f"{train.get('weight_decay')}, loss {_loss(train)} (γ {train.get('gamma')}, 0 = by K), "
              f"compute {train.get('compute_dtype')}, seed {train.get('seed')}.",
              f"- Data: `{data.get('source')}` (prompts `{data.get('prompts')}`), sequences of {data.get('seq_len')} "
              f"tokens{_packed(data.get('pack'))}, {_examples(data.get('max_examples'))}, target features computed "
              f"{data.get('features')}.",
              f"- Chat template variables of the training answers (`data.regen.template_kwargs`): "
              f"{template_text(data.get('regen', {}).get('template_kwargs'))}.",
              *_chosen(best_record),
              ""]
    return lines


def render_card(run: RunDrafter, *, fmt: str, dtype: str, target: str | None, model_ref: str,
                results: dict[str, Any] | None, results_source: str | None, param_count: int,
                has_modeling_file: bool) -> str:
    """The README.md of an export of `run` (its drafter's architecture, step, checkpoint meta, and for a best/
    drafter its best.json: how it was chosen). `model_ref` is how users point at it (the Hub repo, or the
    directory)."""
    arch: DrafterArch = run.drafter.arch
    step, best, meta, best_record = run.step, run.source.name == "best", run.meta, run.best
    k = arch.block_size
    target_name = target or "<target model>"
    layout = ("z-lab layout (what vLLM `method: dflash`, SGLang `DFLASH` and z-lab's `DFlashDraftModel` load)"
              if fmt == "zlab" else "speculators layout (vllm-project/speculators `DFlashSpeculatorConfig`)")
    front = ["---", "tags:", "- dflash", "- speculative-decoding", "- block-diffusion", "- draft-model"]
    if target:
        front += [f"base_model: {target}"]
    front += ["---", ""]
    ids = list(arch.layer_ids)
    lines = front + [
        f"# DFlash drafter for {target_name}", "",
        f"A DFlash block-diffusion drafter: one forward pass over `[last token, MASK x {k - 1}]` proposes {k - 1} "
        f"draft tokens, conditioned on hidden states of the target **{target_name}**, which verifies them losslessly. "
        f"Exported by `dflash-export` in the {layout}; weights in {dtype}.", "",
        "| field | value |", "|---|---|",
        f"| drafter layers | {arch.num_layers} (Qwen3-style: q/k RMSNorm, no biases, SwiGLU) |",
        f"| hidden size (= the target's) | {arch.hidden_size} |",
        f"| heads / kv heads / head dim | {arch.num_heads} / {arch.num_kv_heads} / {arch.head_dim} |",
        f"| MLP size | {arch.intermediate_size} |",
        f"| target layers (`target_layer_ids`) | {ids} of {arch.target_num_layers} |",
        f"| block size K | {k} ({k - 1} draft tokens per step) |",
        f"| mask token id | {arch.mask_token_id} |",
        f"| parameters | {param_count:,} (no embedding, no LM head: the target's are used) |", "",
        "Layer id j is the output of target decoder layer j (0-based), i.e. Hugging Face `hidden_states[j+1]`"
        + (f"; the speculators config counts the same layers as `aux_hidden_state_layer_ids` "
           f"{[j + 1 for j in ids]} (index 0 = the embedding output)." if fmt == "speculators" else "."), "",
    ]
    lines += _training_section(meta, step, best, best_record)
    lines += _eval_section(results, results_source)
    spec = json.dumps({"method": "dflash", "model": model_ref, "num_speculative_tokens": k - 1})
    lines += ["## Serving", "", "vLLM:", "", "```bash", f"vllm serve {target_name} --speculative-config '{spec}'",
              "```", ""]
    if fmt == "speculators":
        lines += ["or, with the verifier named in config.json:", "", "```bash", f"vllm serve {model_ref}", "```", "",
                  "SGLang loads the z-lab layout: export it with `dflash-export --format zlab`.", ""]
    else:
        lines += ["SGLang (counts the K block tokens):", "", "```bash",
                  f"python -m sglang.launch_server --model-path {target_name} --speculative-algorithm DFLASH \\",
                  f"    --speculative-draft-model-path {model_ref} --speculative-num-draft-tokens {k}", "```", ""]
        if has_modeling_file:
            lines += ["transformers (z-lab's `DFlashDraftModel`, shipped here as `dflash.py`):", "", "```python",
                      "from transformers import AutoModel", "",
                      f'draft = AutoModel.from_pretrained("{model_ref}", trust_remote_code=True, dtype="auto").eval()',
                      "output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=256, "
                      "temperature=0.0, stop_token_ids=[tokenizer.eos_token_id])", "```", ""]
        else:
            lines += ["transformers: config.json's `auto_map` names `dflash.DFlashDraftModel`; put z-lab's modelling "
                      "file beside the weights as `dflash.py` (`dflash-export --modeling-file`) to load it with "
                      "`trust_remote_code=True`.", ""]
    lines += ["The bundled JAX engine: `dflash serve --drafter DIR` (this directory, downloaded).", ""]
    return "\n".join(lines)


__all__ = ["KNOWN_TARGETS", "best_results", "find_results", "read_results", "render_card", "target_id",
           "template_text"]
