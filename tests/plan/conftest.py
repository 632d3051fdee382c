"""Fixtures shared by the planning tests."""
import pytest


@pytest.fixture(scope="module")
def base_dir(request, tmp_path_factory):
    """A tiny transformers Llama checkpoint of the requesting test module's ``HF`` config."""
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("base")
    transformers.LlamaConfig(**request.module.HF).save_pretrained(d)
    return d
