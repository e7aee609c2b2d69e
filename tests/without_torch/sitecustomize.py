"""Put on PYTHONPATH, makes `import torch` fail in that process (as if it were not installed): a test
runs a process that must not need torch there (the front of a vLLM fleet holds tokenizers only)."""

import sys

sys.modules["torch"] = None  # type: ignore[assignment] - the import system's "not importable"
