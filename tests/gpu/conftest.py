import pytest


def pytest_collection_modifyitems(config, items):
    """Everything under tests/gpu needs CUDA: mark it, and skip it cleanly where there is none."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)
            if not has_cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
