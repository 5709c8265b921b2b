"""A GPTQ-layout int4 form of a Hugging Face checkpoint, so that ONNX Runtime GenAI's builder can build an int4 model
of a checkpoint too large for its own quantizer.

`python -m specbuild.bench.gptq_form -i HF_DIR -o GPTQ_DIR [--group-size 32]` writes every decoder-layer linear weight
(`model.layers.N.*_proj.weight`) as AutoGPTQ's tensors -- `qweight` (int32, 8 four-bit values per word along the input
dimension), `qzeros` (int32, zero point - 1 packed along the output dimension), `scales` (float16, per group of
`group_size` inputs and per output) and `g_idx` -- and copies every other tensor (embedding, norms, lm_head) as it is,
with config.json's `quantization_config` saying so and the tokenizer beside it.

Why: GenAI 0.18's builder turns a float checkpoint into one in-memory ModelProto in fp32 before it quantizes
(`ir.to_proto` in its `to_nbits`), ~4 bytes per parameter: an 8B model does not fit a 24 GiB machine
(docs/benchmarks/design-measurements.md). From a GPTQ checkpoint it repacks the 4-bit weights it is given and only
quantizes the lm_head. The quantization here is round-to-nearest, symmetric (zero point 8, scale = max |w| / 7 per
group), the same kind as both builders' default int4, so the two engines run the same kernel (MatMulNBits) on weights of
the same checkpoint; the comparison it serves is speed and memory, not accuracy. One input shard is held at a time.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch

LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")
ZERO = 8  # the symmetric zero point of 4-bit values 0..15


def quantize_linear(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """AutoGPTQ's four tensors for one nn.Linear weight [out, in] (in divisible by group_size and by 8)."""
    out_features, in_features = weight.shape
    if in_features % group_size or in_features % 8 or out_features % 8:
        raise ValueError(
            f"a [{out_features}, {in_features}] weight: its inputs must split into groups of {group_size} and both "
            "sizes into eights (GPTQ packs eight 4-bit values per int32)"
        )
    w = weight.float().T.reshape(in_features // group_size, group_size, out_features)  # [groups, group, out]
    scales = (w.abs().amax(dim=1) / 7).clamp_min(1e-7).to(torch.float16)  # [groups, out], as stored
    q = (torch.round(w / scales.float()[:, None, :]) + ZERO).clamp(0, 15).to(torch.int32)
    q = q.reshape(in_features, out_features)
    qweight = torch.zeros(in_features // 8, out_features, dtype=torch.int32)  # [in/8, out]
    for j in range(8):
        qweight |= q[j::8] << (4 * j)
    stored_zero = sum((ZERO - 1) << (4 * j) for j in range(8))  # GPTQ stores zero - 1, eight per int32
    qzeros = torch.full((in_features // group_size, out_features // 8), stored_zero, dtype=torch.int32)
    g_idx = torch.arange(in_features, dtype=torch.int32) // group_size
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}


def dequantize_linear(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight [out, in] that quantize_linear's tensors stand for (AutoGPTQ's reading; for checks)."""
    qweight, scales, g_idx = tensors["qweight"], tensors["scales"].float(), tensors["g_idx"].long()
    q = torch.stack([(qweight >> (4 * j)) & 15 for j in range(8)], dim=1).reshape(-1, qweight.shape[1])  # [in, out]
    zeros = torch.stack([(tensors["qzeros"] >> (4 * j)) & 15 for j in range(8)], dim=2).reshape(scales.shape) + 1
    return ((q - zeros[g_idx]) * scales[g_idx]).T


def write_gptq_form(src, dst, *, group_size: int = 32, log=print) -> Path:
    """dst (new): src's checkpoint with every decoder linear weight in GPTQ int4 form, shard by shard. On an error
    nothing is left of dst."""
    src, dst = Path(src), Path(dst)
    if not sorted(src.glob("*.safetensors")) or not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src}: no config.json and *.safetensors files of a Hugging Face checkpoint")
    dst.mkdir(parents=True, exist_ok=False)
    try:
        _write(src, dst, group_size, log)
    except BaseException:
        shutil.rmtree(dst, ignore_errors=True)
        raise
    return dst


def _write(src: Path, dst: Path, group_size: int, log) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    shards = sorted(p.name for p in src.glob("*.safetensors"))
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        out = {}
        with safe_open(str(src / shard), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if LINEAR.match(name):
                    stem = name.removesuffix(".weight")
                    out.update({f"{stem}.{k}": v for k, v in quantize_linear(tensor, group_size).items()})
                else:
                    out[name] = tensor
        save_file(out, str(dst / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, shard))
        total += sum(t.numel() * t.element_size() for t in out.values())
        log(f"{shard} ({i + 1}/{len(shards)}): {len(out)} tensors")
        del out
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "sym": True,
                                     "desc_act": False}  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    written = {"config.json", "model.safetensors.index.json"}
    for extra in src.iterdir():  # the tokenizer, its config, the chat template, ...
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in written:
            shutil.copy2(extra, dst / extra.name)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specbuild.bench.gptq_form", description=__doc__.split("\n")[0])
    parser.add_argument("-i", "--input", required=True, type=Path, help="The Hugging Face checkpoint directory.")
    parser.add_argument("-o", "--output", required=True, type=Path, help="The directory to write (new).")
    parser.add_argument("--group-size", type=int, default=32, help="Inputs per group (GenAI's default).")
    args = parser.parse_args(argv)
    try:
        write_gptq_form(args.input, args.output, group_size=args.group_size)
    except (ValueError, OSError) as exc:  # one line, no traceback: the input or the output path is wrong
        parser.exit(2, f"error: {exc}\n")


if __name__ == "__main__":
    main()
