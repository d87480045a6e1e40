"""What every layer reads: the run config and its schema, SamplingParams' defaults from
generation_config.json, the forward batch (batch), and safe text reading (textio). Imports nothing of
tp_engine but kernels-free helpers of its own."""
