import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))
# every process a test launches starts with subprocess_site/sitecustomize.py (no DeepSpeed shm-op compile)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(Path(__file__).parent / "subprocess_site"), *filter(None, [os.environ.get("PYTHONPATH")])])
# One torch thread for every test (not only those using one_thread): the models here are tiny or small,
# and 2 OpenMP threads spin-wait on a 2-core machine (15 files without the fixture: 162 s -> 62 s wall).
torch.set_num_threads(1)

# scripts/test.sh runs the suite on 2 pytest-xdist workers (--dist loadgroup), so both cores work while each
# test keeps its one thread. The files below launch several processes through torch.distributed (each launch on a
# free port, never the default 29500): they run one after another, on one worker, so launches do not share 2 cores.
LAUNCHING = {"test_data_prep_prepare.py", "test_decode_cli.py", "test_tensor_parallel.py",
             "test_train_distributed.py", "test_train_reliability.py"}


# Real tests of the engines' servers need the llama.cpp build and the vLLM environment, which scripts/test.sh
# starts making in the background as the suite starts (~5 CPU-minutes); run last, they find them made instead of
# holding a worker idle on the build's lock.
ENGINES = {"test_llama_cpp.py", "test_llama_cpp_dflash.py", "test_gguf_relabel.py", "test_vllm_cpu.py",
           "test_data_prep_engine.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in LAUNCHING:
            item.add_marker(pytest.mark.xdist_group("launchers"))
    items.sort(key=lambda item: item.path.name in ENGINES and item.get_closest_marker("real") is not None)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct target, fp32 (converted once into the asset cache), its linears packed as
    ``eaglekit generate`` and ``bench`` pack them on a CPU (``cpu_linear=packed``, their default): aten's linear
    multiplies 2-5 rows (a small verify pass) up to 4x slower than one row on this machine's MKL, and the real
    decoding tests ran ~25% longer unpacked. transformers' greedy references decode the same packed model;
    tests/target/test_packed_linear.py checks packed decoding against an unpacked model's."""
    from eaglekit.target import load_target
    from eaglekit.target.packed_linear import pack_linears

    target = load_target("smollm2-135m-instruct")
    pack_linears(target.model)
    return target


@pytest.fixture(scope="session")
def qwen05():
    """The real Qwen2.5-Coder-0.5B-Instruct target, fp32 (unpacked: a packed copy is 2 GB more per worker)."""
    from eaglekit.target import load_target

    return load_target("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="module")
def qwen05_packed(qwen05):
    """``qwen05`` with its linears packed for one module's decoding tests (as ``smollm2`` is), unpacked after."""
    from eaglekit.target.packed_linear import pack_linears, unpack_linears

    pack_linears(qwen05.model)
    yield qwen05
    unpack_linears(qwen05.model)


@pytest.fixture
def one_thread():
    """Run a test on one torch thread (tiny models gain nothing from threads; 2 OpenMP threads spin-wait
    badly on a busy 2-core machine). Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
