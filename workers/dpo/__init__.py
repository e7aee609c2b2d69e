"""Direct preference optimization (`method.type = "dpo"`, docs/dpo.md)."""
