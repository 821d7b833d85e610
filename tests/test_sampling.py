"""Sampling filters: temperature, top-k and top-p keep exactly the tokens they should."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.schema import ConfigError
from serve.generate import bucket
from serve.sampling import SamplingConfig, filtered_logprobs, sample


def test_greedy_is_argmax():
    logits = jnp.array([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    assert sample(logits, SamplingConfig(), jax.random.PRNGKey(0)).tolist() == [1, 0]


def test_top_k_and_top_p_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    kept_k = np.isfinite(np.asarray(filtered_logprobs(logits, SamplingConfig(temperature=1.0, top_k=2))))
    assert kept_k.tolist() == [[True, True, False, False]]
    # top_p=0.7: 0.5 alone is below 0.7, 0.5+0.3 reaches it -> keep the first two.
    kept_p = np.isfinite(np.asarray(filtered_logprobs(logits, SamplingConfig(temperature=1.0, top_p=0.7))))
    assert kept_p.tolist() == [[True, True, False, False]]
    probs = np.exp(np.asarray(filtered_logprobs(logits, SamplingConfig(temperature=1.0, top_p=0.7))))
    np.testing.assert_allclose(probs[0, :2], [0.5 / 0.8, 0.3 / 0.8], rtol=1e-5)


def test_sampled_frequencies_follow_the_distribution():
    logits = jnp.log(jnp.array([[0.6, 0.3, 0.1]]))
    keys = jax.random.split(jax.random.PRNGKey(1), 20000)
    draws = jax.vmap(lambda k: sample(logits, SamplingConfig(temperature=1.0), k)[0])(keys)
    freq = np.bincount(np.asarray(draws), minlength=3) / 20000
    np.testing.assert_allclose(freq, [0.6, 0.3, 0.1], atol=0.015)


def test_bad_sampling_values():
    with pytest.raises(ConfigError, match="sampling.temperature must be >= 0"):
        SamplingConfig(temperature=-1.0)
    with pytest.raises(ConfigError, match="sampling.max_new_tokens must be >= 1"):
        SamplingConfig(max_new_tokens=0)


def test_prefill_buckets_are_powers_of_two_at_least_16():
    assert [bucket(n) for n in (1, 16, 17, 100, 129)] == [16, 16, 32, 128, 256]
