"""The embedded chat LLM of /v1/realtime: a small Llama-shaped model batched across conversations on the CPU."""
