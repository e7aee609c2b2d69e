"""The inference server: chat completions for base models, fine-tuned models and checkpoints (torch inside)."""
