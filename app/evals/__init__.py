"""OpenAI's Evals API (`/v1/evals`), with tool-using runs and a comparison of runs item by item."""
