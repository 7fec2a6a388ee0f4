"""Make a small "pretrained" Hugging Face model, its tokenizer and a jsonl dataset, all local.

It stands in for the model and text you already have, so the fine-tuning walk-through in
README.md runs anywhere without downloading anything::

    python examples/finetune/make_tiny_model.py runs/tiny-hf     # from the repository's root
    xpu train examples/finetune/lora-jsonl.yaml                  # reads runs/tiny-hf/...

It writes ``OUT/model`` (a Qwen2-style config with tied embeddings, random weights, and a
byte-level BPE tokenizer trained on this repository's tiny text, with a ChatML chat template),
``OUT/train.jsonl`` (one paragraph per line under ``"text"``) and ``OUT/chat.jsonl`` (one
conversation per line under ``"messages"``: asked for a paragraph's next sentences, the assistant
gives them; ``chat-lora.yaml`` trains on them)::

    xpu train examples/finetune/chat-lora.yaml
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

TEXT = Path(__file__).resolve().parents[1] / "train" / "data" / "tiny.txt"
#: ChatML, as Qwen2's instruct models write conversations (their turn markers are special tokens here too).
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer(text: str, vocab: int):
    """A byte-level BPE tokenizer trained on ``text``, wrapped for ``transformers``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    wrapped.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def conversation(paragraph: str) -> list[dict[str, str]]:
    """A paragraph of several sentences as one exchange: its first in the question, the rest in the answer."""
    head, _, rest = paragraph.partition(". ")
    return [{"role": "system", "content": "You continue texts."},
            {"role": "user", "content": f"How does this go on? {head}."},
            {"role": "assistant", "content": rest}]


def main(argv: list[str] | None = None) -> None:
    """Write the model folder and the dataset under the given output folder."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="output folder")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    text = TEXT.read_text()
    tokenizer = make_tokenizer(text, vocab=512)
    config = Qwen2Config(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
                         max_position_embeddings=512, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    out = args.out / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    with open(args.out / "train.jsonl", "w") as fh:
        for p in paragraphs:
            fh.write(json.dumps({"text": p}) + "\n")
    with open(args.out / "chat.jsonl", "w") as fh:
        for p in paragraphs:
            if ". " in p:  # a paragraph of more than one sentence
                fh.write(json.dumps({"messages": conversation(p)}) + "\n")
    print(f"wrote {out} ({sum(p.numel() for p in model.parameters()):,} parameters), "
          f"{args.out / 'train.jsonl'} ({len(paragraphs)} documents) and {args.out / 'chat.jsonl'} (as conversations)")


if __name__ == "__main__":
    main()
