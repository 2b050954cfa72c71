"""`AttentionOptions`: every choice of path that attention on codes makes, in one frozen object.

The defaults are the tuned ones; each field switches one faster path off (or picks a backend) so that
it can be compared with the path beneath it. Attention reads the options it is given, never a module
global: a `CompressedCache(options=...)` hands its options to every `CodedKV` it returns (so the
"fibquant" attention function sees them), `paged_decode_attention(options=...)` takes them directly,
and the vLLM plugin reads them from `FIBQUANT_VLLM_ATTENTION` (`parse`, e.g.
`defer_codes=off,gather_decode=values`; `fibquant.integrations.vllm.config.active_config`, the one place
the environment is read).

transformers cache (`fibquant.kv.attention.entry`):

    numba_decode        one-token steps on the CPU through the fused numba kernels (one per code family);
                        False: the torch ops and the two table kernels
    fused_backend       the coded columns of a prefill chunk through one fused Triton kernel: "auto" (CUDA
                        tensors when triton imports), "triton" (forced; CPU tensors need TRITON_INTERPRET=1),
                        "off"

paged codes (`fibquant.kv.attention.paged`, the vLLM plugin's CPU pages):

    gather_decode       decode-then-dot (vector gathers from the codebook) for the roles whose codes allow it
                        (FibQuant at 4 bits, 16 scalar codewords): True (both roles), "keys", "values", False
                        (lookup tables everywhere). Default True: in the vLLM layer step at 4 bits both roles
                        gathered took 0.88-0.91x the time of the table path at load 1.2-1.5, values only
                        0.93-0.94x; at load 5.6-6.3 values only did best (0.88-0.90 against 0.91-0.97)
                        (benchmarks/vllm_layer_step.py --gather); 4-bit codes of 16 scalar codewords decoded
                        in registers: 1.6-1.8x bf16's layer step against 7.3x through byte tables

vLLM backend (`fibquant.integrations.vllm.backend`):

    paged_numba_decode  batches of one-token steps on CPU pages through the paged numba kernel (codes read
                        in place through the block tables); False: the gathered, padded path of `attend_codes`
    paged_coded_backend the coded tokens through the paged Triton kernel: "auto" (CUDA pages when triton
                        imports), "triton" (forced; CPU pages need TRITON_INTERPRET=1 before triton is first
                        imported), "off" (the gathered path)
    defer_codes         decode tokens of sequences with a whole exact window have their codes written in one
                        batched encode every `VllmCacheConfig.deferred_steps` forwards; False: every forward
                        encodes its own
    lean_decode         a steady decode step (every request one new token with a whole exact window, all
                        writes deferred) takes the backend's lean path (per-step facts from the forward's
                        window plan, the kernel's arrays kept between calls); False: the general path
    chunk_kernel        a first prefill chunk attends among its own tokens through vLLM's CPU attention
                        kernel where it serves the dtype and head size (~0.7x torch SDPA's time at 1,024
                        tokens); False: torch's scaled_dot_product_attention
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Union

_BACKENDS = ("auto", "triton", "off")
_GATHERS = (True, False, "keys", "values")
_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


@dataclass(frozen=True)
class AttentionOptions:
    """The paths attention on codes takes (see the module docstring); validated on construction."""

    numba_decode: bool = True
    fused_backend: str = "auto"
    gather_decode: Union[bool, str] = True
    paged_numba_decode: bool = True
    paged_coded_backend: str = "auto"
    defer_codes: bool = True
    lean_decode: bool = True
    chunk_kernel: bool = True

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name.endswith("_backend"):
                if value not in _BACKENDS:
                    raise ValueError(f"{field.name} must be one of {_BACKENDS}, got {value!r}")
            elif field.name == "gather_decode":
                if not any(value is choice or (isinstance(choice, str) and value == choice) for choice in _GATHERS):
                    raise ValueError(f"gather_decode must be True, False, 'keys' or 'values', got {value!r}")
            elif not isinstance(value, bool):
                raise ValueError(f"{field.name} must be True or False, got {value!r}")

    @property
    def gathers(self) -> tuple[bool, bool]:
        """(keys, values): whether `gather_decode` asks for decode-then-dot on each role."""
        return self.gather_decode in (True, "keys"), self.gather_decode in (True, "values")

    @classmethod
    def parse(cls, text: str) -> "AttentionOptions":
        """`name=value,...` (booleans as on/off, true/false, 1/0, yes/no) over the defaults; "" gives them."""
        names = {field.name for field in fields(cls)}
        changes = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = (s.strip() for s in item.partition("="))
            if not sep or name not in names:
                raise ValueError(f"attention option {item!r}: expected NAME=VALUE with NAME one of {sorted(names)}")
            lowered = value.lower()
            changes[name] = True if lowered in _TRUE else False if lowered in _FALSE else lowered
        return replace(cls(), **changes)


DEFAULT_OPTIONS = AttentionOptions()
