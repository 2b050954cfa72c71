"""Long-context passkey retrieval on Austen text with each cache compressing the haystack.

Usage: .venv/bin/python benchmarks/needle.py [--lengths 1024 2048] [--depths 0 0.25 0.5 0.75 1] [--keys 2]
       [--caches 'fp;fibquant:b=2;fibquant:b=2/fibquant:b=1;quanto-rt:b=2'] [--threads 1]
       [--task ruler-niah_single_1]   (RULER's task through lm-eval's generator: pip install 'fibquant[ruler]')
Lengths up to the model's context (8192: the haystack is then shortened to leave room for question + answer).
Prints the table and the >= 10x target; writes results/needle.json and .png (needle_ruler.* for RULER).
Same as `fibquant eval needle`.
"""
import sys

from fibquant.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "needle", *sys.argv[1:]]))
