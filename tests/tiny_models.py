"""Random-weight models of any family, saved as HF folders with the default tokenizer beside them."""

from __future__ import annotations

from pathlib import Path

import torch


def tiny_model(family: str, folder: Path, tokenizer, **config) -> Path:
    """A ``family`` model built from ``config`` with seeded random weights. Norm weights and biases are
    randomised too: transformers initialises them to 1 or 0, which would hide a forward pass that drops a
    bias or a norm's offset."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(0)
    built = AutoConfig.for_model(family, **config)
    # Qwen 3.5's wrapper is listed as a causal LM too, which would build its language model alone
    causal = family != "qwen3_5"
    try:
        model = (AutoModelForCausalLM if causal else AutoModelForImageTextToText).from_config(built)
    except ValueError:  # a multimodal model transformers does not list as a causal LM (Mistral 3)
        model = AutoModelForImageTextToText.from_config(built)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.2 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's scale of each layer's output, 1 as initialised
                buffer.add_(0.2 * torch.randn_like(buffer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
