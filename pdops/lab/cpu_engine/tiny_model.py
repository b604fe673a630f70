"""Make the lab's tiny model (issue 50): a randomly initialised Qwen2-architecture causal LM of
about 100k parameters and a byte-level BPE tokenizer trained on a fixed text, both written with
`save_pretrained`, weights from a fixed seed: the same files on every machine, no hub.

Run with the real engine's environment (it needs torch, transformers, tokenizers):
    .venv-engine/bin/python pdops/lab/cpu_engine/tiny_model.py DIR
The init std is large (0.5) so that greedy output is not one repeated token."""

from __future__ import annotations

import json
import sys
from pathlib import Path

SEED = 20261205
VOCAB = 512
# A fixed corpus for the tokenizer's merges: the words the lab's load sends, and enough others.
CORPUS = [
    "pdops lab request prefill decode gateway drain stop repair canary bootstrap mooncake transfer",
    "The quick brown fox jumps over the lazy dog. 0123456789 hello world",
    "Serving means routable: every request a client sends is served or turned away with a reason.",
] * 20


def make(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 3, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(out)

    torch.manual_seed(SEED)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      initializer_range=0.5, tie_word_embeddings=True, torch_dtype="bfloat16",
                      eos_token_id=fast.eos_token_id, bos_token_id=fast.eos_token_id)
    model = Qwen2ForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    (out / "pdops-tiny-model.json").write_text(json.dumps(
        {"seed": SEED, "parameters": sum(p.numel() for p in model.parameters()), "made_by": "pdops/lab/cpu_engine/tiny_model.py"}) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python pdops/lab/cpu_engine/tiny_model.py DIR")
    make(Path(sys.argv[1]))
