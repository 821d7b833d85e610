"""The record codec (data.records): a sample round-trips through its record bytes, and every inconsistency
is refused on encode (ValueError) or named on decode (ShardError)."""

from __future__ import annotations

import numpy as np
import pytest

from dflash.data.records import BF16, HEADER_SIZE, ShardError, decode_record, encode_record, record_size


def test_record_encode_decode_and_validation() -> None:
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((5, 8)).astype(BF16)
    record = encode_record(7, np.arange(5), np.array([0, 1, 1, 0, 1]), feats)
    assert len(record) == record_size(5, 8) == HEADER_SIZE + 5 * (2 * 8 + 5)
    sample = decode_record(record, feature_dim=8, sample_index=7)
    np.testing.assert_array_equal(sample.tokens, np.arange(5))
    np.testing.assert_array_equal(sample.loss_mask, [0, 1, 1, 0, 1])
    assert sample.features.dtype == BF16 and np.array_equal(sample.features.view(np.uint16), feats.view(np.uint16))

    with pytest.raises(ShardError, match=r"f\.ar: record 3: length must be"):
        decode_record(record[:-1], feature_dim=8, where="f.ar: record 3")
    with pytest.raises(ShardError, match="feature width must be 16"):
        decode_record(record, feature_dim=16)
    with pytest.raises(ShardError, match="must hold sample 8; received sample 7"):
        decode_record(record, feature_dim=8, sample_index=8)
    with pytest.raises(ShardError, match="must start with"):
        decode_record(b"XXXX" + record[4:], feature_dim=8)
    with pytest.raises(ValueError, match="features must be bfloat16"):
        encode_record(0, np.arange(5), np.ones(5), feats.astype(np.float32))


def test_record_with_next_ids_round_trips_and_is_checked() -> None:
    feats = np.ones((4, 8), BF16)
    record = encode_record(3, np.arange(4), np.array([0, 1, 1, 1]), feats, np.array([9, 8, 7, 6]))
    assert len(record) == record_size(4, 8, next_ids=True) == record_size(4, 8) + 4 * 4
    sample = decode_record(record, feature_dim=8, sample_index=3, next_ids=True)
    np.testing.assert_array_equal(sample.next_ids, [9, 8, 7, 6])
    np.testing.assert_array_equal(sample.tokens, np.arange(4))
    np.testing.assert_array_equal(sample.loss_mask, [0, 1, 1, 1])
    assert decode_record(encode_record(3, np.arange(4), np.ones(4), feats), feature_dim=8).next_ids is None
    with pytest.raises(ShardError, match="must not hold target labels"):
        decode_record(record, feature_dim=8, next_ids=False)
    with pytest.raises(ShardError, match="must hold target labels"):
        decode_record(encode_record(3, np.arange(4), np.ones(4), feats), feature_dim=8, next_ids=True)
    with pytest.raises(ValueError, match="next_ids must be non-negative integer ids of shape"):
        encode_record(3, np.arange(4), np.ones(4), feats, np.arange(3))


def test_record_with_the_targets_top_k_round_trips_and_is_checked() -> None:
    feats = np.ones((4, 8), BF16)
    ids = np.arange(12).reshape(4, 3) + 100
    probs = np.array([[0.5, 0.25, 0.125]] * 4)
    record = encode_record(3, np.arange(4), np.array([0, 1, 1, 1]), feats, np.array([9, 8, 7, 6]), (ids, probs))
    assert len(record) == record_size(4, 8, next_ids=True, topk=3) == record_size(4, 8, next_ids=True) + 4 * 3 * 6
    sample = decode_record(record, feature_dim=8, sample_index=3, next_ids=True, topk=3)
    np.testing.assert_array_equal(sample.next_ids, [9, 8, 7, 6])
    np.testing.assert_array_equal(sample.topk_ids, ids)
    np.testing.assert_array_equal(sample.topk_probs, probs)  # exact in float16
    np.testing.assert_array_equal(sample.loss_mask, [0, 1, 1, 1])
    assert decode_record(encode_record(3, np.arange(4), np.ones(4), feats, np.arange(4)), feature_dim=8,
                         topk=0).topk_ids is None
    with pytest.raises(ShardError, match="must hold the target's top-2"):
        decode_record(record, feature_dim=8, topk=2)
    with pytest.raises(ShardError, match="length must be"):
        decode_record(record[:-1], feature_dim=8)
    with pytest.raises(ValueError, match="topk must come with next_ids"):
        encode_record(3, np.arange(4), np.ones(4), feats, None, (ids, probs))
    with pytest.raises(ValueError, match="probabilities must lie in"):
        encode_record(3, np.arange(4), np.ones(4), feats, np.arange(4), (ids, probs * 3))
