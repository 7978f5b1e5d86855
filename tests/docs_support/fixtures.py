"""Stand-ins for what a guide's reader already has (a Hugging Face model folder), made by the
hidden preludes of the guides' code blocks (``<!-- docs-test: prelude ... -->``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DIGITS = [str(i) for i in range(10)] + ["+", "="]


def tiny_hf_model(folder: str | os.PathLike = "my-model") -> str:
    """A small transformers Llama with a word-level tokenizer of digits, saved to ``folder``
    (config, safetensors, tokenizer) unless it is there. Safe to call from every rank at once:
    each builds the same files in a folder of its own and renames it into place."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    target = Path(folder)
    if (target / "config.json").exists():
        return str(target)
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", *DIGITS, "<unk>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    cfg = transformers.LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent.resolve()))
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another rank's copy is there already
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
