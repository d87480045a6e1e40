"""Speculative decoding: the draft proposers and their engine-side glue; imports models and below."""
