"""tokenizer.json and tokenizer_config.json for SmolLM2-135M-Instruct, built
from its GGUF (the one the real-engine test serves) with `gguf` and
`tokenizers`, no torch and no hub: the vocabulary, merges and chat template
as llama.cpp reads them, the pre-tokenizer llama.cpp calls `smollm` (digits
one by one, then GPT-2's byte-level regex) and the CONTROL tokens as special
added tokens. Checked against llama.cpp's own /tokenize (the golden ids in
crates/tokens/tests/golden/smollm2.json).

    python scripts/gguf-tokenizer.py MODEL.gguf OUT_DIR
"""
import json, sys
from gguf import GGUFReader
from tokenizers import Tokenizer, AddedToken, models, pre_tokenizers, decoders, processors

src, out = sys.argv[1], sys.argv[2]
r = GGUFReader(src)
f = r.fields
def val(k): return f[k].contents()
tokens = val("tokenizer.ggml.tokens")
types = val("tokenizer.ggml.token_type")
merges = val("tokenizer.ggml.merges")
assert val("tokenizer.ggml.model") == "gpt2" and val("tokenizer.ggml.pre") == "smollm"
vocab = {t: i for i, t in enumerate(tokens)}
merges = [tuple(m.split(" ", 1)) for m in merges]
tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
tok.normalizer = None
# llama.cpp 'smollm' pre-type = "\p{N}" split + GPT-2 regex == HF Digits(individual) + ByteLevel(use_regex)
tok.pre_tokenizer = pre_tokenizers.Sequence([
    pre_tokenizers.Digits(individual_digits=True),
    pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
])
tok.post_processor = processors.ByteLevel(trim_offsets=False)
tok.decoder = decoders.ByteLevel()
control = [t for t, ty in zip(tokens, types) if ty == 3]  # CONTROL -> special added tokens
tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
tok.save(f"{out}/tokenizer.json")
name = lambda k: tokens[val(k)]
cfg = {
    "add_prefix_space": False,
    "added_tokens_decoder": {str(vocab[t]): {"content": t, "lstrip": False, "normalized": False,
                             "rstrip": False, "single_word": False, "special": True} for t in control},
    "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    "bos_token": name("tokenizer.ggml.bos_token_id"),
    "eos_token": name("tokenizer.ggml.eos_token_id"),
    "unk_token": name("tokenizer.ggml.unknown_token_id"),
    "pad_token": name("tokenizer.ggml.padding_token_id"),
    "chat_template": val("tokenizer.chat_template"),
    "clean_up_tokenization_spaces": False,
    "model_max_length": 8192,
    "tokenizer_class": "GPT2Tokenizer",
    "vocab_size": len(tokens),
}
json.dump(cfg, open(f"{out}/tokenizer_config.json", "w"), indent=2, ensure_ascii=False)
print("vocab", len(tokens), "merges", len(merges), "control", control)
