"""A small decoder-only transformer in numpy, with a paged KV cache, shipped with the project.

Nothing is downloaded: the weights are drawn from a seeded generator at start, so
every process that builds a ``Model`` from the same ``ModelConfig`` holds the same
weights bit for bit. The tokenizer is byte-level (UTF-8 bytes plus a BOS token);
greedy generation is restricted to printable ASCII so every generated token is one
character of text.

The KV cache is paged the way serving engines lay it out: one array per instance of
shape ``(layers, 2, num_blocks, block_size, heads, head_dim)`` (K and V per layer,
fixed-size blocks), and a request owns a block table (block ids in token order).
``prefill`` computes a prompt's KV into its blocks (calling ``on_layer`` as each
layer's KV lands, so a connector can push it layer by layer) and returns the first
generated token; ``decode_step`` attends over the paged cache for one new token.
``generate`` runs both in one process: it is the reference every disaggregated
generation must match token for token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "BOS",
    "Model",
    "ModelConfig",
    "decode_text",
    "dense_attention",
    "encode",
    "paged_attention",
]

F32 = npt.NDArray[np.float32]
BOS = 256
"""The token before every prompt; token ids 0..255 are bytes."""
PRINTABLE = np.arange(32, 127)
"""Greedy generation picks among printable ASCII bytes only."""


def encode(text: str) -> list[int]:
    """Byte-level tokenizer: BOS, then the UTF-8 bytes of ``text``."""
    return [BOS, *text.encode("utf-8")]


def decode_text(tokens: Sequence[int]) -> str:
    """Generated tokens (printable ASCII bytes) back to text."""
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of the model and of its KV cache blocks; the weights follow from ``seed``."""

    name: str = "moriio-tiny"
    """The name the OpenAI API serves it under: a request's ``model`` must be this."""
    d_model: int = 256
    """Width of each token's vector; it splits into ``n_heads`` heads of an even size."""
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 1024
    """Width of each layer's feed-forward hidden layer."""
    block_size: int = 16
    """Tokens per KV cache block: the unit the pool lends and a transfer moves."""
    max_model_len: int = 1024
    """Longest sequence (prompt and generated tokens) a request may reach."""
    seed: int = 0
    """Seeds the weights: processes with equal configs hold the same weights bit for bit."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError("d_model must split into n_heads heads of an even size")
        for field in ("d_model", "n_layers", "n_heads", "d_ff", "block_size", "max_model_len"):
            if getattr(self, field) < 1:
                raise ValueError(f"ModelConfig.{field} must be >= 1")

    @property
    def vocab(self) -> int:
        return 257

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of K (or of V) at one layer."""
        return self.block_size * self.d_model * 4

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def fingerprint(self) -> str:
        """Identifies the weights and the cache layout: instances must agree on it."""
        return hashlib.sha256(repr(sorted(asdict(self).items())).encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class _Layer:
    ln1: F32
    wqkv: F32
    wo: F32
    ln2: F32
    w1: F32
    w2: F32


def _rms_norm(x: F32, gain: F32) -> F32:
    scale = np.float32(1.0) / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(1e-5))
    out: F32 = (x * scale * gain).astype(np.float32)
    return out


def _softmax(x: F32) -> F32:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    out: F32 = (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)
    return out


def dense_attention(q: F32, k: F32, v: F32, first_pos: int) -> F32:
    """Causal attention of queries at positions ``first_pos..`` over keys at ``0..``; ``(T, H, D)`` arrays."""
    t, _, d = q.shape
    scores = np.matmul(q.transpose(1, 0, 2), k.transpose(1, 2, 0)) / np.float32(np.sqrt(d))
    future = np.arange(k.shape[0])[None, :] > (first_pos + np.arange(t))[:, None]
    scores[:, future] = -np.inf
    out = np.matmul(_softmax(scores), v.transpose(1, 0, 2))
    return np.ascontiguousarray(out.transpose(1, 0, 2), dtype=np.float32)


def paged_attention(q: F32, cache: F32, layer: int, block_table: Sequence[int], seq_len: int) -> F32:
    """Attention of one query ``(1, H, D)`` at position ``seq_len - 1`` over the paged cache."""
    blocks = np.asarray(block_table[: -(-seq_len // cache.shape[3])], dtype=np.intp)
    h, d = cache.shape[4], cache.shape[5]
    k = cache[layer, 0, blocks].reshape(-1, h, d)[:seq_len]
    v = cache[layer, 1, blocks].reshape(-1, h, d)[:seq_len]
    return dense_attention(q, k, v, seq_len - 1)


class Model:
    """Weights and the forward passes; pure computation, safe to call from a worker thread."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = c = config
        rng = np.random.default_rng(c.seed)

        def mat(rows: int, cols: int) -> F32:
            out: F32 = (rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(np.float32)
            return out

        self.embed = (rng.standard_normal((c.vocab, c.d_model))).astype(np.float32)
        self.layers = [
            _Layer(
                ln1=np.ones(c.d_model, np.float32),
                wqkv=mat(c.d_model, 3 * c.d_model),
                wo=mat(c.d_model, c.d_model),
                ln2=np.ones(c.d_model, np.float32),
                w1=mat(c.d_model, c.d_ff),
                w2=mat(c.d_ff, c.d_model),
            )
            for _ in range(c.n_layers)
        ]
        self.ln_f = np.ones(c.d_model, np.float32)
        self.lm_head = mat(c.d_model, c.vocab)
        half = c.head_dim // 2
        self._inv_freq = (1.0 / (10000.0 ** (np.arange(half) / half))).astype(np.float32)

    def new_cache(self, num_blocks: int) -> F32:
        """A zeroed paged cache array in the layout every instance registers."""
        c = self.config
        return np.zeros((c.n_layers, 2, num_blocks, c.block_size, c.n_heads, c.head_dim), np.float32)

    def _rope(self, x: F32, positions: npt.NDArray[np.int64]) -> F32:
        angles = positions[:, None].astype(np.float32) * self._inv_freq[None, :]
        cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
        a, b = x[..., ::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., ::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out

    def _qkv(self, layer: _Layer, x: F32, positions: npt.NDArray[np.int64]) -> tuple[F32, F32, F32]:
        c = self.config
        qkv = (_rms_norm(x, layer.ln1) @ layer.wqkv).reshape(len(x), 3, c.n_heads, c.head_dim)
        q = self._rope(np.ascontiguousarray(qkv[:, 0]), positions)
        k = self._rope(np.ascontiguousarray(qkv[:, 1]), positions)
        return q, k, np.ascontiguousarray(qkv[:, 2])

    def _finish_layer(self, layer: _Layer, x: F32, attn: F32) -> F32:
        x = x + attn.reshape(len(x), -1) @ layer.wo
        h = _rms_norm(x, layer.ln2) @ layer.w1
        out: F32 = (x + (h / (np.float32(1.0) + np.exp(-h))) @ layer.w2).astype(np.float32)
        return out

    def _store(self, cache: F32, layer: int, block_table: Sequence[int], start: int, k: F32, v: F32) -> None:
        pos = np.arange(start, start + len(k))
        blocks = np.asarray(block_table, dtype=np.intp)[pos // self.config.block_size]
        slots = pos % self.config.block_size
        cache[layer, 0, blocks, slots] = k
        cache[layer, 1, blocks, slots] = v

    def _next_token(self, x: F32) -> int:
        logits = _rms_norm(x[-1:], self.ln_f) @ self.lm_head
        return int(PRINTABLE[np.argmax(logits[0, PRINTABLE])])

    def prefill(
        self,
        tokens: Sequence[int],
        cache: F32,
        block_table: Sequence[int],
        on_layer: Callable[[int], None] | None = None,
    ) -> int:
        """Compute the prompt's KV into ``block_table``'s blocks; return the first generated token.

        ``on_layer(i)`` runs once layer ``i``'s KV is in the cache (from this thread).
        """
        self._check(tokens, block_table, len(tokens))
        positions = np.arange(len(tokens))
        x = self.embed[np.asarray(tokens)]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, positions)
            self._store(cache, i, block_table, 0, k, v)
            if on_layer is not None:
                on_layer(i)
            x = self._finish_layer(layer, x, dense_attention(q, k, v, 0))
        return self._next_token(x)

    def decode_step(self, token: int, pos: int, cache: F32, block_table: Sequence[int]) -> int:
        """Append ``token`` at position ``pos`` (KV of ``0..pos-1`` is in the cache); return the next token."""
        self._check([token], block_table, pos + 1)
        x = self.embed[np.asarray([token])]
        positions = np.asarray([pos])
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, positions)
            self._store(cache, i, block_table, pos, k, v)
            x = self._finish_layer(layer, x, paged_attention(q, cache, i, block_table, pos + 1))
        return self._next_token(x)

    def _check(self, tokens: Sequence[int], block_table: Sequence[int], seq_len: int) -> None:
        c = self.config
        if not tokens or any(not 0 <= t < c.vocab for t in tokens):
            raise ValueError(f"tokens must be non-empty ids in 0..{c.vocab - 1}")
        if seq_len > c.max_model_len:
            raise ValueError(f"sequence of {seq_len} tokens exceeds max_model_len {c.max_model_len}")
        if len(block_table) < c.blocks_for(seq_len):
            raise ValueError(f"{len(block_table)} blocks cannot hold {seq_len} tokens")

    def generate(self, tokens: Sequence[int], max_tokens: int) -> list[int]:
        """Greedy generation in one process with a private cache: the reference."""
        c = self.config
        table = list(range(c.blocks_for(len(tokens) + max_tokens)))
        cache = self.new_cache(len(table))
        out = [self.prefill(tokens, cache, table)]
        while len(out) < max_tokens:
            out.append(self.decode_step(out[-1], len(tokens) + len(out) - 1, cache, table))
        return out
