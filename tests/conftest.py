import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread, above all on a busy machine; restore after.
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
