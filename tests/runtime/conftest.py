import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def one_process():
    """The in-process loops' one-rank group and one torch thread (the actors' reduction order) are this
    process's: put both back afterwards."""
    threads, had_group = torch.get_num_threads(), dist.is_initialized()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    if dist.is_initialized() and not had_group:
        dist.destroy_process_group()
