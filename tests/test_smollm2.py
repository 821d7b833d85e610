"""The embedded default target (SmolLM2-135M-Instruct GGUF) against transformers on the same file.

Golden data: tests/golden/smollm2_chat.json (tools/golden_smollm2.py). Greedy continuations must be
equal token for token, both through one full forward per step and through the cached decode loop.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN

from dflash.models import decoder
from dflash.serve.engine import decode

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


CHATS = json.loads((GOLDEN / "smollm2_chat.json").read_text())["chats"]


def test_default_target_architecture(smollm2_target):
    cfg = smollm2_target.cfg
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "llama", 30, 576, 9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and cfg.rope_theta == 1e5


@pytest.mark.parametrize("chat", CHATS, ids=[c["name"] for c in CHATS])
def test_greedy_continuation_equals_transformers(smollm2_target, chat):
    t = smollm2_target
    prompt_ids = t.tokenizer.encode_chat(chat["messages"], add_generation_prompt=True)
    assert prompt_ids == chat["prompt_ids"]
    # no stop ids: the golden ran exactly max_new_tokens
    [result] = decode(t.params, t.cfg, [prompt_ids], len(chat["greedy_ids"]), max_len=256)
    assert result.token_ids == chat["greedy_ids"]


def test_one_full_forward_predicts_the_whole_continuation(smollm2_target):
    """Teacher-forced: a single uncached forward over prompt+continuation argmaxes to the continuation."""
    t = smollm2_target
    chat = CHATS[0]
    ids = chat["prompt_ids"] + chat["greedy_ids"]
    logits, _ = decoder.forward(t.params, t.cfg, jnp.asarray([ids]))
    n = len(chat["prompt_ids"])
    predicted = np.asarray(jnp.argmax(logits[0, n - 1:-1], axis=-1)).tolist()
    assert predicted == chat["greedy_ids"]
