"""The contract between the engines and the policies: what a forward pass and the policies' hooks
see (`batch.BatchState`, `batch.ModelInfo`) and the per-sequence KV cache (`cache.KVCache`).
Below both: it imports neither an engine nor a policy."""
