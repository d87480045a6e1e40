from tp_engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tp_engine.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                     RowParallelLinear)
from tp_engine.layers.moe import FusedMoE, TopKRouter
from tp_engine.layers.norm import RMSNorm
from tp_engine.layers.rotary import RotaryEmbedding

__all__ = ["ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "ParallelLMHead", "RMSNorm", "RotaryEmbedding", "TopKRouter", "FusedMoE"]
