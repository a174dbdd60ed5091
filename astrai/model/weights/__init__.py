"""Readers of model weight formats: safetensors directories, GGUF files, hub ids."""
