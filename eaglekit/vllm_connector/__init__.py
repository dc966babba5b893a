"""Code that runs inside vLLM's own environment, not eaglekit's: ``eaglekit_hidden_states`` is loaded by a
`vllm serve` through ``kv_transfer_config.kv_connector_module_path`` with this folder on its PYTHONPATH
(eaglekit.data_prep.engine). Nothing in eaglekit imports it."""
