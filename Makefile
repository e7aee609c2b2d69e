# The two commands of the README's Quick start. Extra arguments: make demo ARGS="--quick".
.PHONY: demo test

demo:
	bash scripts/demo.sh $(ARGS)

test:
	bash scripts/test.sh $(ARGS)
