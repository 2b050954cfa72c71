"""Time to first token, decode speed and memory of KV caches: DynamicCache vs CompressedCache
(FibQuant / TurboQuant, attention on codes and the decode path) vs transformers' QuantizedCache
(quanto / hqq).

Usage: .venv/bin/python benchmarks/decode_speed.py [--contexts 1024 2048 4096 8192] [--decode-tokens 32]
       [--caches fp fibquant:b=4 fibquant:b=4@decode quanto:b=4 ...] [--parts ttft,chunked,decode]
       [--chunk-tokens 512] [--prefill-repeats 1] [--threads 1] [--out results/]
--parts ttft: only the one-shot time to first token (a fresh cache, the whole prompt in one
forward); chunked: the prompt in --chunk-tokens chunks; decode: greedy steps from one shared
float prefill. Timed on 1 torch thread unless --threads says otherwise; wall clock and CPU time.
Prints the tables and the issue-17 targets; writes results/decode_speed.json and .png. Same as
`fibquant eval decode-speed`; the work is done by fibquant.eval.decode_speed.
"""
import sys

from fibquant.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "decode-speed", *sys.argv[1:]]))
