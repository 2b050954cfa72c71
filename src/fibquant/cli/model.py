"""`fibquant model export-hf DIR`: the default model (or a GGUF / transformers directory) as a Hugging
Face safetensors directory that vLLM loads (see fibquant.integrations.hf_export)."""
from __future__ import annotations

import argparse


def register(subparsers) -> None:
    parser = subparsers.add_parser("model", help="export the model for a serving engine")
    sub = parser.add_subparsers(dest="model_command", required=True)
    export = sub.add_parser("export-hf", help="write the model as a HF safetensors directory (for vLLM)")
    export.add_argument("out", help="the directory to write (must be empty or absent)")
    export.add_argument("--model", default=None, help="a .gguf file or transformers directory (default: SmolLM2)")
    export.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    export.add_argument("--overwrite", action="store_true", help="replace the files of a non-empty directory")
    export.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from fibquant.integrations.hf_export import check_export, export_hf

    out = export_hf(args.out, model=args.model, dtype=args.dtype, overwrite=args.overwrite)
    info = check_export(out)
    print(f"wrote {out}: {info['tensors']} tensors ({args.dtype}), embedding as {info['embedding']}; "
          f"serve it with vLLM: LLM(model={str(out)!r}); FIBQUANT_VLLM_CACHE=fibquant:b=4 switches the FibQuant cache on")
    return 0
