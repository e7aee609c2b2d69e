"""The financial-reports demo: corpora (synthetic, TAT-QA), a tool server and an endpoint grader."""
