"""The engine at run time: building the model and KV pool on each rank (engine, engine_setup), the
memory plan, the requests, the scheduler and its step budget, the page pool and prefix cache, a step's plan
and the message every rank decodes, the sampled tokens' way back, and CUDA graphs. May import base,
kernels, comm, attention, checkpoint, sampling, layers and models; never frontend, llm or cli."""
