import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The tiny demo GGUF (10 MB, f32), written once per test run; never downloaded."""
    from meshnode.ops.models import make_model

    return str(make_model(tmp_path_factory.mktemp("models") / "tiny.gguf", "tiny", 0))


def pytest_collection_modifyitems(items):
    """Every test that needs the model (directly or through a fixture) loads llama.cpp or starts a node:
    slow. The few that start processes without it carry the marker themselves."""
    for item in items:
        if "tiny_model" in item.fixturenames:
            item.add_marker(pytest.mark.slow)
