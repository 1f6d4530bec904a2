"""Shared fixtures: tiny models and tokenizers built in code, CPU only."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def world_tokenizer():
    from datamodules.arithmetic.tokenizer import build_tokenizer

    return build_tokenizer()


def tiny_llama(vocab_size: int, hidden_size: int = 32, layers: int = 2, seed: int = 0):
    """A LlamaForCausalLM small enough for unit tests (tens of thousands of parameters)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=37, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                      pad_token_id=0, bos_token_id=2, eos_token_id=3)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture()
def tiny_pair(world_tokenizer):
    """(target, draft, tokenizer): two tiny Llamas of different widths on the world tokenizer."""
    return tiny_llama(len(world_tokenizer), 32, 2, seed=0), tiny_llama(len(world_tokenizer), 24, 1, seed=1), world_tokenizer
