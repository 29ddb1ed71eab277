"""Constrained output (JSON, regex, choice, grammar): the request forms both the gateway and the
engines name, with no imports (the gateway stays free of torch)."""

# vLLM's StructuredOutputsParams fields a request may set, exactly one of them
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
