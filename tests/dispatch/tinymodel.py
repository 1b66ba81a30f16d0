"""A tiny llama-architecture GGUF with synthetic weights, for llama-server integration tests.

No model hub is reachable from the test machines, so the tests write their own model with
PyPI's ``gguf`` package. The model is useless as a language model and exactly what the
tests need:

* one token per character: a SentencePiece-style ("llama") vocabulary of control tokens,
  256 byte-fallback tokens, the word-boundary marker and the printable ASCII characters,
  with no multi-character pieces, so nothing ever merges;
* a deterministic output that never reaches end-of-sequence: every token embeds to the
  same vector and every attention / feed-forward matrix is zero, so the residual stream is
  a constant; the output head gives one token (``OUTPUT_CHAR``) a logit ``LOGIT_GAP``
  above every other (about e^-40 probability for anything else, whatever the sampler), so
  a request for ``max_tokens`` tokens always yields exactly ``max_tokens`` copies of it;
* a tunable cost per token: the layers do real (zero-valued) matrix work, so more layers
  or a wider model make generation slower and queueing visible.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

#: the character the model always generates
OUTPUT_CHAR = "a"
#: logit margin of OUTPUT_CHAR over every other token
LOGIT_GAP = 40.0

_SPACE = "\u2581"  # SentencePiece's word-boundary marker


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types (gguf.TokenType values) of the one-char vocabulary."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [2, 3, 3]  # UNKNOWN, CONTROL, CONTROL
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256  # BYTE
    tokens.append(_SPACE)
    types.append(1)  # NORMAL
    for code in range(0x21, 0x7F):  # printable ASCII without the space
        tokens.append(chr(code))
        types.append(1)
    scores = [0.0] * len(tokens)
    return tokens, scores, types


def write_tiny_llama(
    path: str | Path,
    *,
    n_layer: int = 4,
    n_embd: int = 256,
    n_ff: int = 512,
    n_head: int = 4,
    n_ctx_train: int = 8192,
) -> Path:
    """Write the model to ``path`` and return it. Dimensions are in elements."""
    import gguf

    path = Path(path)
    tokens, scores, types = vocabulary()
    n_vocab = len(tokens)
    out_id = tokens.index(OUTPUT_CHAR)
    head_dim = n_embd // n_head

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("sfq-test-tiny-llama")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(n_vocab)
    w.add_file_type(1)  # mostly F16
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)

    # numpy shapes are ggml's ne reversed: a (rows, cols) array is ne = [cols, rows]
    embd = np.zeros((n_vocab, n_embd), dtype=np.float32)
    embd[:, 0] = 1.0  # every token: the same direction
    w.add_tensor("token_embd.weight", embd)
    ones = np.ones(n_embd, dtype=np.float32)
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(p + name + ".weight", np.zeros((n_embd, n_embd), dtype=np.float16))
        w.add_tensor(p + "ffn_norm.weight", ones)
        w.add_tensor(p + "ffn_gate.weight", np.zeros((n_ff, n_embd), dtype=np.float16))
        w.add_tensor(p + "ffn_up.weight", np.zeros((n_ff, n_embd), dtype=np.float16))
        w.add_tensor(p + "ffn_down.weight", np.zeros((n_embd, n_ff), dtype=np.float16))
    w.add_tensor("output_norm.weight", ones)
    # after RMS norm the constant residual is sqrt(n_embd) along dimension 0
    head = np.zeros((n_vocab, n_embd), dtype=np.float32)
    head[out_id, 0] = LOGIT_GAP / np.sqrt(n_embd)
    w.add_tensor("output.weight", head)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
