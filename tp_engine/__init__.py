"""tp_engine: a small tensor-parallel inference engine for Qwen3 dense models."""


def __getattr__(name):
    # both need torch, and LLM the engine and torch.distributed: import them on first use only, so that the
    # command line can refuse a bad config before torch loads
    if name == "LLM":
        from tp_engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from tp_engine.sampling.sampler import SamplingParams
        return SamplingParams
    if name == "TokenUpdate":
        from tp_engine.frontend.token_stream import TokenUpdate
        return TokenUpdate
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "TokenUpdate"]
