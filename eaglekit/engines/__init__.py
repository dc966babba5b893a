"""The engines eaglekit serves heads in, each pinned and made once into the asset cache, talked to only over
HTTP as a user's deployment would be:

- ``llama_cpp``: llama.cpp built from the llama-cpp-python sdist (what eaglekit changes in it is listed there
  and stamped on the cache), a head exported as the GGUF llama-server drafts with, ``Server`` (llama-server);
- ``vllm_cpu``: vLLM's CPU backend in a virtual environment of its own, ``Server`` (``vllm serve``);
- ``gguf_relabel``: a Qwen2 GGUF rewritten as llama, for a stock llama-server that records no Qwen2 layer inputs;
- ``server``: what they share (a server process that dies with its parent, ports, commands, τ counts).

The benchmarks that drive them are in ``eaglekit.bench`` (``bench/llama_cpp.py``, ``bench/vllm.py``).
"""
