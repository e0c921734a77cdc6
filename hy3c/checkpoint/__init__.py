"""`hy3c.checkpoint`: Hugging Face checkpoint directories in and out — safetensors reading and writing
(`safetensors_io`), the hub/transformers tensor names (`weight_map`), streaming load into the model
(`loader`), random checkpoints at any preset (`random_checkpoint`, with `tiny_tokenizer`), BF16 → FP8
conversion (`fp8_convert`) and the tokenizer with its chat template (`tokenizer`)."""
