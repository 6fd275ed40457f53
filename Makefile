# The two commands of the quick start:
#   make serve   set up, then serve the demo pair on local Ray with an embedded Redis (Ctrl-C stops it)
#   make test    set up (with the test extras), then lint (ruff) and run the whole test suite
.PHONY: setup setup-test serve generate test bench

# What serving needs: the venv with the pinned packages and the demo model. No OS packages, no root.
setup:
	./ops/setup.sh

# The test path adds the `ray up` tests' OS packages (SSH server, rsync); where it cannot (not root), it says so
# and those tests skip with the reason.
setup-test: setup
	./ops/setup_ci_extras.sh

serve: setup
	.venv/bin/specserve serve

generate: setup
	.venv/bin/specserve generate --chat --prompt "Explain speculative decoding in two sentences."

# compileall: the project's bytecode once, not in each of the suite's Ray and server processes (where
# PYTHONDONTWRITEBYTECODE is set, as on CI's machines, nothing else would write it)
test: setup-test
	.venv/bin/ruff check .
	.venv/bin/python -m compileall -q pipeline deployments specserve ops tests
	.venv/bin/python -m pytest -q -n 2 --durations=25

bench: setup
	.venv/bin/specserve bench
