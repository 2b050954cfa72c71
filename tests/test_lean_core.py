"""The core install (no extras) imports none of the `eval` extra's packages and runs the own-model example."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from fibquant._extras import EVAL_PACKAGES

SRC = Path(__file__).resolve().parents[1] / "src"
CORE = ("fibquant", "fibquant.codecs", "fibquant.codebook", "fibquant.kv", "fibquant.kv.cache", "fibquant.kv.specs",
        "fibquant.kv.budget", "fibquant.kv.attention.switch", "fibquant.kv.persist", "fibquant.archive",
        "fibquant.integrations.vllm.config")

# The extra's packages made absent, as in a venv without them: `import` raises ImportError and
# `importlib.util.find_spec` (transformers' availability probe) returns None (a None entry in sys.modules),
# and a meta-path finder refuses any submodule.
BLOCK = textwrap.dedent(f"""
    import sys
    BLOCKED = {EVAL_PACKAGES!r}
    for name in BLOCKED:
        sys.modules[name] = None

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{{name}} is blocked (not in the core install)")
            return None

    sys.meta_path.insert(0, Block())
""")


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)


def test_importing_the_core_pulls_no_eval_package():
    code = (f"import importlib, sys\nfor m in {CORE!r}: importlib.import_module(m)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {EVAL_PACKAGES!r}))")
    done = _python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_own_model_example_runs_with_the_extra_blocked(tmp_path):
    """The README's own-model example on a tiny random Llama saved to a local directory."""
    example = BLOCK + textwrap.dedent(f"""
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
        import fibquant

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=64)
        LlamaForCausalLM(config).save_pretrained({str(tmp_path)!r})
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
        inputs = {{"input_ids": torch.randint(3, 128, (1, 48))}}
        cache = fibquant.CompressedCache.for_model(model, "e8shell:b=2,nc=1")
        with fibquant.attention_on_codes(model):
            out = model.generate(**inputs, past_key_values=cache, max_new_tokens=8, do_sample=False)
        assert out.shape == (1, 56) and cache.layers[0].num_coded > 0
        spec = fibquant.choose_code(model, ratio=6, context=4096)
        fibquant.CompressedCache.for_model(model, "ratio=6")
        try:
            fibquant.kv.model.load_model()
        except ImportError as exc:
            assert "fibquant[eval]" in str(exc), exc
        import sys
        print("ok", spec, sorted(m for m, v in sys.modules.items() if v is not None and m.split('.')[0] in BLOCKED))
    """)
    done = _python(example)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().startswith("ok ") and done.stdout.strip().endswith("[]"), done.stdout


def test_every_reach_family_runs_on_codes_with_the_extra_blocked():
    """The own-model example's calls on the tiny random config of every family of the model-reach table
    (docs/models.md), MLA included: a cache from a spec, a prompt past the exact window under the switch,
    a generate; the families the table refuses raise ValueError in for_model."""
    code = BLOCK + textwrap.dedent("""
        import torch
        import fibquant
        from fibquant.eval.model_reach import FAMILIES

        results = {}
        for name, family in FAMILIES.items():
            model = family.build(0)
            try:
                cache = fibquant.CompressedCache.for_model(model, "fibquant:b=4")
            except ValueError:
                results[name] = "refused"
                continue
            inputs = torch.randint(3, model.config.get_text_config().vocab_size, (1, 96))
            with torch.no_grad(), fibquant.attention_on_codes(model):
                out = model.generate(inputs, past_key_values=cache, max_new_tokens=2, min_new_tokens=2,
                                     do_sample=False, pad_token_id=0)
            assert out.shape == (1, 98), (name, out.shape)
            coded = any(getattr(layer, "num_coded", 0) > 0 for layer in cache.layers)
            window = getattr(model.config.get_text_config(), "sliding_window", None)
            # every layer a sliding window shorter than the prompt: the window is held exact, nothing to code
            results[name] = "coded" if coded else "window" if window and window < 96 else "no codes"
        import sys
        print(results)
        print(sorted(m for m, v in sys.modules.items() if v is not None and m.split('.')[0] in BLOCKED))
    """)
    done = _python(code)
    assert done.returncode == 0, done.stderr[-3000:]
    results_line, modules_line = done.stdout.strip().splitlines()[-2:]
    results = ast.literal_eval(results_line)  # a dict literal printed by the child
    assert modules_line == "[]"
    assert {name for name, status in results.items() if status == "refused"} == {"Qwen3-Next", "Jamba", "Mamba"}
    assert [name for name, status in results.items() if status == "no codes"] == []
