"""pdctl's vLLM KV connector plugin, loaded by vLLM through kv_connector_module_path."""
