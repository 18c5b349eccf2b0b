"""Small checkpoints saved where --model can read them (no hub downloads)."""


def gpt2_checkpoint(path, texts) -> str:
    """A random GPT-2 (no loss_type, no BOS added, Conv1D attention `c_attn`) with a BPE tokenizer of ``texts``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_mhce.train.corpus import train_tokenizer

    tokenizer = train_tokenizer(texts, 300)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=64,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
                    ).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
