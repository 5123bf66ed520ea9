"""A chat tokenizer for the demo's tiny target (tools/make_tiny_target.py, vocabulary 512, no
tokenizer of its own), so that the text side of the data chain (render prompts, decode responses,
prepare_data's assistant masks) runs at toy scale in CI.

Byte-level BPE without merges: ids 0..255 are the 256 byte symbols, 256..499 filler tokens
("<t256>" ...) that the random model may emit, 500/501/502 the ChatML specials <|im_start|>,
<|im_end|>, <|endoftext|> = the tiny target's bos/eos/pad ids (make_tiny_target.py puts them at
real_vocab, +1, +2). The template is ChatML.
"""
import json
import os

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def add_tokenizer(model_dir: str, real_vocab: int = 500, chat_template: bool = True) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    symbols = list(bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate(symbols)}
    for i in range(len(vocab), real_vocab):
        vocab[f"<t{i}>"] = i
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": []})
    assert fast.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|endoftext|>"]) == \
        [real_vocab, real_vocab + 1, real_vocab + 2], "special ids must be the tiny target's bos/eos/pad"
    if chat_template:
        fast.chat_template = CHATML
    fast.save_pretrained(model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["eos_token_id"] == real_vocab + 1
