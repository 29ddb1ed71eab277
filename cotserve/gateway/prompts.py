"""The gateway's prompts: the chat template with the request's tools and the token count
(`PromptBuilder`); the workers get token ids."""

from __future__ import annotations

from typing import Any

from cotserve.engine.textproc import encode_chat
from cotserve.errors import CotserveError
from cotserve.gateway.tools import fallback_history, native_history, template_supports_tools
from cotserve.policies.served import ServedModel


class PromptBuilder:
    """Chat template + token counting, on the gateway side (the workers get token ids)."""

    def __init__(self, tokenizer, context_len: int, path: str | None = None, model: ServedModel | None = None):
        self.tokenizer = tokenizer
        self.context_len = int(context_len)
        self.path = path  # the model folder (generation_config.json), when known
        # the served model's shape and name, when known: per-request policy options are then
        # checked against it and the server's files at the gateway (`policies/served.py`)
        self.model = model
        self.native_tools = template_supports_tools(tokenizer)

    @classmethod
    def from_model(cls, spec: str | None, max_model_len: int | None = None) -> PromptBuilder:
        from transformers import AutoConfig, AutoTokenizer

        from cotserve.models import resolve_model

        path = resolve_model(spec)
        cfg = AutoConfig.from_pretrained(str(path))
        ctx = getattr(cfg, "max_position_embeddings", 1 << 20)
        if max_model_len is not None:
            if max_model_len < 2:
                raise CotserveError("--max-model-len must be at least 2")
            if max_model_len > ctx:  # as vLLM refuses it: positions the model was not trained on
                raise CotserveError(f"--max-model-len {max_model_len} is beyond the model's {ctx} positions "
                                    "(max_position_embeddings)")
            ctx = max_model_len
        return cls(AutoTokenizer.from_pretrained(str(path)), ctx, str(path), ServedModel.from_config(spec, cfg))

    def encode(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               prefix: str = "", template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Prompt ids: the template over the history (tools natively or by the fallback), then
        `prefix` (a forced start of the reply) as plain text. `template_kwargs`: the request's
        chat_template_kwargs (extra template variables)."""
        if self.native_tools:
            ids = encode_chat(self.tokenizer, native_history(messages), tools, template_kwargs=template_kwargs)
        else:
            ids = encode_chat(self.tokenizer, fallback_history(messages, tools), template_kwargs=template_kwargs)
        if prefix:
            ids = ids + self.tokenizer.encode(prefix, add_special_tokens=False)
        return ids
