"""gpt-oss's harmony format in regeneration and training rows (data/harmony.py, D85).

The target is the golden tiny gpt-oss (tools/golden_families.py: sliding and full layers, sinks, YaRN, its MoE) with
its weights set so that it writes harmony replies, through the real engine: every layer's attention and MoE output
is zero except one head of full-attention layer 1, which raises a flag in the residual when the word `hmm` (the
analysis it writes) is anywhere in its context; the LM head maps each token to its successor, the flag choosing
between the two branches. So after `<|start|>assistant` it writes

    <|channel|>analysis<|message|>hmm so<|end|><|start|>assistant<|channel|>final<|message|>yes done<|return|>

and, when `hmm` is already in its context (e.g. a history that kept the analysis), the final message alone. The
tokenizer is word-level, over a vocabulary built here; the chat template is harmony's as its documentation writes it
(a template written for this test: the system message with the date and the reasoning effort, a system turn as the
developer message, the last assistant message rendered with its analysis and `<|return|>`, earlier ones as their
final answer closed by `<|end|>`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from dflash.data import harmony
from dflash.data.chat_tokens import harmony_rows, tokenize_conversation, tokenize_rows
from dflash.data.config import RegenConfig
from dflash.data.regen_store import read_regenerated
from dflash.models.tokenizer import ChatTokenizer, load_tokenizer_from_hf_dir

SPECIAL = ["<unk>", "<|endoftext|>", "<|return|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>",
           "<|constrain|>"]
WORDS = ["system", "developer", "user", "assistant", "analysis", "final", "commentary", "to", "=", "functions", ".",
         "json", "hmm", "so", "yes", "done", "What", "is", "two", "plus", "And", "three", "?", "Be", "brief",
         "2026", "-", "12", "06", "07"]
HARMONY_TEMPLATE = r"""{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n' }}
{{- 'Knowledge cutoff: 2024-06\nCurrent date: ' + strftime_now('%Y-%m-%d') + '\n\n' }}
{{- 'Reasoning: ' + (reasoning_effort | default('medium')) + '\n\n' }}
{{- '# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>' }}
{%- set turns = messages %}
{%- if messages and messages[0].role == 'system' %}
{{- '<|start|>developer<|message|># Instructions\n\n' + messages[0].content + '\n\n<|end|>' }}
{%- set turns = messages[1:] %}
{%- endif %}
{%- for m in turns %}
{%- if m.role == 'assistant' and loop.last and not add_generation_prompt %}
{%- if 'thinking' in m %}{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}{%- endif %}
{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|return|>' }}
{%- elif m.role == 'assistant' %}
{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}
{%- else %}
{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"""
DAY = "2026-12-06"
KWARGS = {"reasoning_effort": "low", "strftime_now": DAY}
REPLY = "<|channel|>analysis<|message|>hmm so<|end|><|start|>assistant<|channel|>final<|message|>yes done<|return|>"
FINAL_ONLY = "<|channel|>final<|message|>yes done<|return|>"
USER_1, USER_2 = "What is two plus two ?", "And three ?"
FLAG_DIM = 63  # the residual dimension layer 1 raises when `hmm` is in the context; tokens are one-hot below it


def _tokenizer_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIAL + WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>"}))
    (root / "chat_template.jinja").write_text(HARMONY_TEMPLATE)
    ids = {t: i for i, t in enumerate(SPECIAL)}  # gpt-oss's generation_config.json: <|return|>, <|endoftext|>, <|call|>
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids["<|return|>"], ids["<|endoftext|>"],
                                                                             ids["<|call|>"]]}))
    return root


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    return load_tokenizer_from_hf_dir(_tokenizer_dir(tmp_path_factory.mktemp("harmony_tok")))


def _ids(tok: ChatTokenizer, text: str) -> list[int]:
    return tok.encode(text)


def _prompt(tok: ChatTokenizer, messages: list[dict]) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, **KWARGS))


# ----------------------------------------------------------------------------- the format, without a model


def test_split_reply_takes_the_channels_apart(tok: ChatTokenizer) -> None:
    assert harmony.is_harmony(tok)
    assert harmony.split_reply(tok, _ids(tok, REPLY)) == {"role": "assistant", "thinking": "hmm so",
                                                           "content": "yes done"}
    assert harmony.split_reply(tok, _ids(tok, FINAL_ONLY)) == {"role": "assistant", "content": "yes done"}
    cut = _ids(tok, REPLY)[:-2]  # hit max_new_tokens inside the final channel: kept, the template closes it
    assert harmony.split_reply(tok, cut) == {"role": "assistant", "thinking": "hmm so", "content": "yes"}


@pytest.mark.parametrize("reply, why", [
    ("<|channel|>analysis<|message|>hmm so<|end|><|start|>assistant<|channel|>commentary to = functions . so "
     "<|constrain|>json<|message|>yes<|call|>", "headers must be"),
    ("<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>analysis<|message|>so<|end|>"
     "<|start|>assistant<|channel|>final<|message|>yes<|return|>", r"channels must be .*\['analysis', 'analysis', "),
    ("<|channel|>final<|message|>yes done<|endoftext|>", "must end with <\\|return\\|>"),
    ("<|channel|>final<|message|>yes done<|call|>", "must end with <\\|return\\|>"),
    ("<|channel|>analysis<|message|>hmm so", r"channels must be .*received \['analysis'\]"),
    ("<|channel|>analysis<|message|>hmm so<|end|><|start|>assistant<|channel|>fin", "must have a <\\|message\\|>"),
    ("<|channel|>analysis<|message|>hmm so<|end|>yes", "must be followed by <\\|start\\|>"),
    ("assistant<|channel|>final<|message|>yes<|return|>", "headers must be '<\\|channel\\|>NAME'"),
    ("<|channel|>final<|message|>yes<|channel|>done<|return|>",
     r"no harmony token in its content; received \['<\|channel"),
])
def test_split_reply_refuses_what_the_template_cannot_render(tok: ChatTokenizer, reply: str, why: str) -> None:
    with pytest.raises(harmony.FormatError, match=why):
        harmony.split_reply(tok, _ids(tok, reply))


def test_round_trip_and_history(tok: ChatTokenizer) -> None:
    """A reply renders back to the generated ids after its prompt; history drops each earlier turn's analysis."""
    first = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": USER_1}]
    prompt = _prompt(tok, first)
    generated = _ids(tok, REPLY)
    message = harmony.split_reply(tok, generated)
    harmony.round_trip(tok, first, prompt, message, generated, KWARGS)
    harmony.round_trip(tok, first, prompt, harmony.split_reply(tok, generated[:-2]), generated[:-2], KWARGS)
    with pytest.raises(harmony.FormatError,
                       match=r"differ at token \d+ of \d+ \('<\|return\|>' rendered, '<\|end\|>' generated\)"):
        harmony.round_trip(tok, first, prompt, message, generated[:-1] + [tok.encode("<|end|>")[0]], KWARGS)
    with pytest.raises(harmony.FormatError, match="differ"):  # another day's prompt is not the one the target saw
        harmony.round_trip(tok, first, prompt, message, generated, {**KWARGS, "strftime_now": "2026-12-07"})
    with pytest.raises(harmony.FormatError, match="template must render the reply; it failed: UndefinedError"):
        harmony.round_trip(tok, first, prompt, {"role": "assistant", "thinking": "hmm"}, generated, KWARGS)
    later = [*first, message, {"role": "user", "content": USER_2}]
    assert harmony.history(later)[2] == {"role": "assistant", "content": "yes done"}
    assert later[2]["thinking"] == "hmm so"  # not modified in place
    text = tok.apply_chat_template(harmony.history(later), **KWARGS)
    assert text.endswith("<|start|>user<|message|>What is two plus two ?<|end|><|start|>assistant<|channel|>final"
                         "<|message|>yes done<|end|><|start|>user<|message|>And three ?<|end|><|start|>assistant")
    assert f"Current date: {DAY}\n\nReasoning: low\n\n" in text


def test_reasoning_effort_and_a_pinned_date_are_checked(tok: ChatTokenizer) -> None:
    harmony.check_reasoning_effort({"reasoning_effort": "high"})
    harmony.check_reasoning_effort({})
    with pytest.raises(ValueError, match=r"data.regen.template_kwargs.reasoning_effort must be one of \['low', "
                                         r"'medium', 'high'\].*received 'max'"):
        harmony.check_reasoning_effort({"reasoning_effort": "max"})
    with pytest.raises(ValueError, match=r"strftime_now must be a date 'YYYY-MM-DD'.*received '12/06/2026'"):
        tok.apply_chat_template([{"role": "user", "content": USER_1}], strftime_now="12/06/2026")


def test_a_multi_turn_conversation_makes_a_row_per_turn(tok: ChatTokenizer) -> None:
    """Each row is the prompt its turn was answered from (earlier analysis dropped) then the reply, masked exactly;
    the whole conversation in one row is refused (the template rewrites earlier turns)."""
    reply = harmony.split_reply(tok, _ids(tok, REPLY))
    conversation = [{"role": "user", "content": USER_1}, reply, {"role": "user", "content": USER_2}, reply]
    rows, skipped = tokenize_rows(tok, [conversation], 256, template_kwargs=KWARGS)
    assert skipped == 0 and len(rows) == 2
    assert harmony_rows(conversation)[1][1] == {"role": "assistant", "content": "yes done"}
    for (tokens, mask, n), prompt in zip(rows, (_prompt(tok, conversation[:1]),
                                                _prompt(tok, harmony.history(conversation[:3]))), strict=True):
        generated = _ids(tok, REPLY)
        assert tokens[:n].tolist() == prompt + generated
        assert mask[:n].tolist() == [0.0] * len(prompt) + [1.0] * len(generated) and not mask[n:].any()
    with pytest.raises(ValueError, match="prefix"):
        tokenize_conversation(tok, conversation, 256, **KWARGS)


class _Scripted:
    """A regeneration backend answering each turn with the next scripted ids (a Reply as the engine's, or text only
    as a server's when `with_ids` is off)."""

    capacity = 1

    def __init__(self, tok: ChatTokenizer, replies: list[str], with_ids: bool = True):
        self.tok, self.replies, self.with_ids, self.pending = tok, list(replies), with_ids, []

    def submit(self, messages, prompt_ids, seed, turn):
        self.pending.append(turn)
        return turn

    def poll(self):
        from dflash.data.regenerate import Reply

        ids = _ids(self.tok, self.replies.pop(0))
        reason = "stop" if ids[-1] in self.tok.stop_token_ids else "length"
        handle = self.pending.pop()
        token_ids = tuple(ids) if self.with_ids else None
        return [(handle, Reply(self.tok.decode(ids), len(ids), reason, token_ids=token_ids))]


def test_a_later_reply_the_template_cannot_render_ends_the_conversation(tok: ChatTokenizer, tmp_path: Path) -> None:
    """Turn 1 round-trips and is kept; turn 2 calls a tool (`<|call|>`): the conversation ends after turn 1, the reason
    in the errors file; a first reply of that shape is the item's error; a backend without ids stops the run."""
    from dflash.data.regenerate import regenerate

    item = {"id": "a", "source": "t", "messages": [{"role": "user", "content": USER_1},
                                                   {"role": "user", "content": USER_2}]}
    call = "<|channel|>commentary to = functions . so <|constrain|>json<|message|>yes<|call|>"
    cfg = RegenConfig(template_kwargs=KWARGS)
    stats = regenerate(_Scripted(tok, [REPLY, call]), tok, [item], tmp_path / "r.jsonl", cfg, progress=False)
    assert (stats.succeeded, stats.turns, stats.turns_cut, stats.unrenderable, stats.errors) == (1, 1, 1, 1, 0)
    (record,) = map(json.loads, (tmp_path / "r.jsonl").read_text().splitlines())
    assert record["messages"] == [item["messages"][0], {"role": "assistant", "thinking": "hmm so",
                                                        "content": "yes done"}]
    (error,) = map(json.loads, (tmp_path / "r.jsonl.errors.jsonl").read_text().splitlines())
    assert (error["kind"], error["turn"], error["kept_turns"]) == ("format", 1, 1) and "headers must" in error["error"]

    stats = regenerate(_Scripted(tok, [call]), tok, [item], tmp_path / "s.jsonl", cfg, progress=False)
    assert (stats.succeeded, stats.errors, stats.unrenderable) == (0, 1, 1)
    with pytest.raises(ValueError, match=r"must come with its token ids .*endpoint.url=''"):
        regenerate(_Scripted(tok, [REPLY], with_ids=False), tok, [item], tmp_path / "t.jsonl", cfg, progress=False)
    with pytest.raises(ValueError, match="reasoning_effort must be one of"):
        regenerate(_Scripted(tok, [REPLY]), tok, [item], tmp_path / "u.jsonl",
                   RegenConfig(template_kwargs={"reasoning_effort": "extreme"}), progress=False)


# ----------------------------------------------------------------------------- the tiny gpt-oss target, regenerating


def _scripted_params(cfg, params, tok: ChatTokenizer) -> dict:
    """The golden tiny gpt-oss weights set to write harmony replies (module docstring)."""
    p = jax.tree.map(np.array, params)
    layers = p["layers"]
    v, d = p["embed"].shape
    assert len(SPECIAL + WORDS) <= FLAG_DIM and cfg.layer_types[1] == "full_attention"
    p["embed"] = np.zeros((v, d), np.float32)
    p["embed"][np.arange(FLAG_DIM), np.arange(FLAG_DIM)] = 1.0  # token i -> e_i
    p["final_norm"] = np.ones(d, np.float32)
    for name in ("wo", "bo", "we_down", "be_down"):  # no layer writes to the residual ...
        layers[name] = np.zeros_like(layers[name])
    # ... but head 0 of layer 1, which attends to `hmm` (q and k on the slowest RoPE pair, dims 7 and 15: rotation
    # below 1e-3 rad over the test's contexts) and copies a 1 from it to the flag dimension; elsewhere v = 0
    flag = tok.encode("hmm")[0]
    for name in ("wq", "bq", "wk", "bk", "wv", "bv"):
        layers[name][1] = 0.0
    layers["attn_norm"][1] = 1.0  # the one-hot input is normed to 8 * e_i
    layers["bq"][1, 7] = 12.0
    layers["wk"][1, flag, 7] = 12.0 / 8
    layers["wv"][1, flag, 0] = 1.0 / 8
    layers["wo"][1, 0, FLAG_DIM] = 1.0
    head = np.zeros((d, v), np.float32)
    i = {t: tok.encode(t)[0] for t in SPECIAL + WORDS}
    successors = {"<|channel|>": "analysis", "analysis": "<|message|>", "final": "<|message|>", "<|message|>": "hmm",
                  "hmm": "so", "so": "<|end|>", "<|end|>": "<|start|>", "<|start|>": "assistant",
                  "assistant": "<|channel|>", "yes": "done", "done": "<|return|>"}
    for a, b in successors.items():
        head[i[a], i[b]] = 40.0
    head[i["<|channel|>"], i["final"]] = head[i["<|message|>"], i["yes"]] = 25.0  # these win when the flag is up:
    head[FLAG_DIM, i["final"]] = head[FLAG_DIM, i["yes"]] = 20.0  # 8 / sqrt(2) * (25 + 20) > 8 / sqrt(2) * 40
    p["lm_head"] = head
    return p


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory):
    from dflash.models.loading import load_hf_dir
    from dflash.models.target import Target

    root = tmp_path_factory.mktemp("harmony_target") / "gpt_oss"
    shutil.copytree(GOLDEN / "tiny" / "gpt_oss", root, ignore=shutil.ignore_patterns("reference.npz", "mxfp4"))
    _tokenizer_dir(root)
    cfg, params = load_hf_dir(root)
    tokenizer = load_tokenizer_from_hf_dir(root)
    params = jax.tree.map(jnp.asarray, _scripted_params(cfg, params, tokenizer))
    return Target(name=str(root), path=root, cfg=cfg, weights=params, tokenizer=tokenizer, dtype=jnp.float32)


@pytest.fixture(scope="module")
def engine(target):
    from dflash.data.regenerate import make_regen_engine

    return make_regen_engine(target, slots=2, max_len=256)


def _generate(engine, tok: ChatTokenizer, prompt: list[int]) -> list[int]:
    rid = engine.submit(prompt, 24, tok.stop_token_ids)
    return engine.run()[rid].token_ids


@pytest.mark.heavy
def test_the_tiny_target_writes_harmony(target, engine) -> None:
    """The scripted target, through the engine: analysis then final after a plain prompt, the final alone once its
    analysis is in the context (the control the multi-turn test leans on)."""
    tok = target.tokenizer
    prompt = _prompt(tok, [{"role": "user", "content": USER_1}])
    assert _generate(engine, tok, prompt) == _ids(tok, REPLY)
    kept = prompt + _ids(tok, REPLY) + _ids(tok, "<|start|>user<|message|>And three ?<|end|><|start|>assistant")
    assert _generate(engine, tok, kept) == _ids(tok, FINAL_ONLY)


@pytest.mark.heavy
def test_regeneration_stores_both_channels_and_rows_round_trip(target, engine, tmp_path, monkeypatch) -> None:
    """Regeneration splits each reply into `thinking` and `content`; turn 2 is prompted with turn 1's analysis
    dropped (so the target writes its analysis again); each turn's row is exactly the prompt it was answered from
    plus the ids the target generated, the loss mask on those; a reply that hits max_new_tokens before its final
    answer is dropped."""
    from dflash.data.regenerate import regenerate

    tok = target.tokenizer
    sent: list[list[int]] = []
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda prompt, *a, **k: sent.append(list(prompt)) or submit(prompt, *a, **k))
    items = [{"id": "a", "source": "t", "messages": [{"role": "user", "content": USER_1},
                                                     {"role": "assistant", "content": "four"},
                                                     {"role": "user", "content": USER_2}]},
             {"id": "b", "source": "t", "messages": [{"role": "user", "content": "hmm two plus two ?"}]}]
    cfg = RegenConfig(system_prompt="Be brief", template_kwargs=KWARGS, max_new_tokens=24, slots=2)
    out = tmp_path / "regenerated.jsonl"
    stats = regenerate(engine, tok, items, out, cfg, progress=False)
    assert (stats.succeeded, stats.turns, stats.errors, stats.unrenderable) == (2, 3, 0, 0)
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    system, u1, u2 = ({"role": "system", "content": "Be brief"}, {"role": "user", "content": USER_1},
                      {"role": "user", "content": USER_2})
    both = {"role": "assistant", "thinking": "hmm so", "content": "yes done"}
    assert records["a"]["messages"] == [system, u1, both, u2, both]
    assert records["b"]["messages"][-1] == {"role": "assistant", "content": "yes done"}  # `hmm` asked: no analysis
    turn_two = _prompt(tok, [system, u1, {"role": "assistant", "content": "yes done"}, u2])
    assert turn_two in sent and tok.encode("hmm")[0] not in turn_two

    conversations = read_regenerated(out)  # by id: a, b
    rows, skipped = tokenize_rows(tok, conversations, 256, template_kwargs=cfg.template_kwargs)
    assert skipped == 0 and len(rows) == 3
    prompts = [_prompt(tok, [system, u1]), turn_two, _prompt(tok, [system, items[1]["messages"][0]])]
    for (tokens, mask, n), prompt in zip(rows, prompts, strict=True):
        generated = _generate(engine, tok, prompt)  # what the target writes after exactly this prompt
        assert tokens[:n].tolist() == prompt + generated
        assert mask[:n].tolist() == [0.0] * len(prompt) + [1.0] * len(generated)

    cut = dataclasses.replace(cfg, max_new_tokens=5)  # ends inside the analysis: nothing the template renders
    stats = regenerate(engine, tok, items[:1], tmp_path / "cut.jsonl", cut, progress=False)
    assert (stats.succeeded, stats.dropped) == (0, 1)
    error = json.loads((tmp_path / "cut.jsonl.errors.jsonl").read_text())
    assert error["kind"] == "truncated" and "before the harmony template could render it" in error["error"]
