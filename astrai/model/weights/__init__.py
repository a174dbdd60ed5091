"""Readers of model weight formats beyond a safetensors directory."""
