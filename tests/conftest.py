"""Session-wide fixtures shared by the test modules."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def model_and_tokenizer():
    """The real default model (SmolLM2-135M-Instruct GGUF) and tokenizer, loaded once per session.

    Tests using it must be marked `@pytest.mark.model`. Skipped, with the install command, when
    the model package is absent.
    """
    from fibquant.kv.model import load_model

    try:
        return load_model()
    except ValueError as exc:  # the default model package is not installed
        pytest.skip(str(exc))
