"""Reading a Hugging Face checkpoint: config.json (model_config, its field type checks in
model_config_checks), the quantization formats (quant) and the safetensors weights, each rank its shards
(loader). May import base, comm and kernels-free torch code; never layers or anything above."""
