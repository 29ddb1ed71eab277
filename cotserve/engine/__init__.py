"""The native engine: cotserve KV cache, decode loop, sampling, detokenization."""
