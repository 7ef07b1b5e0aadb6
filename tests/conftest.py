import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The tiny demo GGUF (10 MB, f32), written once per test run; never downloaded."""
    from meshnode.ops.models import make_model

    return str(make_model(tmp_path_factory.mktemp("models") / "tiny.gguf", "tiny", 0))
