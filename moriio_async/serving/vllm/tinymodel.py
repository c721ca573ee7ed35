"""A tiny Llama with random weights and a locally trained tokenizer: a real vLLM model, nothing downloaded.

Run with the vLLM environment's Python (it needs torch, transformers and
tokenizers): ``python -m moriio_async.serving.vllm.tinymodel DIR``. Seeded, so
the same directory content every time; about 5 s. The shape suits vLLM's CPU
attention backend (head size 32; it refuses 16) and keeps a KV block small:
2 layers, hidden 128, 4 attention heads, 2 KV heads, vocabulary 512.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["SENTENCES", "make_model"]

SENTENCES = [
    "Disaggregated serving splits a request between a prefill server and a decode server.",
    "The prefill server computes the key and value cache; the decode server generates from it.",
    "One-sided reads and writes move registered memory without the target's CPU.",
    "A completion queue is drained by a reader on its channel's file descriptor.",
    "Every transfer is an awaitable future with a deadline and a status code.",
    "The quick brown fox jumps over the lazy dog while the cache moves between machines.",
    "Tokens stream back through the proxy, one server-sent event at a time.",
]
MARKER = "moriio-tinymodel.json"


def make_model(out: Path, *, seed: int = 1234, vocab: int = 512) -> Path:
    """Write the model and tokenizer into ``out`` (skipped when ``out`` already holds this recipe)."""
    recipe = {"seed": seed, "vocab": vocab, "layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "v": 1}
    marker = out / MARKER
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return out
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from tokenizers import decoders as tk_decoders
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk_decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(SENTENCES * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    marker.write_text(json.dumps(recipe))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    print(make_model(args.out, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
