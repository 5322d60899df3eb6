"""A Llama-shaped model with random weights whose 8-bit residual passes 1 GB, converted quickly and cached.

    .venv/bin/python benchmarks/large_model.py

It measures time, not quality: the weights are transformers' random init, the conversion rounds to
nearest (``ConvertConfig(quantizer="rtn")``, a few Lloyd iterations, one short calibration sequence),
and the tokenizer is the demo folder's. The converted folder lands under the cache
(``~/.cache/splitspec/converted/``), so a rerun of ``scaling.py`` finds it at once.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from splitspec.config import ConvertConfig, DataConfig, ModelConfig
from splitspec.quantize.format import FORMAT_VERSION

CONVERTED = ModelConfig().cache_dir.parent / "converted"
# the folders' names carry the format version, as the Makefile's demo folder does: a new format converts
# them anew rather than finding older folders whose residuals it refuses
DEMO = CONVERTED / f"smollm2-135m-demo-f{FORMAT_VERSION}"
LARGE = CONVERTED / f"llama-random-1b-rtn8-f{FORMAT_VERSION}"
# token ids of two short chat-like prompts, for the rank statistics (what a random model drafts is noise;
# the cost model needs the statistics to exist to predict a tree)
FIT_PROMPTS = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365], [1, 4093, 198, 19161, 260, 1345, 28, 2]]
SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 18,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}


def large_folder(out: Path = LARGE, tokenizer_from: Path = DEMO) -> Path:
    """The converted folder with rank statistics, made on the first call (minutes; the float32 source
    is deleted)."""
    if not out.exists():
        _convert(out, tokenizer_from)
    if not (out / "tree_stats.json").exists():
        from splitspec.gpu_actor.tree_fit import fit_tree_stats

        fit_tree_stats(out, 8, prompts=FIT_PROMPTS, new_tokens=12)
    return out


def _convert(out: Path, tokenizer_from: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from splitspec.quantize.convert import convert

    with tempfile.TemporaryDirectory(prefix="splitspec-large-") as tmp:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SHAPE))
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(tmp)
        del model
        cfg = ConvertConfig(
            residual_bits=(8,),
            quantizer="rtn",
            lloyd_iters=3,
            lloyd_samples=200_000,
            data=DataConfig(calib_sequences=1, calib_seq_len=32),
        )
        convert(ModelConfig(source=tmp), out, cfg)  # atomic: a failed run leaves no folder behind


if __name__ == "__main__":
    print(large_folder(), file=sys.stdout)
