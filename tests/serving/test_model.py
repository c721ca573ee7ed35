"""The model: paged attention equals dense attention, and generation does not depend on where blocks are."""

from __future__ import annotations

import numpy as np
import pytest

from moriio_async.serving.model import (
    BOS,
    Model,
    ModelConfig,
    decode_text,
    dense_attention,
    encode,
    paged_attention,
)

SMALL = ModelConfig(d_model=64, n_layers=2, n_heads=2, d_ff=128, block_size=4, max_model_len=128)


def test_tokenizer_is_bytes_after_bos() -> None:
    assert encode("hé") == [BOS, 0x68, 0xC3, 0xA9]
    assert decode_text([0x68, 0x69]) == "hi"


def test_config_checks_its_shape() -> None:
    with pytest.raises(ValueError, match="heads"):
        ModelConfig(d_model=60, n_heads=8)
    with pytest.raises(ValueError, match="n_layers"):
        ModelConfig(n_layers=0)
    assert ModelConfig(seed=1).fingerprint() != ModelConfig(seed=2).fingerprint()
    assert SMALL.blocks_for(9) == 3 and SMALL.block_bytes == 4 * 64 * 4


def test_weights_are_the_same_in_every_process_that_builds_the_model() -> None:
    a, b = Model(SMALL), Model(SMALL)
    assert np.array_equal(a.layers[1].w2, b.layers[1].w2) and np.array_equal(a.lm_head, b.lm_head)


def test_paged_attention_equals_dense_attention_over_scattered_blocks() -> None:
    rng = np.random.default_rng(1)
    seq, heads, dim, bs = 23, 2, 8, 4
    k = rng.standard_normal((seq, heads, dim)).astype(np.float32)
    v = rng.standard_normal((seq, heads, dim)).astype(np.float32)
    q = rng.standard_normal((1, heads, dim)).astype(np.float32)
    cache = np.zeros((1, 2, 16, bs, heads, dim), np.float32)
    table = [11, 3, 7, 0, 14, 9]  # scattered, out of order
    for pos in range(seq):
        cache[0, 0, table[pos // bs], pos % bs] = k[pos]
        cache[0, 1, table[pos // bs], pos % bs] = v[pos]
    paged = paged_attention(q, cache, 0, table, seq)
    # The reference: softmax(q k^T / sqrt(d)) v over all positions, computed plainly.
    scores = np.einsum("hd,shd->hs", q[0], k) / np.sqrt(dim)
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    expected = np.einsum("hs,shd->hd", weights, v)
    np.testing.assert_allclose(paged[0], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dense_attention(q, k, v, seq - 1), paged, rtol=1e-6, atol=1e-7)


def test_dense_attention_is_causal() -> None:
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((5, 1, 4)).astype(np.float32) for _ in range(3))
    out = dense_attention(q, k, v, 0)
    changed = v.copy()
    changed[4] += 1.0  # the last position may only change the last query's output
    out2 = dense_attention(q, k, changed, 0)
    assert np.array_equal(out[:4], out2[:4]) and not np.array_equal(out[4], out2[4])


def test_generation_does_not_depend_on_which_blocks_hold_the_kv() -> None:
    model = Model(SMALL)
    prompt = encode("disaggregated prefill and decode")
    reference = model.generate(prompt, 12)
    # Prefill into one cache's scattered blocks, copy them to other blocks of another cache (a transfer),
    # decode there: token for token the same as the reference.
    src, dst = model.new_cache(32), model.new_cache(32)
    n = SMALL.blocks_for(len(prompt) + 12)
    src_table, dst_table = list(range(31, 31 - n, -1)), [2 * i + 1 for i in range(n)]
    first = model.prefill(prompt, src, src_table)
    for s, d in zip(src_table, dst_table, strict=True):
        dst[:, :, d] = src[:, :, s]
    out = [first]
    while len(out) < 12:
        out.append(model.decode_step(out[-1], len(prompt) + len(out) - 1, dst, dst_table))
    assert out == reference
    assert all(32 <= t < 127 for t in out)


def test_corrupted_kv_changes_the_generation() -> None:
    """The demo's identity check has teeth: one wrong KV block gives other tokens."""
    model = Model(SMALL)
    prompt = encode("the quick brown fox jumps over the lazy dog")
    reference = model.generate(prompt, 16)
    cache = model.new_cache(32)
    table = list(range(SMALL.blocks_for(len(prompt) + 16)))
    out = [model.prefill(prompt, cache, table)]
    cache[0, 1, table[1]] *= -1.0  # the V of one block at layer 0
    while len(out) < 16:
        out.append(model.decode_step(out[-1], len(prompt) + len(out) - 1, cache, table))
    assert out != reference


def test_on_layer_runs_once_per_layer_once_its_kv_is_stored() -> None:
    model = Model(SMALL)
    cache = model.new_cache(8)
    seen: list[tuple[int, bool]] = []
    model.prefill(encode("abc"), cache, [5], lambda layer: seen.append((layer, bool(cache[layer, 0, 5, 0].any()))))
    assert seen == [(0, True), (1, True)]


def test_bad_input_is_refused() -> None:
    model = Model(SMALL)
    cache = model.new_cache(4)
    with pytest.raises(ValueError, match="tokens"):
        model.prefill([], cache, [0])
    with pytest.raises(ValueError, match="tokens"):
        model.prefill([300], cache, [0])
    with pytest.raises(ValueError, match="blocks"):
        model.prefill(encode("more than four tokens"), cache, [0])
    with pytest.raises(ValueError, match="max_model_len"):
        model.decode_step(65, SMALL.max_model_len, cache, [0, 1, 2, 3])
