"""Reading a Hugging Face checkpoint: config.json (model_config), the quantization formats (quant) and the
safetensors weights, each rank its shards (loader). May import base, comm and kernels-free torch code; never
layers or anything above."""
