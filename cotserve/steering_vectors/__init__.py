"""Built steering vectors (data): <model-slug>/layer_<L>.safetensors plus a JSON manifest each."""
