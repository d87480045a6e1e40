"""Choosing tokens from logits: greedy, temperature, top-k and top-p with seeded Gumbel draws, and logprobs.
May import base and kernels; nothing above."""
