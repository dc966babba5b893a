"""benchmarks/profile_llama_cpp.py: perf's report is read into samples per symbol, and the symbols llama-server
showed on Qwen2.5-Coder-1.5B (2026-12-05) fall in the phases the profile's conclusions rest on (the target's
Q4_K/Q6_K kernels apart from the head's q8_0 ones; the kernel's and the sampler's apart from ggml's)."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("profile_llama_cpp", ROOT / "benchmarks" / "profile_llama_cpp.py")
profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile)

REPORT = """
    29047  [.] ggml_gemm_q4_K_8x8_q8_K
    11755  [.] ggml_gemv_q4_K_8x8_q8_K
    15850  [.] ggml_vec_dot_q6_K_q8_K
     1802  [.] ggml_vec_dot_q8_0_q8_0
     1725  [k] _raw_spin_unlock_irqrestore
     1429  [.] (anonymous namespace)::tinyBLAS_Q0_AVX<block_q8_0, block_q8_0, float>::gemm4xN<3>
     1218  [.] ggml_compute_forward_flash_attn_ext
      104  [.] ggml_graph_compute_thread.isra.0
       40  [.] llama_sampler_sample
       12  [.] ggml_backend_sched_graph_compute_async
"""


def test_perf_report_becomes_samples_per_symbol_and_phases():
    samples = profile.symbol_samples(REPORT)
    assert samples["ggml_gemm_q4_K_8x8_q8_K"] == 29047 and samples["[k] _raw_spin_unlock_irqrestore"] == 1725
    assert len(samples) == 10
    phases = profile.by_phase(samples)
    head = "q8_0 matmul (the head; any q8_0 tensor of the target)"
    assert phases["target matmul (q4_K/q5/q6_K)"] == 29047 + 11755 + 15850
    assert phases[head] == 1802 + 1429  # the tinyBLAS q8_0 gemm too: a q8_0 weight, not the target's Q4_K
    assert phases["kernel"] == 1725
    assert phases["attention, norms, activations (other ggml ops)"] == 1218
    assert phases["thread sync (ggml barrier, spin)"] == 104
    assert phases["sampling"] == 40
    assert phases["graph build, allocation, scheduling"] == 12
