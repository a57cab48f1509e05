"""GGUF files: reading and checking them, the model they describe (`LlamaConfig`, per family), their block formats."""
