"""Loading a target from a local Hugging Face folder (never the network)."""
from __future__ import annotations

from pathlib import Path

import torch


def load_target(folder: Path, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a local folder in Hugging Face format, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model.eval(), tokenizer
