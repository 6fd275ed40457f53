# The two commands of the quick start:
#   make serve   set up, then serve the demo pair on local Ray with an embedded Redis (Ctrl-C stops it)
#   make test    set up, then lint (ruff) and run the whole test suite
.PHONY: setup serve generate test bench

setup:
	./ops/setup.sh

serve: setup
	.venv/bin/specserve serve

generate: setup
	.venv/bin/specserve generate --chat --prompt "Explain speculative decoding in two sentences."

test: setup
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q

bench: setup
	.venv/bin/specserve bench
