"""What a job reads and writes around the engine: prompts and their encoding, results and the output file,
progress and streaming, the reasoning split, stop strings, and the launcher watch. May import base (and
torch-free libraries); never runtime: LLM joins the two."""
