"""tp_engine: a small tensor-parallel inference engine for Qwen3 dense models."""
from tp_engine.sampler import SamplingParams


def __getattr__(name):
    # LLM pulls in the engine and torch.distributed; import it on first use only.
    if name == "LLM":
        from tp_engine.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams"]
