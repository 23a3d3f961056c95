"""A tiny LazyLlama folder (with a small BPE tokenizer) and synthetic text/JSON-lines corpora for fine-tuning tests."""

import json
import random
from pathlib import Path

SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher"]
VERBS = ["sees", "likes", "follows", "finds", "watches", "calls"]
OBJECTS = ["the red ball", "a green tree", "the river", "a quiet house", "the long road", "a bright star"]


def synthetic_documents(count: int, seed: int) -> list[str]:
    """Documents of 1-6 templated sentences: easy to learn, so a few steps lower the loss."""
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        sentences = [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."
                     for _ in range(rng.randint(1, 6))]
        docs.append(" ".join(sentences))
    return docs


def write_corpora(root: Path) -> dict[str, Path]:
    """`train.txt` (documents separated by blank lines), `eval.jsonl` (one {"text": ...} per line)."""
    root.mkdir(parents=True, exist_ok=True)
    train, evaluation = root / "train.txt", root / "eval.jsonl"
    train.write_text("\n\n".join(synthetic_documents(120, seed=0)) + "\n", encoding="utf-8")
    with evaluation.open("w", encoding="utf-8") as handle:
        for doc in synthetic_documents(30, seed=1):
            handle.write(json.dumps({"text": doc}) + "\n")
    return {"train": train, "eval": evaluation}


def write_tiny_model(root: Path, seed: int = 0) -> Path:
    """A 2-layer LazyLlama (GQA 4/2 heads, window 32, tau = -0.5) with a 400-token BPE tokenizer, saved to `root`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from modeling_lazy import LazyLlamaConfig, LazyLlamaForCausalLM

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(synthetic_documents(200, seed=2), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                        pad_token="</s>")
    config = LazyLlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, lazy_bias_window=32, lazy_tau_init=-0.5,
        lazy_bias_init_std=0.02, max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LazyLlamaForCausalLM(config)
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root
